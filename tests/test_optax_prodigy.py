"""mtapply.optax.prodigy and dadapt_adamw against optax.contrib's: params and state over 100
steps (float32 here, float64 under jax_enable_x64 in a fresh interpreter), eager and jitted, the
fused forms, the state's fields, tree_state, pickle, and what is refused.

The reference is optax's update under jax.jit: optax computes the bias correction
sqrt(1 - b2**t) / (1 - b1**t) in float32, whose value differs between its eager and jitted
runs by 1e-5 (mtapply computes it as optax's jitted update). In float32 the params start at 0:
from params of size 1 Prodigy's numerator sums g * (p0 - p) over differences of a few ulps
early on, which amplify any rounding (optax's own float32 run is 1e-3 off its float64 run)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("optax.contrib")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from optax import contrib  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

STEPS = 100
CPU = jax.devices("cpu")[0]
TARGET = {"w": np.random.default_rng(0).standard_normal((4, 3)),
          "b": np.random.default_rng(1).standard_normal(5)}

# optax's field -> ours
PRODIGY_FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "grad_sum": "s",
                  "params0": "p0", "estim_lr": "d", "numerator_weighted": "d_numerator"}
DADAPT_FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "grad_sum": "s",
                 "estim_lr": "d", "numerator_weighted": "numerator_weighted"}

CASES = [
    ("prodigy", {}),
    ("prodigy", dict(weight_decay=0.1)),
    ("prodigy", dict(weight_decay=0.1, safeguard_warmup=True)),
    ("prodigy", dict(learning_rate=0.5, betas=(0.8, 0.99), beta3=0.9, eps=1e-6,
                     estim_lr0=1e-5, estim_lr_coef=0.5)),
    ("prodigy", dict(learning_rate=optax.linear_schedule(1.0, 0.1, STEPS))),
    ("dadapt_adamw", {}),
    ("dadapt_adamw", dict(weight_decay=0.1)),
    ("dadapt_adamw", dict(learning_rate=0.5, betas=(0.8, 0.99), eps=1e-6, estim_lr0=1e-5)),
]
IDS = ["prodigy", "prodigy-wd", "prodigy-wd-safeguard", "prodigy-options", "prodigy-schedule",
       "dadapt", "dadapt-wd", "dadapt-options"]


def _params(scale=0.0, dtype=jnp.float32):
    return jax.device_put({k: jnp.asarray(scale * v, dtype) for k, v in TARGET.items()}, CPU)


def _grads(params, rng):
    """A noisy quadratic's grads, pulling the params towards TARGET."""
    return jax.device_put({k: jnp.asarray(0.1 * rng.standard_normal(v.shape)
                                          + 2 * (np.asarray(v) - TARGET[k]), v.dtype)
                           for k, v in params.items()}, CPU)


def _run(step, params, state, steps=STEPS):
    rng = np.random.default_rng(2)
    for _ in range(steps):
        params, state = step(params, state, _grads(params, rng))
    return params, state


def _applying(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _close(got, want, rtol, atol=0.0):
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol,
                                   atol=atol * float(np.max(np.abs(np.asarray(y)))))


def _check_state(name, ours, theirs, params, rtol):
    ours = mtx.tree_state(ours, params)
    assert int(ours.count) == int(theirs.count) == STEPS
    fields = PRODIGY_FIELDS if name == "prodigy" else DADAPT_FIELDS
    for their_field, our_field in fields.items():
        _close(getattr(ours, our_field), getattr(theirs, their_field), rtol, atol=rtol)
    if name == "prodigy":
        np.testing.assert_array_equal(np.asarray(ours.d_max), np.asarray(ours.d))


@pytest.mark.parametrize("form", ["jit", "eager", "tree-state", "fused"])
@pytest.mark.parametrize("name,options", CASES, ids=IDS)
def test_follows_optax_contrib_in_float32(name, options, form):
    params = _params()
    theirs = getattr(contrib, name)(**options)
    want, their_state = _run(jax.jit(_applying(theirs)), params, theirs.init(params))
    if form == "fused":
        ours = getattr(mtx, f"fused_{name}")(**options)
        step = jax.jit(lambda p, s, g: ours.step(p, g, s))
    else:
        ours = getattr(mtx, name)(**options, flat_state=form != "tree-state")
        step = jax.jit(_applying(ours)) if form == "jit" else _applying(ours)
    got, state = _run(step, params, ours.init(params))
    _close(got, want, 1e-5, atol=1e-6)
    _check_state(name, state, their_state, got, 1e-5)


def test_state_fields_and_first_values():
    params = _params(0.5)
    state = mtx.prodigy(estim_lr0=1e-4).init(params)
    assert type(state).__name__ == "ProdigyState"
    assert state._fields == ("count", "exp_avg", "exp_avg_sq", "s", "p0", "d", "d_max",
                             "d_numerator")
    tree = mtx.tree_state(state, params)
    _close(tree.p0, params, 0.0)  # a copy of the params, as optax's params0
    assert float(tree.d) == float(tree.d_max) == np.float32(1e-4)
    assert tree.d.dtype == jnp.float32 and float(tree.d_numerator) == 0.0
    state = mtx.dadapt_adamw(estim_lr0=1e-4).init(params)
    assert type(state).__name__ == "DadaptAdamState"
    assert state._fields == ("count", "exp_avg", "exp_avg_sq", "s", "d", "numerator_weighted")
    assert float(state.d) == np.float32(1e-4)


