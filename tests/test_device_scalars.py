"""Device scalars (one-element float32 arrays given for lr, step, grad_scale, found_inf, ...) on
the CPU: checked as the kernels check them (kernels/walker.cuh, `step_runs`). A value out of
the range its op declares makes the step write nothing and raises `plan.invalid`; the same value
as a number is refused before anything is written. tests/gpu/test_device_scalars_gpu.py runs
the same cases on the GPU."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import mtapply
from mtapply.plan import Plan
from mtapply.lamb import LAMBSpec
from mtapply.lars import LARSSpec
from mtapply.ops import AdamSpec
from mtapply.sgd import SGDSpec
from mtapply._ranges import ANY, FACTOR, GRAD_SCALE, LR, NORM, STEP, Range
from mtapply.ops.adam8bit import Adam8bitSpec
from mtapply.ops.scaling import AddSpec, ScaleSpec

NAN, INF = math.nan, math.inf
BAD = {LR: [NAN, -1.0, INF, -INF], STEP: [0.0, -1.0, 1.5, NAN, INF], NORM: [NAN, -1.0, INF],
       FACTOR: [NAN, INF, -INF], GRAD_SCALE: [0.0, -1.0, INF, NAN], ANY: [NAN]}
VALID = {LR: 1e-2, STEP: 2.0, NORM: 3.0, FACTOR: 0.5, GRAD_SCALE: 2.0, ANY: 0.5}
SHAPES = [(5,), (3, 4), (0,), (300,)]

LION = mtapply.rule("lion", slots="param:rw grad:r exp_avg:rw",
                    hyper=dict(lr=None, beta1=0.9, beta2=0.99, weight_decay=0.0),
                    update="""
                        c = beta1 * exp_avg + (1 - beta1) * grad
                        param = param * (1 - lr * weight_decay) - lr * sign(c)
                        exp_avg = beta2 * exp_avg + (1 - beta2) * grad
                    """)
COUNTED = mtapply.rule("counted", slots="param:rw grad:r", hyper=dict(lr=None),
                       update="param = param - lr * grad / step")

# op -> (spec, good step arguments, the device scalars the op reads)
CASES = {
    "adam": (AdamSpec(), dict(lr=1e-2, step=3.0), ("lr", "step")),
    "sgd": (SGDSpec(), dict(lr=1e-2, step=2.0, momentum=0.9), ("lr", "step")),
    "lars": (LARSSpec(), dict(lr=1e-2), ("lr",)),
    "lamb": (LAMBSpec(), dict(lr=1e-2, step=2.0, max_grad_norm=1.0, global_grad_norm=3.0),
             ("lr", "step", "global_grad_norm")),
    "adam8bit": (Adam8bitSpec(), dict(lr=1e-2, step=2.0), ("lr", "step")),
    "scale": (ScaleSpec(), dict(factor=0.5), ("factor",)),
    "add": (AddSpec(), dict(value=0.5), ("value",)),
    "lion": (LION.spec(), dict(lr=1e-2), ("lr", "beta1", "beta2", "weight_decay", "step")),
    "counted": (COUNTED.spec(), dict(lr=1e-2, step=2.0), ("lr", "step")),
}


def lists(spec, rng) -> dict:
    """Random (never zero) float32 tensors for every slot of `spec` (8-bit states as made)."""
    if isinstance(spec, Adam8bitSpec):
        params = [np.float32(rng.standard_normal(s)) for s in SHAPES]
        state = mtapply.adam8bit_state(params, threshold=1)
        names = ("exp_avgs", "exp_avg_sqs", "exp_avg_absmax", "exp_avg_sq_absmax")
        return dict(params=params, grads=[np.float32(rng.standard_normal(s)) for s in SHAPES],
                    **dict(zip(names, state.lists())))
    return {slot: [np.float32(np.abs(rng.standard_normal(s)) + 0.5) for s in SHAPES]
            for slot in spec.slots}


def snapshot(tensors: dict) -> list:
    return [t.tobytes() for column in tensors.values() for t in column]


def device(value) -> np.ndarray:
    return np.array([value], np.float32)


def plan_of(op: str, rng):
    spec, good, names = CASES[op]
    tensors = lists(spec, rng)
    return Plan(spec, tensors), tensors, dict(good), names


def bad_cases():
    for op, (spec, _, names) in CASES.items():
        for name in names:
            for value in BAD[spec.scalar_range(name)]:
                yield op, name, value


@pytest.mark.parametrize("op,name,value", list(bad_cases()))
def test_a_device_value_out_of_range_writes_nothing_and_raises_the_flag(op, name, value):
    rng = np.random.default_rng(0)
    plan, tensors, good, _ = plan_of(op, rng)
    before = snapshot(tensors)
    plan.step(**dict(good, **{name: device(value)}))
    assert snapshot(tensors) == before, "a step with an invalid device value wrote"
    assert plan.invalid.dtype == np.float32 and plan.invalid.tolist() == [1.0]
    plan.clear_invalid()
    valid = good.get(name, VALID[CASES[op][0].scalar_range(name)])
    plan.step(**dict(good, **{name: device(valid)}))  # a valid value: the step runs
    assert snapshot(tensors) != before and plan.invalid.tolist() == [0.0]


@pytest.mark.parametrize("op,name,value", list(bad_cases()))
def test_the_same_value_as_a_number_is_refused(op, name, value):
    plan, tensors, good, _ = plan_of(op, np.random.default_rng(1))
    before = snapshot(tensors)
    allowed = CASES[op][0].scalar_range(name)
    message = f"{name} must be {allowed.describe(value)}, got"
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.step(**dict(good, **{name: value}))
    assert snapshot(tensors) == before and plan.invalid.tolist() == [0.0]


@pytest.mark.parametrize("value", BAD[GRAD_SCALE])
@pytest.mark.parametrize("op", ["adam", "lars", "lion"])
def test_grad_scale_out_of_range(op, value):
    plan, tensors, good, _ = plan_of(op, np.random.default_rng(2))
    before = snapshot(tensors)
    plan.step(grad_scale=device(value), **good)
    assert snapshot(tensors) == before and plan.invalid.tolist() == [1.0]
    message = f"grad_scale must be {GRAD_SCALE.describe(value)}, got"
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.step(grad_scale=value, **good)


@pytest.mark.parametrize("found_inf,skips", [(1.0, True), (NAN, True), (-2.0, True), (0.0, False)])
def test_found_inf_array_skips_as_on_the_gpu(found_inf, skips):
    plan, tensors, good, _ = plan_of("adam", np.random.default_rng(3))
    before = snapshot(tensors)
    plan.step(found_inf=device(found_inf), **good)
    assert (snapshot(tensors) == before) == skips
    assert plan.invalid.tolist() == [0.0]  # a skip that AMP asked for is no invalid value


@pytest.mark.parametrize("name", ["found_inf", "grad_scale", "lr", "step"])
@pytest.mark.parametrize("array", [torch.tensor([0.0, 1.0]), np.array([1], np.int32),
                                   np.array([1.0], np.float64), np.zeros((1, 2), np.float32),
                                   torch.tensor([1.0], dtype=torch.float16)],
                         ids=["2 elements", "int32", "float64", "2-d", "float16"])
def test_arrays_the_gpu_refuses_are_refused_on_the_cpu_too(name, array):
    plan, tensors, good, _ = plan_of("adam", np.random.default_rng(4))
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=rf"{name} as a device array must be a one-element "
                                         rf"float32 array on cpu, got"):
        plan.step(**dict(good, **{name: array}))
    assert snapshot(tensors) == before


def test_one_tensors_invalid_row_skips_the_whole_step():
    """Per-tensor hyperparameters (rows): one tensor's device lr out of range writes nothing
    at all, not only that tensor."""
    plan, tensors, good, _ = plan_of("adam", np.random.default_rng(5))
    before = snapshot(tensors)
    lrs = [device(1e-2), device(1e-3), device(1e-2), device(NAN)]
    plan.step(step=2.0, lr=lrs)
    assert snapshot(tensors) == before and plan.invalid.tolist() == [1.0]
    plan.clear_invalid()
    lrs[3][0] = 1e-3  # the same arrays, now valid: the step runs
    plan.step(step=2.0, lr=lrs)
    assert snapshot(tensors) != before and plan.invalid.tolist() == [0.0]


@pytest.mark.parametrize("bad", [dict(lr=device(NAN)), dict(grad_scale=device(0.0))])
def test_a_counting_plan_does_not_count_a_skipped_step(bad):
    plan, tensors, good, _ = plan_of("adam", np.random.default_rng(6))
    counter = np.zeros(1, np.float32)
    plan.count_steps(counter)
    plan.step(lr=1e-2)
    assert counter.tolist() == [1.0]
    before = snapshot(tensors)
    plan.step(**dict(dict(lr=1e-2), **bad))
    assert counter.tolist() == [1.0] and snapshot(tensors) == before
    assert plan.invalid.tolist() == [1.0]
    plan.step(lr=1e-2)
    assert counter.tolist() == [2.0]


@pytest.mark.parametrize("count", [NAN, -1.0, 0.5, INF])
def test_a_counter_that_holds_no_step_count_skips(count):
    plan, tensors, _, _ = plan_of("adam", np.random.default_rng(7))
    counter = np.array([count], np.float32)
    plan.count_steps(counter)
    before = snapshot(tensors)
    plan.step(lr=1e-2)
    assert snapshot(tensors) == before and plan.invalid.tolist() == [1.0]
    assert counter.tobytes() == np.array([count], np.float32).tobytes()


def test_host_numbers_refused_everywhere():
    rng = np.random.default_rng(8)
    p, g, m, v = ([np.float32(rng.standard_normal(4))] for _ in range(4))
    for bad, match in [(dict(lr=INF), r"lr must be finite and >= 0, got inf"),
                       (dict(step=1.5), r"step must be a whole number >= 1"),
                       (dict(step=INF), r"step must be"), (dict(lr=1e-3, step=0), "step")]:
        kwargs = dict(dict(lr=1e-3, step=1), **bad)
        with pytest.raises(ValueError, match=match):
            mtapply.adam_step(p, g, m, v, **kwargs)
    with pytest.raises(ValueError, match="grad_scale must be finite and > 0, got inf"):
        mtapply.adam_step(p, g, m, v, lr=1e-3, step=1, grad_scale=INF)


def test_whole_step_counts_up_to_where_float32_holds_them():
    assert STEP.holds(1e9) and STEP.holds(2.0 ** 24) and not STEP.holds(2.5)
    assert Range(low=0.0, low_open=True).describe() == "> 0.0"
    assert Range(high=1.0, high_open=True).describe() == "< 1.0"
    assert ANY.describe() == "a number (not NaN)" and not ANY.holds(NAN) and ANY.holds(INF)


def test_every_op_declares_each_device_scalar_checked_in_its_kernel():
    for op, (spec, _, names) in CASES.items():
        checks = spec.device_checks()
        assert len(checks) == len(names), op
        for name, (word, count, low, high, flags) in zip(spec.device_scalars, checks):
            field = spec.field_of(name)
            assert spec.arg_fields[word] == f"{field}_ptr" and count == 1
            assert spec.scalar_range(name).kernel_check(word, 1) == (word, count, low, high,
                                                                      flags)
    labels = AdamSpec(lr_labels=[0, 2, 1, 0])
    assert labels.device_checks()[0][:2] == (1, 3)  # one lr per label, each checked
