"""A plan's lifetime on the GPU (tests/test_plan_lifetime.py has the CPU's): a step after a
released tensor was freed is refused, a closed plan refuses and gives its memory back once its
launches have run, copies are refused, a refused rebind leaves the tables, and threads stepping
one plan on their own streams take turns in order."""
from __future__ import annotations

import copy
import gc
import threading

import pytest

import mtapply
from mtapply import _tables

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(1000,), (2 * CHUNK + 3,), (0,)]


def adam_lists(seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    made = [[torch.randn(s, generator=g, device="cuda") for s in SHAPES] for _ in range(4)]
    for v in made[3]:
        v.abs_()
    return made


def test_a_step_after_a_released_cuda_tensor_was_freed_is_refused():
    params, grads, ms, vs = adam_lists(0)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.release("grads")
    plan.step(lr=1e-2, step=1)
    grads[1] = torch.randn_like(grads[1])  # the bound one is freed
    gc.collect()
    before = params[1].clone()
    with pytest.raises(RuntimeError, match=r"grads\[1\] was freed after plan.release"):
        plan.step(lr=1e-2, step=2)
    plan.rebind("grads", grads)
    plan.step(lr=1e-2, step=2)
    torch.cuda.synchronize()
    assert not torch.equal(params[1], before)


def test_close_refuses_and_gives_the_memory_back_after_its_launches():
    params, grads, ms, vs = adam_lists(1)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    held = torch.cuda.Stream()
    with torch.cuda.stream(held):
        torch.cuda._sleep(20_000_000)
        plan.step(lr=1e-2, step=1)
    plan.close()
    gc.collect()
    assert _tables.retired() > 0  # kept until the held stream runs the step
    with pytest.raises(RuntimeError, match=r"closed \(Plan.close\)"):
        plan.step(lr=1e-2, step=2)
    _tables.collect()  # after a device synchronisation
    held.synchronize()
    _tables.collect()
    assert _tables.retired() == 0


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_a_cuda_plan_is_not_copied(copier):
    plan = mtapply.adam_plan(*adam_lists(2))
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copier(plan)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copier(plan._cuda)  # nor its parts


def test_a_refused_rebind_leaves_the_tables():
    lists = adam_lists(3)
    twin = [[t.clone() for t in column] for column in lists]
    plan, calm = mtapply.adam_plan(*lists), mtapply.adam_plan(*twin)
    wrong = [torch.randn(s, device="cuda") for s in SHAPES[:-1]]
    with pytest.raises(ValueError, match="grads has 2 tensors but params has 3"):
        plan.rebind("grads", wrong)
    bad = [torch.randn(s, device="cuda") for s in SHAPES]
    bad[-1] = bad[-1].double()
    with pytest.raises(ValueError, match=r"grads\[2\] is float64"):
        plan.rebind("grads", bad)
    plan.step(lr=1e-2, step=1)
    calm.step(lr=1e-2, step=1)
    torch.cuda.synchronize()
    for a, b in zip(lists[0], twin[0]):
        assert torch.equal(a, b)


def test_threads_stepping_one_plan_on_their_own_streams_take_turns():
    lists = adam_lists(4)
    twin = [[t.clone() for t in column] for column in lists]
    plan, calm = mtapply.adam_plan(*lists), mtapply.adam_plan(*twin)
    counter = torch.zeros(1, device="cuda")
    plan.count_steps(counter)
    per_thread, threads = 20, 4
    barrier = threading.Barrier(threads)

    def work():
        stream = torch.cuda.Stream()
        barrier.wait()
        with torch.cuda.stream(stream):
            for _ in range(per_thread):
                plan.step(lr=1e-3)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for t in range(1, per_thread * threads + 1):
        calm.step(lr=1e-3, step=t)
    torch.cuda.synchronize()
    assert counter.item() == per_thread * threads
    for a, b in zip(lists[0] + lists[2], twin[0] + twin[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