@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
def test_state_pickles_and_steps_on(name):
    params, tx = _params(), getattr(mtx, name)(weight_decay=0.1)
    params, state = _run(_applying(tx), params, tx.init(params), steps=5)
    again = pickle.loads(pickle.dumps(state))
    assert type(again) is type(state)
    assert jax.tree.structure(again) == jax.tree.structure(state)
    a = _run(_applying(tx), params, state, steps=3)
    b = _run(_applying(tx), params, again, steps=3)
    _close(a, b, 0.0)
    flat = mtx.flat_state(mtx.tree_state(state, params), params)
    assert jax.tree.structure(flat) == jax.tree.structure(state)


def test_fused_donated_step_and_chain():
    params = _params()
    theirs = contrib.prodigy(weight_decay=0.05)
    want, _ = _run(jax.jit(_applying(theirs)), params, theirs.init(params), steps=30)
    opt = mtx.fused_prodigy(weight_decay=0.05)
    got, _ = _run(lambda p, s, g: opt.donated_step(p, g, s), jax.tree.map(jnp.copy, params),
                  opt.init(params), steps=30)
    _close(got, want, 1e-5, atol=1e-6)
    # in optax.chain, after a clip of optax's own
    theirs = optax.chain(optax.clip_by_global_norm(1.0), contrib.dadapt_adamw())
    ours = optax.chain(optax.clip_by_global_norm(1.0), mtx.dadapt_adamw())
    want, _ = _run(jax.jit(_applying(theirs)), params, theirs.init(params), steps=30)
    got, _ = _run(jax.jit(_applying(ours)), params, ours.init(params), steps=30)
    _close(got, want, 1e-5, atol=1e-6)


def test_inject_hyperparams_and_host_callback(monkeypatch):
    params = _params()
    theirs = contrib.prodigy(learning_rate=0.7, weight_decay=0.1)
    want, _ = _run(jax.jit(_applying(theirs)), params, theirs.init(params), steps=20)
    ours = optax.inject_hyperparams(mtx.prodigy)(learning_rate=0.7, weight_decay=0.1)
    got, state = _run(jax.jit(_applying(ours)), params, ours.init(params), steps=20)
    _close(got, want, 1e-5, atol=1e-6)
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "host")  # the pure_callback through NumPy
    ours = mtx.prodigy(learning_rate=0.7, weight_decay=0.1)
    got, _ = _run(_applying(ours), params, ours.init(params), steps=20)
    _close(got, want, 1e-5, atol=1e-6)


def test_zero_grads_leave_params_and_d():
    """optax's step divides by sum |s| = 0 (NaN); the rule leaves params and d as they are."""
    params = _params(0.5)
    tx = mtx.prodigy()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, state = tx.update(zeros, tx.init(params), params)
    _close(updates, zeros, 0.0)
    assert float(state.d) == np.float32(1e-6) and int(state.count) == 1


def test_refusals():
    with pytest.raises(TypeError, match="weight_decay must be a number"):
        mtx.prodigy(weight_decay=optax.constant_schedule(0.1))
    with pytest.raises(TypeError, match="betas must be a pair"):
        mtx.dadapt_adamw(betas=0.9)
    with pytest.raises(ValueError, match="d0"):
        mtx.prodigy(estim_lr0=0.0)
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        mtx.fused_dadapt_adamw(betas=(1.5, 0.999))


X64 = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, optax
from optax import contrib
import mtapply.optax as mtx
rng = np.random.default_rng(0)
target = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(5)}
cases = [("prodigy", {}), ("prodigy", dict(weight_decay=0.1, safeguard_warmup=True)),
         ("prodigy", dict(learning_rate=0.5, betas=(0.8, 0.99), beta3=0.9, eps=1e-6,
                          estim_lr0=1e-5, estim_lr_coef=0.5)),
         ("dadapt_adamw", {}), ("dadapt_adamw", dict(weight_decay=0.1, estim_lr0=1e-5))]
for name, options in cases:
    for jit in (False, True):
        runs = []
        for tx in (getattr(mtx, name)(**options), getattr(contrib, name)(**options)):
            params = {k: jnp.asarray(0.5 * v) for k, v in target.items()}  # p0 != 0
            state, r = tx.init(params), np.random.default_rng(1)
            update = jax.jit(tx.update) if jit else tx.update
            for _ in range(100):
                grads = {k: jnp.asarray(0.1 * r.standard_normal(v.shape)
                                        + 2 * (np.asarray(v) - target[k])) for k, v in params.items()}
                updates, state = update(grads, state, params)
                params = optax.apply_updates(params, updates)
            runs.append((params, state))
        (mine, ours), (want, theirs) = runs
        for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(want)):
            assert x.dtype == jnp.float64
            # float64 params: d and the whole-tree sums are float64 too
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-10,
                                       atol=1e-13 * float(np.max(np.abs(y))))
        assert ours.d.dtype == jnp.float64
        np.testing.assert_allclose(float(ours.d), float(theirs.estim_lr), rtol=1e-10)
print("ok")
"""


def test_follows_optax_contrib_in_float64():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", X64], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
