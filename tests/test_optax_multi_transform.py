"""mtapply.optax.multi_transform: adamws of several labels (their own learning rates or
schedules, weight decays and masks) as one op, against optax.multi_transform of optax.adamw's,
through the buffer and host callbacks; the fallback to optax.multi_transform where the labels'
transformations cannot be one op; labels that have no transformation refused."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

SHAPES = {"w": (4, 3), "b": (3,), "v": (5,), "h": (2, 2), "e": (0,)}
LABELS = {"w": "body", "b": "head", "v": "body", "h": "rest", "e": "head"}


def _params(seed):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _transforms(adamw, **options):
    def matrices(params):
        return jax.tree.map(lambda x: x.ndim > 1, params)

    return {"body": adamw(1e-2, weight_decay=0.1, **options),
            "head": adamw(optax.linear_schedule(1e-2, 1e-3, 5), weight_decay=0.0, **options),
            "rest": adamw(3e-3, weight_decay=0.05, mask=matrices, **options)}


def _run(tx, params, steps=5):
    state, p = tx.init(params), params
    update = jax.jit(tx.update)
    for t in range(steps):
        grads = jax.tree.map(lambda x: jnp.cos(3.0 * x + t) * 0.1, params)
        updates, state = update(grads, state, p)
        p = optax.apply_updates(p, updates)
    return p, state


@pytest.mark.parametrize("callback", ["buffer", "host"])
@pytest.mark.parametrize("flat_state", [True, False])
def test_labels_of_adamws_follow_optax_as_one_op(monkeypatch, callback, flat_state):
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", callback)
    params = _params(0)
    mine, state = _run(mtx.multi_transform(_transforms(mtx.adamw, flat_state=flat_state),
                                           LABELS), params)
    theirs, _ = _run(optax.multi_transform(_transforms(optax.adamw), LABELS), params)
    assert isinstance(state, mtx.AdamState)  # one op: one state over the whole tree
    for key in SHAPES:
        np.testing.assert_allclose(np.asarray(mine[key]), np.asarray(theirs[key]), rtol=2e-6,
                                   atol=2e-6)
        if SHAPES[key][0]:
            assert not np.allclose(np.asarray(mine[key]), np.asarray(params[key]))


def test_labels_given_by_a_callable_or_a_prefix():
    params = {"enc": _params(1), "dec": _params(2)}
    full = {"enc": {k: "a" for k in SHAPES}, "dec": {k: "b" for k in SHAPES}}
    theirs, _ = _run(optax.multi_transform(
        {"a": optax.adamw(1e-2, weight_decay=0.1), "b": optax.adamw(1e-3, weight_decay=0.0)},
        full), params)
    for labels in ({"enc": "a", "dec": "b"}, lambda p: {"enc": "a", "dec": "b"}):
        mine, state = _run(mtx.multi_transform(
            {"a": mtx.adamw(1e-2, weight_decay=0.1), "b": mtx.adamw(1e-3, weight_decay=0.0)},
            labels), params)
        assert isinstance(state, mtx.AdamState)
        for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_transformations_that_cannot_be_one_op_run_as_optax_multi_transform():
    """An sgd label, or adamws of other betas: optax.multi_transform of them, still right."""
    params = _params(3)
    for mine_tx, their_tx in (
            ({"body": mtx.adamw(1e-2), "head": mtx.sgd(0.1), "rest": mtx.adam(1e-3)},
             {"body": optax.adamw(1e-2), "head": optax.sgd(0.1), "rest": optax.adam(1e-3)}),
            ({"body": mtx.adamw(1e-2, b1=0.8), "head": mtx.adamw(1e-3), "rest": mtx.adam(1e-3)},
             {"body": optax.adamw(1e-2, b1=0.8), "head": optax.adamw(1e-3),
              "rest": optax.adam(1e-3)})):
        mine, state = _run(mtx.multi_transform(mine_tx, LABELS), params)
        theirs, _ = _run(optax.multi_transform(their_tx, LABELS), params)
        assert not isinstance(state, mtx.AdamState)
        for key in SHAPES:
            np.testing.assert_allclose(np.asarray(mine[key]), np.asarray(theirs[key]),
                                       rtol=2e-6, atol=2e-6)


def test_a_label_without_a_transformation_is_refused_naming_it():
    tx = mtx.multi_transform({"body": mtx.adamw(1e-2), "head": mtx.adamw(1e-3)},
                             dict(LABELS, h="tail"))
    params = _params(4)
    state = tx.init(params)
    with pytest.raises(ValueError, match="label 'tail'"):
        tx.update(params, state, params)


def test_the_fused_form_steps_the_labels_in_place():
    """fused_multi_transform of fused_adamws: params and state after jitted, donated steps,
    against optax.multi_transform of optax.adamw's; other optimizers are refused."""
    params = _params(5)
    theirs, _ = _run(optax.multi_transform(_transforms(optax.adamw), LABELS), params)
    opt = mtx.fused_multi_transform(_transforms(mtx.fused_adamw), LABELS)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    p, state = jax.tree.map(jnp.copy, params), opt.init(params)
    for t in range(5):
        grads = jax.tree.map(lambda x: jnp.cos(3.0 * x + t) * 0.1, params)
        p, state = step(p, grads, state)
    assert isinstance(state, mtx.AdamState)
    for key in SHAPES:
        np.testing.assert_allclose(np.asarray(p[key]), np.asarray(theirs[key]), rtol=2e-6,
                                   atol=2e-6)
    with pytest.raises(ValueError, match="fused_adam or fused_adamw"):
        mtx.fused_multi_transform({"body": mtx.fused_adamw(1e-2), "head": mtx.fused_sgd(0.1)},
                                  LABELS)
