"""The CPU backend against the float64 references and torch.optim, on NumPy and torch CPU tensors.

The backend rounds every state to its storage dtype after each step, a float64 reference does
not; so each step is checked on its own (the reference gets the backend's previous values) with
the dtype's tolerance, and the whole run is also checked loosely against an unrounded float64
chain, to catch drift.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mtapply
from _registry import (NUMPY_DTYPES, OPS, assert_close, assign, flag_id, hyper_id, make_slots,
                       make_tensor, op_cases, raw_bytes, to64)

STEPS = 10
SHAPES = [(0,), (1,), (17,), (3, 5), (0, 4), (1000,), (), (257,), (0,)]  # empties first/middle/last
# Loose (rtol, atol) of a 10-step run against an unrounded float64 chain.
DRIFT = {"float32": (1e-5, 5e-5), "float64": (1e-12, 1e-12), "float16": (1e-2, 2e-3),
         "bfloat16": (5e-2, 2e-2)}
FLOAT32_NORMS_DRIFT = (1e-7, 1e-9)
DTYPE_LIBS = [("float32", "numpy"), ("float32", "torch"), ("float64", "numpy"),
              ("float16", "numpy"), ("bfloat16", "torch")]


def eps_for(dtype: str, hyper: dict) -> dict:
    """fp16 tests use eps 0.1 (the testing guide's advice: 1e-8 leaves fp16 states fragile)."""
    return dict(hyper, eps=0.1) if dtype == "float16" and "eps" in hyper else hyper


def written_slots(op: str, flags: dict) -> list:
    spec = OPS[op]["spec"](**flags)
    return [s for s in spec.slots if s in spec.written]


def reference_step(op, flags, hyper, step, before: dict) -> list:
    """Reference values of each index's written slots from float64 inputs (slot -> list)."""
    n = len(before["params"])
    return [OPS[op]["reference"]({s: before[s][i] for s in before}, flags=flags, hyper=hyper, step=step)
            for i in range(n)]


def check_step(slots, expected, dtypes: dict, step: int, scale=1.0) -> None:
    for i, new in enumerate(expected):
        for name, values in new.items():
            assert_close(slots[name][i], values, dtypes[name], f"step {step}: {name}[{i}]", scale)


def new_grads(slots, rng, rebind_plan=None) -> None:
    """Fresh random grads: written in place, or (with a plan) rebound as new tensors."""
    if rebind_plan is None:
        for g in slots["grads"]:
            assign(g, rng.standard_normal(g.shape))
        return
    fresh = [make_tensor(rng.standard_normal(g.shape), _dtype_name(g), _lib(g)) for g in slots["grads"]]
    slots["grads"] = fresh
    rebind_plan.rebind("grads", fresh)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _lib(t) -> str:
    return "numpy" if isinstance(t, np.ndarray) else "torch"


# ---------------------------------------------------------------------------------------------
# against the float64 reference, every option, every dtype


@pytest.mark.parametrize("dtype,lib", DTYPE_LIBS, ids=[f"{d}-{lib}" for d, lib in DTYPE_LIBS])
@pytest.mark.parametrize("op,flags,hyper", list(op_cases()),
                         ids=[f"{o}-{flag_id(f)}-{hyper_id(h)}" for o, f, h in op_cases()])
def test_plan_matches_reference_each_step(op, flags, hyper, dtype, lib, request):
    # Seeded by the case, so that every run draws the same data: with fresh draws each run, a
    # float16 LAMB case (its one-element tensor) once drifted past DRIFT after ten steps.
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
    hyper = eps_for(dtype, hyper)
    slots = make_slots(op, flags, SHAPES, dtype, lib, rng)
    plan = mtapply.Plan(OPS[op]["spec"](**flags), slots)
    chain = {s: [to64(t) for t in column] for s, column in slots.items()}
    dtypes = {s: dtype for s in slots}
    for step in range(1, STEPS + 1):
        new_grads(slots, rng, rebind_plan=plan if step % 3 == 0 else None)
        before = {s: [to64(t) for t in column] for s, column in slots.items()}
        grads_bytes = [raw_bytes(g) for g in slots["grads"]]
        plan.step(step=step, **hyper)
        check_step(slots, reference_step(op, flags, hyper, step, before), dtypes, step)
        assert [raw_bytes(g) for g in slots["grads"]] == grads_bytes, "grads were written"
        chain["grads"] = before["grads"]
        for i, new in enumerate(reference_step(op, flags, hyper, step, chain)):
            for name, values in new.items():
                chain[name][i] = values
    rtol, atol = DRIFT[dtype]
    if dtype == "float64" and OPS[op].get("norm_dtype") == "float32":
        rtol, atol = FLOAT32_NORMS_DRIFT  # a float32 trust ratio steers float64 params
    for name in written_slots(op, flags):
        for i, t in enumerate(slots[name]):
            # rounding drift scales with the magnitudes that flowed through (momentum grows them)
            scale = max(1.0, float(np.abs(chain[name][i]).max(initial=0.0)))
            np.testing.assert_allclose(to64(t), chain[name][i], rtol=rtol, atol=atol * scale,
                                       err_msg=f"drift after {STEPS} steps: {name}[{i}]")


@pytest.mark.parametrize("op,flags,hyper", list(op_cases(with_hyper=False)),
                         ids=[f"{o}-{flag_id(f)}" for o, f, _ in op_cases(with_hyper=False)])
def test_step_function_matches_reference(op, flags, hyper):
    """The one-call entry point (e.g. adam_step), every step re-ingesting the lists."""
    rng = np.random.default_rng()
    hyper = OPS[op]["hyper_sets"][1]
    slots = make_slots(op, flags, SHAPES, "float32", "numpy", rng)
    for step in range(1, STEPS + 1):
        new_grads(slots, rng)
        before = {s: [to64(t) for t in column] for s, column in slots.items()}
        OPS[op]["step"](**slots, **flags, **hyper, step=step)
        check_step(slots, reference_step(op, flags, hyper, step, before),
                   {s: "float32" for s in slots}, step)


# ---------------------------------------------------------------------------------------------
# against torch.optim


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op,flags,hyper", list(op_cases()),
                         ids=[f"{o}-{flag_id(f)}-{hyper_id(h)}" for o, f, h in op_cases()])
