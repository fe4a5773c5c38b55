"""LARS and LAMB against optax.lars and optax.lamb, step by step, where their definitions agree.

LARS. optax.lars chains add_decayed_weights(wd), scale_by_trust_ratio(trust_coefficient, eps),
scale(-lr), trace(momentum): ratio = tc * ||p|| / (||g + wd * p|| + eps). mtapply (You et al.,
Paddle's lars_momentum) divides by ||g|| + wd * ||p|| + eps instead. They agree when
weight_decay = 0 (nesterov=False): optax's trace is minus mtapply's momentum buffer, both take
the plain lr when ||p|| or ||g|| is 0, and `exclude` equals a False trust_ratio_mask leaf.
They differ when weight_decay > 0: ||g + wd * p|| <= ||g|| + wd * ||p||, so optax's steps are
longer (equal only when g and p are parallel), and its zero-norm test looks at g + wd * p.
optax's nesterov has no mtapply counterpart.

LAMB. optax.lamb chains scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(wd),
scale_by_trust_ratio(), scale(-lr), and always applies the trust ratio ||p|| / ||u||.
mtapply.lamb_step (Apex FusedLAMB) agrees with adam_w_mode=True, grad_averaging=True,
bias_correction=True, no clipping, eps_root = 0, when the ratio is applied: use_nvlamb=True or
weight_decay != 0. They differ for weight_decay = 0 without use_nvlamb (mtapply's ratio is 1),
for L2 mode, no grad averaging, no bias correction and clipping (optax.lamb has none of these),
for eps_root > 0, and for optax's weight-decay mask.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import mtapply

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to mtapply
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

STEPS = 5
SHAPE_LISTS = [[(1,)], [(1,), (7,), (300,), (40, 50)], [(2048,), (3, 5, 7), (1,), (999,)]]
# Two fp32 implementations with different operation orders (norms: float64 sums on NumPy,
# fp32 reductions in XLA and the kernels; FMA contraction; optax's bias corrections 1 - b**t in
# fp32), compounded over 5 steps and through the trust ratio: 1e-5 is ~80 fp32 ulps.
RTOL = 1e-5
BACKENDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]


def _put(values: np.ndarray, backend: str):
    """A fresh float32 array of the backend holding `values`."""
    if backend == "cupy":
        import cupy

        return cupy.asarray(values, dtype=cupy.float32)
    return np.array(values, dtype=np.float32)


def _get(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def _draw(shapes, rng):
    """Initial params and the grads of every step, float32, non-zero."""
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(STEPS)]
    return params, grads


def _assert_close(got, want, what: str, t: int, scales: dict) -> None:
    """atol follows the largest magnitude the tensor `what` has held up to step t: where
    v = momentum * v + rate * g cancels to near 0, the rounding is that of the terms."""
    want = np.asarray(want, np.float64)
    scales[what] = max(scales.get(what, 0.0), np.abs(want).max())
    np.testing.assert_allclose(_get(got), want, rtol=RTOL, atol=RTOL * scales[what],
                               err_msg=f"{what} step {t}")


def _optax_steps(tx, params, grads):
    """(params, state) of optax after each step, starting from its own fresh state."""
    params = [jnp.asarray(p) for p in params]
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step_grads in grads:
        updates, state = update([jnp.asarray(g) for g in step_grads], state, params)
        params = optax.apply_updates(params, updates)
        yield params, state


# ---------------------------------------------------------------------------------------------
# LARS

LARS_HYPER = [
    dict(lr=0.1, momentum=0.9, trust_coefficient=0.001, eps=0.0),
    dict(lr=1.0, momentum=0.5, trust_coefficient=0.02, eps=1e-3),
    dict(lr=0.5, momentum=0.0, trust_coefficient=0.01, eps=0.0),
]


def _optax_lars(hyper, weight_decay=0.0, trust_ratio_mask=True):
    return optax.lars(hyper["lr"], weight_decay=weight_decay, momentum=hyper["momentum"],
                      trust_coefficient=hyper["trust_coefficient"], eps=hyper["eps"],
                      weight_decay_mask=trust_ratio_mask, trust_ratio_mask=trust_ratio_mask)


def _compare_lars(params0, grads, hyper, backend, exclude=None):
    params = [_put(p, backend) for p in params0]
    buffers = [_put(np.zeros_like(p), backend) for p in params0]  # optax's trace starts at 0
    mask = True if exclude is None else [not e for e in exclude]
    expected, scales = _optax_steps(_optax_lars(hyper, trust_ratio_mask=mask), params0, grads), {}
    for t, (step_grads, (want_p, state)) in enumerate(zip(grads, expected), start=1):
        mtapply.lars_step(params, [_put(g, backend) for g in step_grads], buffers,
                          weight_decay=0.0, exclude=exclude, **hyper)
        trace = state[-1].trace  # the chain's last state is trace(momentum)'s
        for i in range(len(params)):
            _assert_close(params[i], want_p[i], f"params[{i}]", t, scales)
            _assert_close(buffers[i], -np.asarray(trace[i]), f"momentum_buffers[{i}]", t, scales)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hyper", LARS_HYPER, ids=lambda h: f"lr={h['lr']},m={h['momentum']}")
@pytest.mark.parametrize("shapes", SHAPE_LISTS, ids=lambda s: f"{len(s)}tensors")
def test_lars_matches_optax_without_weight_decay(shapes, hyper, backend):
    params, grads = _draw(shapes, np.random.default_rng(len(shapes)))
    _compare_lars(params, grads, hyper, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lars_exclude_matches_trust_ratio_mask(backend):
    params, grads = _draw([(30,), (5,), (200,)], np.random.default_rng(11))
    _compare_lars(params, grads, LARS_HYPER[1], backend, exclude=[False, True, False])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lars_zero_norms_fall_back_to_lr_in_both(backend):
    params, grads = _draw([(50,), (40,), (1,)], np.random.default_rng(12))
    params[0][:] = 0.0   # ||p|| = 0 on step 1
    grads[2][1][:] = 0.0  # ||g|| = 0 on step 3, with momentum already built up
    _compare_lars(params, grads, LARS_HYPER[0], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lars_weight_decay_denominators_differ(backend):
    """On step 1 (zero buffers) each buffer is lr * ratio * (g + wd p), so optax's is mtapply's
    times (||g|| + wd ||p||) / ||g + wd p||: about 1.1 here, never below 1."""
    wd, hyper = 0.1, LARS_HYPER[0]
    params0, grads = _draw([(300,), (40, 50)], np.random.default_rng(13))
    params = [_put(p, backend) for p in params0]
    buffers = [_put(np.zeros_like(p), backend) for p in params0]
    mtapply.lars_step(params, [_put(g, backend) for g in grads[0]], buffers, weight_decay=wd,
                      **hyper)
    _, state = next(_optax_steps(_optax_lars(hyper, weight_decay=wd), params0, grads[:1]))
    for i, (p, g) in enumerate(zip(params0, grads[0])):
        p, g = p.astype(np.float64), g.astype(np.float64)
        factor = (np.linalg.norm(g) + wd * np.linalg.norm(p)) / np.linalg.norm(g + wd * p)
        assert factor > 1.05, f"params[{i}]: the data must separate the two definitions"
        theirs = -np.asarray(state[-1].trace[i], np.float64)
        np.testing.assert_allclose(theirs, factor * _get(buffers[i]), rtol=RTOL,
                                   atol=RTOL * np.abs(theirs).max(), err_msg=f"buffers[{i}]")


# ---------------------------------------------------------------------------------------------
# LAMB

LAMB_CASES = [  # (hyperparameters, use_nvlamb): the trust ratio applies in each
    (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01), False),
    (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01), True),
    (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0), True),
    (dict(lr=5e-2, beta1=0.5, beta2=0.95, eps=1e-8, weight_decay=0.1), False),
]


def _compare_lamb(params0, grads, hyper, use_nvlamb, backend):
    params = [_put(p, backend) for p in params0]
    exp_avgs = [_put(np.zeros_like(p), backend) for p in params0]  # optax's moments start at 0
    exp_avg_sqs = [_put(np.zeros_like(p), backend) for p in params0]
    tx = optax.lamb(hyper["lr"], b1=hyper["beta1"], b2=hyper["beta2"], eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"])
    expected, scales = _optax_steps(tx, params0, grads), {}
    for t, (step_grads, (want_p, state)) in enumerate(zip(grads, expected), start=1):
        mtapply.lamb_step(params, [_put(g, backend) for g in step_grads], exp_avgs, exp_avg_sqs,
                          step=t, use_nvlamb=use_nvlamb, **hyper)
        adam = state[0]  # the chain's first state is scale_by_adam's
        for i in range(len(params)):
            _assert_close(params[i], want_p[i], f"params[{i}]", t, scales)
            _assert_close(exp_avgs[i], adam.mu[i], f"exp_avgs[{i}]", t, scales)
            _assert_close(exp_avg_sqs[i], adam.nu[i], f"exp_avg_sqs[{i}]", t, scales)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LAMB_CASES, ids=lambda c: f"wd={c[0]['weight_decay']},"
                         f"nvlamb={c[1]},b1={c[0]['beta1']}")
@pytest.mark.parametrize("shapes", SHAPE_LISTS, ids=lambda s: f"{len(s)}tensors")
def test_lamb_matches_optax_when_the_trust_ratio_applies(shapes, case, backend):
    params, grads = _draw(shapes, np.random.default_rng(20 + len(shapes)))
    _compare_lamb(params, grads, *case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lamb_zero_param_norm_falls_back_to_one_in_both(backend):
    params, grads = _draw([(64,), (1,), (300,)], np.random.default_rng(21))
    params[0][:] = 0.0  # ||p|| = 0 on step 1: ratio 1, the plain Adam step
    _compare_lamb(params, grads, *LAMB_CASES[0], backend)
