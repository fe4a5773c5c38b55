"""Float32 Adam pieces stepped by the native library (`mtapply._cpu_adam`): params and moments
are those of NumPy's in-place path (MTAPPLY_NATIVE=0) and of `reference.adam`, bit for bit (a
NaN any NaN), on one thread and on several, with NaNs, infinities and subnormals; float64 and
amsgrad stay with NumPy."""
from __future__ import annotations

import numpy as np
import pytest

import mtapply
from mtapply import _cpu, _native, reference
from test_cpu_eight_bit import _same_bits_nan_alike

# pieces of 65,536 elements and a ragged rest; small tensors (stepped together); a lone small one
SHAPES = [(2 * 65536 + 300,), (256, 300), (70_000,), (5000,), (257,), (3,)]
OPTIONS = [dict(decoupled_weight_decay=True, weight_decay=0.01, maximize=False, beta1=0.9),
           dict(decoupled_weight_decay=False, weight_decay=0.1, maximize=True, beta1=0.9),
           dict(decoupled_weight_decay=False, weight_decay=0.0, maximize=False, beta1=0.3),
           dict(decoupled_weight_decay=True, weight_decay=0.0, maximize=True, beta1=0.5)]
IDS = ["adamw", "adam-l2-maximize", "adam-beta1-0.3", "adamw-maximize-beta1-0.5"]


def _use_native(native: str, monkeypatch) -> None:
    monkeypatch.setenv("MTAPPLY_NATIVE", native)
    if native == "1" and _native.library("cpu_eight_bit") is None:
        pytest.skip("the native library cpu_eight_bit could not be built here")


def _problem(dtype=np.float32):
    """Params, moments and three steps' grads, with special values in the largest tensor."""
    rng = np.random.default_rng(7)
    params = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    params[0][[5, 9000, 65600]] = [np.nan, -np.nan, np.inf]
    exp_avgs = [(rng.standard_normal(s) * 0.1).astype(dtype) for s in SHAPES]
    exp_avg_sqs = [(np.abs(rng.standard_normal(s)) * 0.01).astype(dtype) for s in SHAPES]
    exp_avg_sqs[0][1024:1280] = 1e-42
    grads = []
    for _ in range(3):
        step = [(rng.standard_normal(s) * 1e-2).astype(dtype) for s in SHAPES]
        step[0][[7, 9001, 40000, 66000]] = [-np.nan, np.nan, -np.inf, np.nan]
        step[0][2048:2304] = 1e-40
        step[2][100] = -np.inf
        grads.append(step)
    return params, exp_avgs, exp_avg_sqs, grads


def _run(native: str, threads: str, options: dict, monkeypatch, dtype=np.float32,
         amsgrad=False) -> tuple:
    """Every array after three steps of adam_plan, and its CPU cache."""
    _use_native(native, monkeypatch)
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 12)  # a thread for every piece here
    params, m, v, grads = _problem(dtype)
    hyper = {k: x for k, x in options.items() if k in ("weight_decay", "beta1")}
    flags = {k: x for k, x in options.items() if k not in hyper}
    vmax = [np.zeros_like(p) for p in params] if amsgrad else None
    plan = mtapply.adam_plan(params, grads[0], m, v, max_exp_avg_sqs=vmax, amsgrad=amsgrad,
                             **flags)
    for t, step_grads in enumerate(grads, 1):
        plan.rebind("grads", step_grads)
        plan.step(lr=1e-2, step=t, **hyper)
    monkeypatch.undo()
    return params + m + v, plan._cpu_cache


@np.errstate(all="ignore")
def _reference(options: dict, dtype=np.float32) -> list:
    params, m, v, grads = _problem(dtype)
    for t, step_grads in enumerate(grads, 1):
        for k, g in enumerate(step_grads):
            params[k], m[k], v[k], _ = reference.adam(params[k], g, m[k], v[k], lr=1e-2, step=t,
                                                      dtype=dtype, **options)
    return params + m + v


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_native_steps_as_numpy_and_the_reference(options, threads, monkeypatch):
    got, cache = _run("1", threads, options, monkeypatch)
    assert cache.get("adam_native") and all(a is not None for _, a in cache["adam_native"])
    numpy, cache = _run("0", threads, options, monkeypatch)
    assert cache.get("in_place") and "adam_native" not in cache
    want = _reference(options)
    for k, (a, b, c) in enumerate(zip(got, numpy, want)):
        _same_bits_nan_alike(a, b, f"array {k} (native vs numpy)")
        _same_bits_nan_alike(a, c, f"array {k} (native vs reference)")


def test_float64_stays_numpy_and_exact(monkeypatch):
    got, cache = _run("1", "3", OPTIONS[0], monkeypatch, dtype=np.float64)
    assert all(a is None for _, a in cache.get("adam_native", []))
    for k, (a, b) in enumerate(zip(got, _reference(OPTIONS[0], np.float64))):
        _same_bits_nan_alike(a, b, f"array {k}")


@np.errstate(all="ignore")
def test_amsgrad_stays_with_cpu_update(monkeypatch):
    got, cache = _run("1", "3", OPTIONS[1], monkeypatch, amsgrad=True)
    assert "adam_native" not in cache and not cache.get("in_place")