def test_matches_torch_optim(op, flags, hyper, dtype):
    row = OPS[op]
    if row["torch_optimizer"] is None:
        pytest.skip(f"torch.optim has no {op}: the float64 reference tests judge it")
    torch_dtype = getattr(torch, dtype)
    shapes = [(0,), (5,), (3, 7), (0,), (1200,), (1,), (0,)]
    params = [torch.randn(s, dtype=torch_dtype) for s in shapes]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = row["torch_optimizer"](theirs, flags=flags, hyper=hyper)
    spec = row["spec"](**flags)
    slots = {s: [torch.zeros_like(p) for p in params] for s in spec.slots if s not in ("params", "grads")}
    slots["params"], slots["grads"] = params, [torch.zeros_like(p) for p in params]
    plan = mtapply.Plan(spec, slots)
    rtol, atol = (1.3e-6, 1e-5) if dtype == "float32" else (1e-12, 1e-14)
    for step in range(1, STEPS + 1):
        for g, p in zip(slots["grads"], theirs):
            g.copy_(torch.randn_like(g))
            p.grad = g.clone()
        optimizer.step()
        plan.step(step=step, **hyper)
        for i, p in enumerate(theirs):
            torch.testing.assert_close(slots["params"][i], p.detach(), rtol=rtol, atol=atol,
                                       msg=lambda m, i=i: f"step {step} params[{i}]: {m}")
            state = optimizer.state[p]
            for slot, key in row["torch_state"].items():
                if slot in slots:
                    torch.testing.assert_close(slots[slot][i], state[key], rtol=rtol, atol=atol,
                                               msg=lambda m, i=i, s=slot: f"step {step} {s}[{i}]: {m}")
            if "step" in state:
                assert float(state["step"]) == step


# ---------------------------------------------------------------------------------------------
# shapes, lists and special inputs


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "all"])
def test_empty_tensors_change_nothing_else(lib, where):
    rng = np.random.default_rng()
    flags = OPS["adam"]["flag_sets"][-1]
    full = make_slots("adam", flags, [(40,), (3, 3), (2000,)], "float32", lib, rng)
    alone = {s: [t.copy() if lib == "numpy" else t.clone() for t in column] for s, column in full.items()}
    position = {"first": [0], "middle": [2], "last": [4], "all": [0, 2, 4, 5]}[where]
    for k in sorted(position):
        shape = (0,) if k % 2 else (0, 3)
        for s in full:
            full[s].insert(k, make_tensor(np.zeros(shape), "float32", lib))
    for step in (1, 2):
        mtapply.adam_step(**full, **flags, lr=1e-2, step=step, weight_decay=0.1)
        mtapply.adam_step(**alone, **flags, lr=1e-2, step=step, weight_decay=0.1)
    kept = [i for i, p in enumerate(full["params"]) if to64(p).size]
    assert len(kept) == 3
    for s in full:
        assert [raw_bytes(full[s][i]) for i in kept] == [raw_bytes(t) for t in alone[s]], s


