"""The fused forms' flat state: one buffer per dtype and state slot, each leaf at an aligned
offset; the same steps as the transformation forms, and conversions to and from pytrees."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply.optax import _FlatLayout  # noqa: E402


def _mixed(rng):
    cpu = jax.devices("cpu")[0]
    return jax.device_put({"a": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
                           "e": jnp.zeros((0, 2), jnp.float32),
                           "h": jnp.asarray(rng.standard_normal(7), jnp.float16),
                           "s": jnp.asarray(rng.standard_normal(()), jnp.float32),
                           "z": jnp.asarray(rng.standard_normal(9), jnp.float32)}, cpu)


def test_leaves_sit_at_16_byte_offsets_in_one_buffer_per_dtype():
    leaves = jax.tree.leaves(_mixed(np.random.default_rng(0)))
    layout = _FlatLayout(leaves)
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
    opt, tx = mtx.fused_adamw(1e-2, weight_decay=0.1, eps=1e-3), mtx.adamw(1e-2, weight_decay=0.1, eps=1e-3)
    state, their_state, theirs = opt.init(params), tx.init(params), params
    mine = params
    for _ in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        mine, state = opt.step(mine, grads, state)
        updates, their_state = tx.update(grads, their_state, theirs)
        theirs = jax.tree.map(lambda p, u: p + u, theirs, updates)
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
    tree_state = mtx.adam(1e-2).init(params)
    with pytest.raises(ValueError, match="flat state"):
        opt.step(params, params, tree_state)
