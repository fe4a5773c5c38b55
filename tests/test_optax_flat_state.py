"""Flat state (the default of every form): one buffer per dtype and state slot, each leaf at an
aligned offset; the same steps as pytree state, conversions to and from pytrees, and trees
stepped a few leaves per call."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply import _optax_engine  # noqa: E402
from mtapply._optax_state import FlatLayout  # noqa: E402


def _mixed(rng):
    cpu = jax.devices("cpu")[0]
    return jax.device_put({"a": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
                           "e": jnp.zeros((0, 2), jnp.float32),
                           "h": jnp.asarray(rng.standard_normal(7), jnp.float16),
                           "s": jnp.asarray(rng.standard_normal(()), jnp.float32),
                           "z": jnp.asarray(rng.standard_normal(9), jnp.float32)}, cpu)


def test_leaves_sit_at_16_byte_offsets_in_one_buffer_per_dtype():
    leaves = jax.tree.leaves(_mixed(np.random.default_rng(0)))
    layout = FlatLayout(leaves)
    assert layout.names == ["float32", "float16"]
    for leaf, offset in zip(leaves, layout.offsets):
        assert offset * leaf.dtype.itemsize % 16 == 0
    # float32: a (15 -> 16), e (0), s (1 -> 4), z (9 -> 12); float16: h (7 -> 8)
    assert layout.offsets == [0, 16, 0, 16, 20]
    assert layout.sizes == {"float32": 32, "float16": 8}
    state = mtx.fused_adam(1e-2).init(dict(zip("aehsz", leaves)))
    assert {k: v.shape for k, v in state.mu.items()} == {"float32": (32,), "float16": (8,)}


def test_fused_steps_match_the_transformation_and_convert_both_ways():
    rng = np.random.default_rng(1)
    params = _mixed(rng)
    hyper = dict(weight_decay=0.1, eps=1e-3)
    opt, tx = mtx.fused_adamw(1e-2, **hyper), mtx.adamw(1e-2, flat_state=False, **hyper)
    flat_tx = mtx.adamw(1e-2, **hyper)
    state, their_state, flat_tx_state = opt.init(params), tx.init(params), flat_tx.init(params)
    mine = theirs = flat_params = params
    for _ in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        mine, state = opt.step(mine, grads, state)
        updates, their_state = tx.update(grads, their_state, theirs)
        theirs = jax.tree.map(lambda p, u: p + u, theirs, updates)
        updates, flat_tx_state = flat_tx.update(grads, flat_tx_state, flat_params)
        flat_params = jax.tree.map(lambda p, u: p + u, flat_params, updates)
    for name in state.mu:  # the transformation keeps the fused form's layout by default
        np.testing.assert_allclose(np.asarray(flat_tx_state.nu[name], np.float64),
                                   np.asarray(state.nu[name], np.float64), rtol=2e-3, atol=1e-7)
    for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=2e-3 if got.dtype == jnp.float16 else 1e-5, atol=1e-6)
    as_tree = opt.tree_state(state, mine)
    for got, want in zip(jax.tree.leaves(as_tree.nu), jax.tree.leaves(their_state.nu)):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=2e-3 if got.dtype == jnp.float16 else 1e-5, atol=1e-7)
    back = opt.flat_state(as_tree, mine)
    for name in state.mu:
        np.testing.assert_array_equal(np.asarray(back.mu[name]), np.asarray(state.mu[name]))
        np.testing.assert_array_equal(np.asarray(back.nu[name]), np.asarray(state.nu[name]))


def test_a_state_of_other_params_is_refused():
    rng = np.random.default_rng(2)
    params = _mixed(rng)
    opt = mtx.fused_adam(1e-2)
    with pytest.raises(ValueError, match="init\\(params\\)"):
        opt.step(params, params, opt.init({"a": params["a"]}))
    tree_state = mtx.adam(1e-2, flat_state=False).init(params)
    with pytest.raises(ValueError, match="flat state"):
        opt.step(params, params, tree_state)


def test_chain_states_convert_both_ways():
    rng = np.random.default_rng(3)
    params = _mixed(rng)
    tx = optax.chain(optax.scale(0.5), mtx.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    _, state = tx.update(params, state, params)  # the first trace is the scaled grads
    as_tree = mtx.tree_state(state, params)
    assert jax.tree.structure(as_tree[1].trace) == jax.tree.structure(params)
    for got, grad in zip(jax.tree.leaves(as_tree[1].trace), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(grad) * 0.5)
    back = mtx.flat_state(as_tree, params)
    for name in state[1].trace:
        np.testing.assert_array_equal(np.asarray(back[1].trace[name]),
                                      np.asarray(state[1].trace[name]))


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("make", [lambda f: mtx.adamw(1e-2, weight_decay=0.1, flat_state=f),
                                  lambda f: mtx.lamb(1e-2, weight_decay=0.1, max_grad_norm=1.0,
                                                     flat_state=f),
                                  lambda f: mtx.lars(0.5, trust_ratio_mask=_MASK,
                                                     weight_decay_mask=_MASK, weight_decay=1e-2,
                                                     flat_state=f)],
                         ids=["adamw", "lamb", "lars"])
def test_trees_stepped_a_few_leaves_per_call(make, flat, monkeypatch):
    """With few operands per call, four leaves (and an empty one, in no call) take several
    calls, whose results equal one call's (flat state passes through the calls in turn;
    per-leaf options are split with the leaves)."""
    rng = np.random.default_rng(4)
    params = _mixed(rng)
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype),
                              params) for _ in range(3)]

    def run(tx):
        state, p = tx.init(params), params
        for grads in grads_seq:
            updates, state = jax.jit(tx.update)(grads, state, p)
            p = optax.apply_updates(p, updates)
        return p, state

    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")  # one branch to count calls in
    want = run(make(flat))
    monkeypatch.setattr(_optax_engine, "_OPERANDS_PER_CALL", 7)  # two or three leaves flat, one not
    tx = make(flat)
    text = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    assert text.count("buffer_callback[") == (2 if flat else 4), text
    got = run(tx)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_MASK = {"a": True, "e": True, "h": False, "s": False, "z": True}


_COMPOSITIONS = {
    "multi_steps": lambda m: optax.MultiSteps(m.adam(1e-2), 2),
    "masked": lambda m: optax.masked(m.adam(1e-2), {"a": True, "e": False, "h": False,
                                                   "s": True, "z": False}),
    "multi_transform": lambda m: optax.multi_transform(
        {"x": m.adam(1e-2), "y": m.sgd(0.1, momentum=0.9)},
        {"a": "x", "e": "y", "h": "y", "s": "x", "z": "y"}),
    "apply_if_finite": lambda m: optax.apply_if_finite(m.adam(1e-2), 3),
    "inject_lr": lambda m: optax.inject_hyperparams(m.adamw, static_args=(
        "b1", "b2", "eps", "eps_root", "weight_decay"))(learning_rate=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(_COMPOSITIONS))
def test_optax_compositions_hold_the_flat_state(name):
    """optax's wrappers keep mtapply's flat state as they keep any state, in jit."""
    rng = np.random.default_rng(5)
    params = _mixed(rng)
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype),
                              params) for _ in range(5)]
    results = []
    for module in (mtx, optax):
        tx = _COMPOSITIONS[name](module)

        @jax.jit
        def step(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        p, s = params, tx.init(params)
        for grads in grads_seq:
            p, s = step(p, s, grads)
        results.append(p)
    for got, want in zip(*map(jax.tree.leaves, results)):
        # float16: optax rounds every operation to float16, mtapply once, after fp32 math
        half = got.dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                   rtol=5e-3 if half else 1e-5, atol=2e-3 if half else 1e-6)
