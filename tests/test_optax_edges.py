"""mtapply.optax where users meet its edges, on the CPU: a schedule that decays to 0 (a few
float32 ulps under it at its end) runs to its end, as optax's does, while a clearly negative
one is still refused; an lr array of more than one element is refused naming its shape; an
update without params over a state of several dtypes asks for the params; the signatures and
defaults are optax's (adan's eps_root, schedule-free AdamW's positional arguments); refusals
name optax's arguments and functions; whole-list sums name the leaf limit of one call."""
from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

import mtapply.optax as mtx  # noqa: E402

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.array([0.5, -0.25])}
GRADS = jax.tree.map(lambda x: 0.1 * x + 0.05, PARAMS)


def _run(tx, steps, params=PARAMS, jit=True):
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for _ in range(steps):
        updates, state = update(GRADS, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("make", [mtx.adamw, mtx.sgd, mtx.lion], ids=lambda f: f.__name__)
def test_a_schedule_that_decays_to_zero_runs_to_its_end_as_optax(make):
    # as optax.linear_schedule(1e-2, 0.0, 10) in float32: -1.5e-10 at its end
    def schedule(count):
        return jnp.maximum(1e-2 * (1.0 - count / 10), 0.0) - 1.5e-10 * (count >= 10)

    ours = _run(make(schedule), 12)
    theirs = _run(getattr(optax, make.__name__)(schedule), 12)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_a_scheduled_weight_decay_that_decays_to_zero_runs_to_its_end():
    from mtapply.rules import library as L

    decay = optax.linear_schedule(0.1, 0.0, 10)
    chain = mtx.transformation(__import__("mtapply").chain(
        L.scale_by_adam(), L.add_decayed_weights(decay), L.scale_by_learning_rate()), 1e-3)
    ours = _run(chain, 12)
    theirs = _run(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(decay),
                              optax.scale_by_learning_rate(1e-3)), 12)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path raises; a GPU kernel "
                    "skips the step and flags it")
def test_a_clearly_negative_scheduled_lr_is_still_refused():
    with pytest.raises(Exception, match="lr must be >= 0"):
        jax.block_until_ready(_run(mtx.sgd(lambda count: -1e-3 + 0.0 * count), 1))


@pytest.mark.parametrize("lr", [jnp.array([1e-3, 7.0]), lambda count: jnp.full(2, 1e-3)],
                         ids=["array", "schedule"])
def test_an_lr_of_several_elements_is_refused_naming_its_shape(lr):
    with pytest.raises(ValueError, match=r"mtapply.optax.sgd: learning_rate must be a number "
                                         r"\(or a schedule giving one\), got an array of shape \(2,\)"):
        _run(mtx.sgd(lr), 1)


def test_an_update_without_params_over_several_dtypes_asks_for_the_params():
    params = {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.ones((2,), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, jnp.float32), params)
    tx = mtx.adam(1e-2)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"mtapply.optax.adam: the state keeps params of "
                                         r"bfloat16 and float32 .* pass the params too"):
        tx.update(grads, state)
    updates, _ = tx.update(grads, state, params)  # with them it steps, as optax.adam does
    expected, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2, atol=1e-3)


def test_signatures_and_defaults_are_optaxs():
    assert inspect.signature(mtx.adan).parameters["eps_root"].default == (
        inspect.signature(optax.adan).parameters["eps_root"].default)
    ours = _run(mtx.adan(1e-3), 3)
    theirs = _run(optax.adan(1e-3), 3)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    args = (1e-3, 5, 0.8, 0.99)  # learning_rate, warmup_steps, b1, b2 by position
    ours = _run(mtx.schedule_free_adamw(*args), 4)
    theirs = _run(optax.contrib.schedule_free_adamw(*args), 4)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    mtx.fused_schedule_free_adamw(*args)


@pytest.mark.parametrize("make,match", [
    (lambda: mtx.lion(1e-3, b1=1.0), r"mtapply.optax.lion: b1 must be \[0, 1\), got 1.0"),
    (lambda: mtx.lion(1e-3, b2=1.5), r"mtapply.optax.lion: b2 must be \[0, 1\), got 1.5"),
    (lambda: mtx.adan(1e-3, b3=2.0), r"mtapply.optax.adan: b3 must be \[0, 1\), got 2.0"),
    (lambda: mtx.prodigy(betas=(0.9, 1.5)), r"mtapply.optax.prodigy: betas\[1\] must be"),
    (lambda: mtx.muon(1e-2, preconditioning="polar"), "preconditioning=.polar. is not one of"),
])
def test_refusals_name_optaxs_arguments_and_functions(make, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        make()


def test_adafactors_refusals_name_its_arguments():
    with pytest.raises(ValueError, match="mtapply.optax.adafactor: weight_decay_rate must be >= 0"):
        mtx.adafactor(1e-2, weight_decay_rate=-0.1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path raises; a GPU kernel "
                    "skips the step and flags it")
@pytest.mark.parametrize("kwargs,match", [
    (dict(learning_rate=1e-2, decay_offset=5),  # optax's decay is NaN before the offset
     r"mtapply.optax.adafactor: the step's decay 1 - \(count - decay_offset \+ 1\)\^-decay_rate "
     r"must be a finite number, got nan"),
    (dict(learning_rate=lambda count: 1e-2 - 1e-2 * count),
     "mtapply.optax.adafactor: learning_rate must be >= 0, got -0.0099"),
])
def test_a_value_refused_at_a_step_is_named_as_optax_names_it(kwargs, match):
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_run(mtx.adafactor(**kwargs), 3))


def test_whole_list_sums_past_one_call_name_the_limit():
    params = {f"p{i}": jnp.full((2,), 0.5) for i in range(1100)}
    tx = mtx.prodigy()
    with pytest.raises(ValueError, match="Keep the tree to 1024 leaves"):
        tx.update(params, tx.init(params), params)