def test_empty_lists():
    plan = mtapply.adam_plan([], [], [], [])
    assert len(plan) == 0
    plan.step(lr=1e-3, step=1)
    mtapply.adam_step([], [], [], [], lr=1e-3, step=1)
    mtapply.adam_step((), (), (), (), max_exp_avg_sqs=(), amsgrad=True, lr=1e-3, step=1)


def test_nn_parameters_and_autograd_grads():
    torch.manual_seed(np.random.default_rng().integers(2**31))
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    params = list(model.parameters())
    model(torch.randn(16, 7)).square().mean().backward()
    grads = [p.grad for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    before = {"params": [to64(p) for p in params], "grads": [to64(g) for g in grads],
              "exp_avgs": [to64(m) for m in exp_avgs], "exp_avg_sqs": [to64(v) for v in exp_avg_sqs]}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    flags = dict(amsgrad=False, decoupled_weight_decay=True, maximize=False)
    plan = mtapply.adam_plan(params, grads, exp_avgs, exp_avg_sqs, decoupled_weight_decay=True)
    plan.step(step=1, **hyper)
    expected = reference_step("adam", flags, hyper, 1, before)
    check_step({"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, expected,
               {s: "float32" for s in before}, 1)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    assert all(p.grad is g for p, g in zip(params, grads))


@pytest.mark.parametrize("dtype,lib", DTYPE_LIBS, ids=[f"{d}-{lib}" for d, lib in DTYPE_LIBS])
@pytest.mark.parametrize("flags", OPS["adam"]["flag_sets"], ids=flag_id)
def test_zero_grads_without_decay_leave_params_bit_identical(flags, dtype, lib):
    rng = np.random.default_rng()
    slots = make_slots("adam", flags, SHAPES, dtype, lib, rng, zero_state=True)
    for g in slots["grads"]:
        assign(g, np.zeros(g.shape))
    before = [raw_bytes(p) for p in slots["params"]]
    for step in range(1, 4):
        mtapply.adam_step(**slots, **flags, lr=0.1, step=step, weight_decay=0.0)
    assert [raw_bytes(p) for p in slots["params"]] == before


@pytest.mark.parametrize("dtype,lib", DTYPE_LIBS, ids=[f"{d}-{lib}" for d, lib in DTYPE_LIBS])
@pytest.mark.parametrize("flags", OPS["adam"]["flag_sets"], ids=flag_id)
def test_tiny_lr_leaves_params_bit_identical(flags, dtype, lib):
    rng = np.random.default_rng()
    slots = make_slots("adam", flags, SHAPES, dtype, lib, rng)
    before = [raw_bytes(p) for p in slots["params"]]
    states = [raw_bytes(m) for m in slots["exp_avgs"]]
    mtapply.adam_step(**slots, **flags, lr=1e-28, step=1, weight_decay=0.1, eps=0.1)
    assert [raw_bytes(p) for p in slots["params"]] == before
    # A tensor of a few 16-bit elements may round back to its old moments; 16 elements will not.
    changed = [a != b for a, b, m in zip(states, map(raw_bytes, slots["exp_avgs"]), slots["exp_avgs"])
               if to64(m).size >= 16]
    assert changed and all(changed), "the step did not run: exp_avgs unchanged"


def _array_scalars():
    return [("numpy [1]", lambda v: np.array([v], np.float32)),
            ("numpy 0-d", lambda v: np.array(v, np.float32)),
            ("torch [1]", lambda v: torch.tensor([v], dtype=torch.float32)),
            ("torch 0-d", lambda v: torch.tensor(v, dtype=torch.float32))]


@pytest.mark.parametrize("kind,make", _array_scalars(), ids=[k for k, _ in _array_scalars()])
def test_array_lr_and_step(kind, make):
    """lr and step as one-element float32 arrays (device scalars on a GPU) act as their
    values."""
    rng = np.random.default_rng()
    flags = dict(amsgrad=True, decoupled_weight_decay=False, maximize=False)
    ours = make_slots("adam", flags, SHAPES, "float32", "numpy", rng)
    plain = {s: [t.copy() for t in column] for s, column in ours.items()}
    initial = [raw_bytes(p) for p in ours["params"]]
    plan_ours = mtapply.adam_plan(**ours, amsgrad=True)
    plan_plain = mtapply.adam_plan(**plain, amsgrad=True)
    lr = make(3e-3)
    lr_value = float(np.asarray(lr, dtype=np.float64).reshape(-1)[0])
    for step in (1, 2, 3):
        step_array = make(float(step))
        plan_ours.step(lr=lr, step=step_array, weight_decay=0.1)
        plan_plain.step(lr=lr_value, step=step, weight_decay=0.1)
    mtapply.adam_step(**ours, amsgrad=True, lr=lr, step=make(4.0))
    mtapply.adam_step(**plain, amsgrad=True, lr=lr_value, step=4)
    for s in ours:
        assert [raw_bytes(t) for t in ours[s]] == [raw_bytes(t) for t in plain[s]], s
    changed = [a != raw_bytes(p) for a, p in zip(initial, ours["params"]) if p.size]
    assert changed and all(changed), "the steps did not update the params"


@pytest.mark.parametrize("dtype,lib", [("float32", "numpy"), ("bfloat16", "torch")])
def test_every_element_of_a_big_tensor_is_updated(dtype, lib):
    rng = np.random.default_rng()
    flags = dict(amsgrad=False, decoupled_weight_decay=False, maximize=False)
    size = 2**17 + 3
    slots = make_slots("adam", flags, [(size,), (5,)], dtype, lib, rng, zero_state=True)
    for p in slots["params"]:  # magnitudes where one lr=0.1 step is above a bf16 ulp
        assign(p, rng.uniform(0.5, 1.5, p.shape) * rng.choice([-1, 1], p.shape))
    before = {s: [to64(t) for t in column] for s, column in slots.items()}
    mtapply.adam_step(**slots, lr=0.1, step=1)
    after = to64(slots["params"][0])
    assert after[0] != before["params"][0][0] and after[-1] != before["params"][0][-1]
    assert np.all(after != before["params"][0]), "some elements were not written"
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    check_step(slots, reference_step("adam", flags, hyper, 1, before), {s: dtype for s in slots}, 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_storage_rounding_is_nearest_even(dtype):
    """16-bit results are the fp32 math rounded to nearest even (as torch's .to() rounds), bit for bit."""
    rng = np.random.default_rng()
    flags = dict(amsgrad=True, decoupled_weight_decay=False, maximize=False)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=0.1, weight_decay=0.1)
    slots = make_slots("adam", flags, [(4099,), (3, 31)], dtype, "torch", rng)
    before = {s: [to64(t) for t in column] for s, column in slots.items()}
    mtapply.adam_step(**slots, **flags, **hyper, step=3)
    for i in range(2):
        math32 = OPS["adam"]["reference"]({s: before[s][i] for s in before}, flags=flags,
                                          hyper=dict(hyper, dtype=np.float32), step=3)
        for name, values in math32.items():
            expected = torch.from_numpy(np.asarray(values, np.float32)).to(getattr(torch, dtype))
            assert raw_bytes(slots[name][i]) == raw_bytes(expected), f"{name}[{i}]"


@pytest.mark.parametrize("dtype,lib", DTYPE_LIBS, ids=[f"{d}-{lib}" for d, lib in DTYPE_LIBS])
def test_nan_grad_reaches_only_its_element(dtype, lib):
    rng = np.random.default_rng()
    flags = dict(amsgrad=False, decoupled_weight_decay=False, maximize=False)
    slots = make_slots("adam", flags, [(50,), (9,)], dtype, lib, rng)
    grad = to64(slots["grads"][0])
    grad[7] = np.nan
    assign(slots["grads"][0], grad)
    mtapply.adam_step(**slots, lr=1e-2, step=1, eps=0.1)
    for name in ("params", "exp_avgs", "exp_avg_sqs"):
        values = to64(slots[name][0])
        assert np.isnan(values[7]), f"{name}[0][7] should be NaN"
        assert np.isfinite(np.delete(values, 7)).all() and np.isfinite(to64(slots[name][1])).all()


def test_mixed_dtypes_in_one_call():
    """bf16 params+grads with fp32 states, fp64 params with fp32 states, and plain lists, together."""
    rng = np.random.default_rng()
    flags = dict(amsgrad=True, decoupled_weight_decay=True, maximize=False)
    layouts = [("bfloat16", "bfloat16", "float32"), ("float32", "float32", "float32"),
               ("float16", "float32", "float32"), ("float64", "float64", "float32"),
               ("bfloat16", "bfloat16", "bfloat16")]
    shapes = [(33,), (5, 5), (100,), (7,), (64,)]
    slots = {s: [] for s in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")}
    dtypes_at = []
    for (p_dtype, g_dtype, state_dtype), shape in zip(layouts, shapes):
        one = make_slots("adam", flags, [shape],
                         {"params": p_dtype, "grads": g_dtype, "exp_avgs": state_dtype,
                          "exp_avg_sqs": state_dtype, "max_exp_avg_sqs": state_dtype}, "torch", rng)
        for s in slots:
            slots[s].append(one[s][0])
        dtypes_at.append({"params": p_dtype, "exp_avgs": state_dtype, "exp_avg_sqs": state_dtype,
                          "max_exp_avg_sqs": state_dtype})
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    plan = mtapply.adam_plan(**slots, **flags)
    for step in range(1, 4):
        new_grads(slots, rng)
        before = {s: [to64(t) for t in column] for s, column in slots.items()}
        plan.step(step=step, **hyper)
        for i, new in enumerate(reference_step("adam", flags, hyper, step, before)):
            for name, values in new.items():
                assert_close(slots[name][i], values, dtypes_at[i][name], f"{name}[{i}]")


def test_unusual_layouts():
    """Column-major (transposed) tensors, 0-d tensors and views at an odd offset of a buffer."""
    rng = np.random.default_rng()
    flags = dict(amsgrad=False, decoupled_weight_decay=False, maximize=True)
    slots = {s: [] for s in ("params", "grads", "exp_avgs", "exp_avg_sqs")}
    for s in slots:
        values = rng.standard_normal((4, 6)) if s in ("params", "grads", "exp_avgs") else rng.random((4, 6))
        slots[s].append(torch.from_numpy(values.astype(np.float32)).t())  # dense, strides (1, 6)
        slots[s].append(torch.tensor(float(abs(rng.standard_normal())), dtype=torch.float32))
        buffer = rng.random(130).astype(np.float32)
        slots[s].append(buffer[1:129])  # 4 bytes past the buffer's start: not 16-byte aligned
    slots = {s: [t if i < 2 else torch.from_numpy(t) for i, t in enumerate(c)] for s, c in slots.items()}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    before = {s: [to64(t) for t in column] for s, column in slots.items()}
    mtapply.adam_step(**slots, **flags, **hyper, step=1)
    check_step(slots, reference_step("adam", flags, hyper, 1, before), {s: "float32" for s in slots}, 1)
    assert slots["params"][0].stride() == (1, 6) and slots["params"][1].dim() == 0


# ---------------------------------------------------------------------------------------------
# hypothesis: lists of any length and sizes, with empties anywhere, mixed dtypes


@given(sizes=st.lists(st.integers(0, 3000), max_size=50),
       dtypes=st.lists(st.sampled_from(NUMPY_DTYPES), min_size=50, max_size=50),
       flags=st.sampled_from(OPS["adam"]["flag_sets"]),
       hyper=st.sampled_from(OPS["adam"]["hyper_sets"]),
       lib=st.sampled_from(["numpy", "torch"]),
       seed=st.integers(0, 2**32 - 1))
def test_random_lists_match_reference(sizes, dtypes, flags, hyper, lib, seed):
    rng = np.random.default_rng(seed)
    hyper = dict(hyper, eps=0.1)  # fp16 tensors may be in the list
    slots = {s: [] for s in OPS["adam"]["spec"](**flags).slots}
    for size, dtype in zip(sizes, dtypes):
        one = make_slots("adam", flags, [(size,)], dtype, lib, rng)
        for s in slots:
            slots[s].append(one[s][0])
    for step in (1, 2):
        new_grads(slots, rng)
        before = {s: [to64(t) for t in column] for s, column in slots.items()}
        mtapply.adam_step(**slots, **flags, **hyper, step=step)
        for i, new in enumerate(reference_step("adam", flags, hyper, step, before)):
            for name, values in new.items():
                assert_close(slots[name][i], values, dtypes[i], f"step {step}: {name}[{i}]")
