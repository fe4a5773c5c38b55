"""Links of `mtapply.chain` with optax's finer arguments, against optax's own links in float64:
add_decayed_weights with a mask (through mtapply.optax.transformation)."""
import numpy as np
import pytest

import mtapply
from mtapply.rules import library as L

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

STEPS = 5
SHAPES = {"w": (5, 4), "b": (4,), "norm": {"scale": (3,), "bias": (3,)}}


def _tree(rng, shapes=SHAPES):
    return {k: _tree(rng, v) if isinstance(v, dict) else
            jnp.asarray(rng.standard_normal(v), jnp.float64) for k, v in shapes.items()}


def _run(tx, params, grads_seq, jit=True):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    step = jax.jit(step) if jit else step
    state = tx.init(params)
    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params


def _assert_equal_runs(ours, theirs, seed=0, rtol=1e-12, atol=1e-12, jit=True):
    """`ours` and `theirs` (transformations) from the same float64 params and grads."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        params = _tree(rng)
        grads_seq = [_tree(rng) for _ in range(STEPS)]
        got = _run(ours, params, grads_seq, jit)
        want = _run(theirs, params, grads_seq, jit)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(got))
        moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), got, params))
        assert all(moved)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
    return got


MASKS = {
    "pytree": {"w": True, "b": False, "norm": {"scale": False, "bias": True}},
    "callable": lambda params: jax.tree.map(lambda p: p.ndim > 1, params),
    "prefix": {"w": True, "b": False, "norm": False},
    "all": {"w": True, "b": True, "norm": {"scale": True, "bias": True}},
    "none": lambda params: jax.tree.map(lambda _: False, params),
}


@pytest.mark.parametrize("flat_state", [True, False], ids=["flat", "tree-state"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_masked_add_decayed_weights_steps_as_optax(mask, flat_state):
    ours = mtapply.chain(L.scale_by_adam(b1=0.8), L.add_decayed_weights(0.1, MASKS[mask]),
                         L.scale_by_learning_rate())
    assert list(ours.masks) == ["weight_decay"]
    theirs = optax.chain(optax.scale_by_adam(b1=0.8),
                         optax.add_decayed_weights(0.1, MASKS[mask]),
                         optax.scale_by_learning_rate(0.05))
    _assert_equal_runs(mtx.transformation(ours, 0.05, flat_state=flat_state), theirs)


def test_masked_add_decayed_weights_steps_as_optax_eagerly():
    ours = mtapply.chain(L.trace(0.9), L.add_decayed_weights(0.05, MASKS["callable"]),
                         L.scale_by_learning_rate())
    theirs = optax.chain(optax.trace(0.9), optax.add_decayed_weights(0.05, MASKS["callable"]),
                         optax.scale_by_learning_rate(0.1))
    _assert_equal_runs(mtx.transformation(ours, 0.1), theirs, seed=1, jit=False)


def test_two_masked_links_each_keep_their_mask():
    """Two add_decayed_weights links: weight_decay_2 and weight_decay_4, each its own mask."""
    first, second = MASKS["pytree"], MASKS["callable"]
    ours = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(0.1, first), L.trace(0.5),
                         L.add_decayed_weights(0.02, second), L.scale_by_learning_rate())
    assert list(ours.masks) == ["weight_decay_2", "weight_decay_4"]
    theirs = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1, first),
                         optax.trace(0.5), optax.add_decayed_weights(0.02, second),
                         optax.scale_by_learning_rate(0.05))
    _assert_equal_runs(mtx.transformation(ours, 0.05), theirs, seed=2)


def test_a_masked_chain_with_a_weight_decay_array_keeps_the_mask():
    """A weight decay given as an array (a device value) is still 0 where masked out."""
    ours = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(0.0, MASKS["pytree"]),
                         L.scale_by_learning_rate())
    theirs = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1, MASKS["pytree"]),
                         optax.scale_by_learning_rate(0.05))
    with jax.enable_x64(True):
        tx = mtx.transformation(ours, 0.05, weight_decay=jnp.asarray(0.1, jnp.float64))
    _assert_equal_runs(tx, theirs, seed=3)


def test_a_masked_chain_pickles_with_its_masks():
    import pickle

    rule = mtapply.chain(L.add_decayed_weights(0.1, MASKS["pytree"]), L.scale_by_learning_rate())
    again = pickle.loads(pickle.dumps(rule))
    assert again.masks == {"weight_decay": MASKS["pytree"]}
    assert again.slots == rule.slots and again.hyper == rule.hyper


def test_bad_masks_are_refused():
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    grads = jax.tree.map(jnp.ones_like, params)

    def update(rule, mask_params=params):
        tx = mtx.transformation(rule, 0.1)
        return tx.update(grads, tx.init(params), mask_params)

    clipped = mtapply.chain(L.clip_by_global_norm(1.0),
                            L.add_decayed_weights(0.1, {"w": True, "b": False}),
                            L.scale_by_learning_rate())
    with pytest.raises(ValueError, match="sums over every leaf"):
        update(clipped)
    not_split = mtapply.chain(L.clip_by_global_norm(1.0),  # one class of leaves: one call
                              L.add_decayed_weights(0.1, {"w": False, "b": False}),
                              L.scale_by_learning_rate())
    update(not_split)
    with pytest.raises(ValueError, match="a pytree of bools like the params"):
        update(mtapply.chain(L.add_decayed_weights(0.1, {"x": True}), L.scale_by_learning_rate()))
    with pytest.raises(TypeError, match="must hold Python bools"):
        update(mtapply.chain(L.add_decayed_weights(0.1, lambda p: jax.tree.map(
            lambda x: jnp.asarray(True), p)), L.scale_by_learning_rate()))
    with pytest.raises(ValueError, match="masks 'rate', which is not one of its"):
        mtapply.Link("decay", "", dict(weight_decay=0.1), "update = grad + weight_decay * param",
                     masks={"rate": True})


def test_a_whole_list_sum_over_several_calls_is_refused():
    """A tree stepped by several calls would sum over each call's part: refused."""
    import mtapply._optax_engine as engine

    rule = mtapply.chain(L.clip_by_global_norm(1.0), L.scale_by_learning_rate())
    params = [jnp.ones(3) for _ in range(6)]
    tx = mtx.transformation(rule, 0.1)
    state = tx.init(params)
    saved = engine._OPERANDS_PER_CALL
    engine._OPERANDS_PER_CALL = 6  # two leaves per call ("zero" mode: updates and grads)
    try:
        with pytest.raises(ValueError, match="takes 3 calls"):
            tx.update(params, state, params)
    finally:
        engine._OPERANDS_PER_CALL = saved
