"""A plan's lifetime and ownership: release and close, copies and pickles, refused rebinds, and
several threads stepping one plan (tests/gpu/test_plan_lifetime_gpu.py runs them on a GPU)."""
from __future__ import annotations

import copy
import gc
import pickle
import threading

import numpy as np
import pytest
import torch

import mtapply
from mtapply.plan import Plan
from mtapply.ops import AdamSpec

SHAPES = [(5,), (3, 4), (0,), (300,)]
HYPER = dict(lr=1e-2, step=1)


def adam_lists(rng, lib="numpy"):
    out = {}
    for slot in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
        arrays = [np.float32(rng.standard_normal(s) ** (2 if slot == "exp_avg_sqs" else 1))
                  for s in SHAPES]
        out[slot] = arrays if lib == "numpy" else [torch.from_numpy(a) for a in arrays]
    return out


def snapshot(tensors: dict) -> list:
    return [np.asarray(t).tobytes() for column in tensors.values() for t in column]


def plan_of(tensors: dict) -> Plan:
    return mtapply.adam_plan(tensors["params"], tensors["grads"], tensors["exp_avgs"],
                             tensors["exp_avg_sqs"])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("slot", ["params", "grads", "exp_avg_sqs"])
def test_a_step_after_a_released_tensor_was_freed_is_refused(lib, slot):
    tensors = adam_lists(np.random.default_rng(0), lib)
    plan = plan_of(tensors)
    plan.release(slot)
    plan.step(**HYPER)  # the caller still holds them: fine
    tensors[slot][3] = None
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"{slot}\[3\] was freed after "
                                           rf"plan.release\('{slot}'\).*plan.rebind"):
        plan.step(**HYPER)
    fresh = adam_lists(np.random.default_rng(1), lib)[slot]
    tensors[slot] = fresh
    plan.rebind(slot, fresh)  # bound to live tensors again: steps run
    before = snapshot(tensors)
    plan.step(**HYPER)
    assert snapshot(tensors) != before


def test_addresses_rebound_by_the_caller_make_a_plan_usable_again():
    tensors = adam_lists(np.random.default_rng(2), "torch")
    plan = plan_of(tensors)
    plan.release("grads")
    tensors["grads"] = [g.clone() for g in tensors["grads"]]
    gc.collect()
    with pytest.raises(RuntimeError, match=r"grads\[\d\] was freed"):
        plan.step(**HYPER)
    plan.rebind_addresses("grads", tensors["grads"],
                          np.array([g.data_ptr() for g in tensors["grads"]], np.uint64))
    plan.step(**HYPER)


def test_the_one_call_api_steps_fresh_tensors_at_the_same_addresses():
    """Its remembered plans hold no tensor: a call whose tensors lie where a freed call's did
    steps them (it describes them first)."""
    rng = np.random.default_rng(3)
    for _ in range(3):
        tensors = adam_lists(rng, "torch")
        before = snapshot(tensors)
        mtapply.adam_step(tensors["params"], tensors["grads"], tensors["exp_avgs"],
                          tensors["exp_avg_sqs"], **HYPER)
        assert snapshot(tensors) != before
        del tensors
        gc.collect()


def test_a_closed_plan_refuses_everything():
    tensors = adam_lists(np.random.default_rng(4))
    plan = plan_of(tensors)
    plan.step(**HYPER)
    plan.close()
    before = snapshot(tensors)
    for call in (lambda: plan.step(**HYPER), lambda: plan.rebind("grads", tensors["grads"]),
                 lambda: plan.invalid, lambda: plan.sums(), lambda: plan.clear_invalid(),
                 lambda: plan.count_steps(np.zeros(1, np.float32))):
        with pytest.raises(RuntimeError, match=r"this plan was closed \(Plan.close\): build a "
                                               r"new plan"):
            call()
    plan.close()  # again: nothing more to do
    plan.release("grads")
    assert snapshot(tensors) == before


def test_close_lets_the_tensors_go():
    tensors = adam_lists(np.random.default_rng(5), "torch")
    plan = plan_of(tensors)
    import weakref

    watch = weakref.ref(tensors["params"][1])
    tensors = None
    gc.collect()
    assert watch() is not None  # the plan holds it
    plan.close()
    gc.collect()
    assert watch() is None


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy,
                                    lambda plan: pickle.loads(pickle.dumps(plan))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_plan_is_not_copied(copier):
    tensors = adam_lists(np.random.default_rng(6))
    plan = plan_of(tensors)
    with pytest.raises(TypeError, match=r"a Plan holds device memory and the addresses of its "
                                        r"tensors: it cannot be copied or pickled. Build a new "
                                        r"plan over the copied tensors"):
        copier(plan)
    if copier is not copy.copy:  # (a shallow copy of a holder shares the plan)
        with pytest.raises(TypeError, match="cannot be copied"):  # inside another object too
            copier({"state": [plan]})
    plan.step(**HYPER)  # the plan itself goes on


@pytest.mark.parametrize("slot", ["params", "grads"])
@pytest.mark.parametrize("count", [3, 5])
def test_a_rebind_of_the_wrong_length_is_refused_and_changes_nothing(slot, count):
    rng = np.random.default_rng(7)
    tensors = adam_lists(rng)
    plan = plan_of(tensors)
    other = [np.float32(rng.standard_normal(s)) for s in SHAPES]
    wrong = (other + [np.zeros(3, np.float32)])[:count]
    bound = "the plan" if slot == "params" else "params"
    with pytest.raises(ValueError, match=rf"{slot} has {count} tensors but {bound} has 4"):
        plan.rebind(slot, wrong)
    with pytest.raises(ValueError, match=rf"{slot} has {count} addresses but the plan has 4"):
        plan.rebind_columns({slot: np.zeros(count, np.uint64)})
    reference = adam_lists(np.random.default_rng(7))
    plan_of(reference).step(**HYPER)  # the original binding, stepped
    plan.step(**HYPER)
    assert snapshot(tensors) == snapshot(reference)


def test_a_rebind_refused_at_its_last_tensor_leaves_the_binding():
    rng = np.random.default_rng(8)
    tensors = adam_lists(rng)
    plan = plan_of(tensors)
    fresh = [np.float32(rng.standard_normal(s)) for s in SHAPES]
    fresh[-1] = fresh[-1].astype(np.float64)
    with pytest.raises(ValueError, match=r"grads\[3\] is float64"):
        plan.rebind("grads", fresh)
    reference = adam_lists(np.random.default_rng(8))
    plan_of(reference).step(**HYPER)
    plan.step(**HYPER)
    assert snapshot(tensors) == snapshot(reference)


def test_threads_stepping_one_plan_take_turns():
    """Steps from several threads run one at a time: a counting plan counts every one, and
    the result is what the same number of steps in one thread gives."""
    rng = np.random.default_rng(9)
    tensors, reference = adam_lists(rng), None
    reference = {k: [t.copy() for t in v] for k, v in tensors.items()}
    plan, alone = plan_of(tensors), plan_of(reference)
    counter, counted = np.zeros(1, np.float32), np.zeros(1, np.float32)
    plan.count_steps(counter)
    alone.count_steps(counted)
    per_thread, threads = 25, 4
    barrier = threading.Barrier(threads)

    def work():
        barrier.wait()
        for _ in range(per_thread):
            plan.step(lr=1e-3)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for _ in range(per_thread * threads):
        alone.step(lr=1e-3)
    assert counter.tolist() == [per_thread * threads] == counted.tolist()
    assert snapshot(tensors) == snapshot(reference)


def test_plan_spec_and_unknown_slot_messages():
    plan = plan_of(adam_lists(np.random.default_rng(10)))
    with pytest.raises(ValueError, match="'momentum' is not a slot of adam"):
        plan.release("momentum")
    with pytest.raises(ValueError, match="'momentum' is not a slot of adam"):
        plan.rebind_columns({"momentum": np.zeros(4, np.uint64)})
    assert isinstance(plan.spec, AdamSpec)


class _Stream:
    """A stand-in for a CuPy stream, whose handle dies with the object."""

    def __init__(self, ptr: int):
        self.ptr = ptr


def test_a_plan_keeps_the_objects_of_its_latest_two_streams():
    """The next launch on another stream orders itself after the latest one's work, so the
    objects owning the latest two streams stay alive; older ones go."""
    import weakref

    plan = Plan(AdamSpec(), adam_lists(np.random.default_rng(8)))
    streams = [_Stream(ptr) for ptr in (11, 12, 13)]
    alive = [weakref.ref(s) for s in streams]
    for s in streams:
        assert plan._stream_for(0, s) == s.ptr
    assert plan._stream_for(0, streams[2]) == 13  # the same again changes nothing
    assert plan._stream_for(0, 14) == 14  # a raw handle is the caller's to keep
    del s, streams
    gc.collect()
    assert [r() is not None for r in alive] == [False, True, True]
