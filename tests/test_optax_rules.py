"""A user-written rule in optax (`mtapply.optax.transformation` and `fused`) on the CPU:
Lion written as a rule against optax.lion, in jit and eagerly, flat and per-leaf state."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply  # noqa: E402
import mtapply.optax as mtx  # noqa: E402
from test_rules import EVERYTHING, LION  # noqa: E402

STEPS = 8


def _tree(rng):
    cpu = jax.devices("cpu")[0]
    return jax.device_put({"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                           "b": jnp.asarray(rng.standard_normal(5), jnp.float32),
                           "e": jnp.zeros((0,), jnp.float32)}, cpu)


def _applying(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _run(step, params, state, grads_seq):
    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params, state


def _against_optax(ours, theirs, seed, rtol=2e-5, atol=2e-6):
    """Jitted steps of `ours` (a transformation or a fused form) and optax's `theirs` on the
    same tree and grads; asserts equal params; returns (params, our state, their state)."""
    rng = np.random.default_rng(seed)
    params = _tree(rng)
    grads_seq = [_tree(rng) for _ in range(STEPS)]
    want, their_state = _run(jax.jit(_applying(theirs)), params, theirs.init(params), grads_seq)
    fused = isinstance(ours, mtx.FusedOptimizer)
    step = jax.jit(lambda p, s, g: ours.step(p, g, s)) if fused else jax.jit(_applying(ours))
    mine, state = _run(step, params, ours.init(params), grads_seq)
    for got, expected in zip(jax.tree.leaves(mine), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=rtol, atol=atol)
    return params, (mine, state), (want, their_state)


@pytest.mark.parametrize("form", ["transformation", "tree-state", "fused"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_lion_rule_follows_optax_lion(form, jit):
    rule = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(0)
    params = _tree(rng)
    grads_seq = [_tree(rng) for _ in range(STEPS)]
    theirs = optax.lion(1e-2, b1=0.9, b2=0.99, weight_decay=0.1)
    their_step = _applying(theirs)
    if form == "fused":
        ours = mtx.fused(rule, 1e-2, weight_decay=0.1)

        def our_step(p, s, g):
            return ours.step(p, g, s)
    else:
        ours = mtx.transformation(rule, 1e-2, weight_decay=0.1, flat_state=form != "tree-state")
        our_step = _applying(ours)
    wrap = jax.jit if jit else (lambda f: f)
    mine, state = _run(wrap(our_step), params, ours.init(params), grads_seq)
    want, their_state = _run(wrap(their_step), params, theirs.init(params), grads_seq)
    for got, expected in zip(jax.tree.leaves(mine), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)
    as_tree = state if form == "tree-state" else mtx.tree_state(state, params)
    assert int(as_tree.count) == STEPS and type(as_tree).__name__ == "LionState"
    for got, expected in zip(jax.tree.leaves(as_tree.exp_avg), jax.tree.leaves(their_state[0].mu)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-7)


def test_schedules_drive_the_rules_lr():
    rule = mtapply.rule("lion", **LION)
    schedule = optax.linear_schedule(1e-2, 1e-3, STEPS)
    rng = np.random.default_rng(1)
    params = _tree(rng)
    grads_seq = [_tree(rng) for _ in range(STEPS)]
    outs = []
    for tx in (mtx.transformation(rule, schedule, weight_decay=0.0),
               optax.lion(schedule, weight_decay=0.0)):
        outs.append(_run(jax.jit(_applying(tx)), params, tx.init(params), grads_seq)[0])
    for got, expected in zip(*map(jax.tree.leaves, outs)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_bad_uses_are_refused():
    lion = mtapply.rule("lion", **LION)
    with pytest.raises(TypeError, match="no hyperparameter 'momentum'"):
        mtx.transformation(lion, 1e-3, momentum=0.9)
    with pytest.raises(ValueError, match="beta1 must be"):
        mtx.transformation(lion, 1e-3, beta1=float("nan"))
    no_lr = mtapply.rule("nolr", slots="param:rw grad:r", hyper={"rate": None},
                         update="param = param - rate * grad")
    with pytest.raises(TypeError, match="has no lr"):
        mtx.transformation(no_lr, 1e-3)


def test_read_only_slots_are_state_passed_on():
    """A slot the update only reads (as Prodigy's p0) is kept in the state and passed on as
    it is."""
    everything = mtx.fused(mtapply.rule("everything", **EVERYTHING), 1e-3)
    params = _tree(np.random.default_rng(0))
    state = everything.init(params)
    params, state = everything.step(params, params, state)
    assert int(state.count) == 1
    for leaf in jax.tree.leaves(mtx.tree_state(state, params).b):
        assert not np.any(np.asarray(leaf))


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
def test_shipped_lion_takes_optax_lions_arguments(fused):
    hyper = dict(b1=0.8, b2=0.95, weight_decay=0.05)
    _against_optax((mtx.fused_lion if fused else mtx.lion)(3e-3, **hyper),
                   optax.lion(3e-3, **hyper), seed=2, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="mask"):
        mtx.lion(1e-3, mask={"w": True})


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
@pytest.mark.parametrize("hyper", [dict(), dict(b1=0.9, b2=0.8, b3=0.95, eps=1e-6,
                                                 weight_decay=0.02)], ids=["defaults", "set"])
def test_shipped_adan_follows_optax_adan(fused, hyper):
    params, (_, state), (_, their_state) = _against_optax(
        (mtx.fused_adan if fused else mtx.adan)(1e-2, **hyper), optax.adan(1e-2, **hyper), seed=3)
    state = mtx.tree_state(state, params)
    for field in ("m", "v", "n"):
        for got, expected in zip(jax.tree.leaves(getattr(state, field)),
                                 jax.tree.leaves(getattr(their_state[0], field))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5,
                                       atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
@pytest.mark.parametrize("name,ours,theirs", [
    ("adagrad", lambda m: m.adagrad(0.1), lambda: optax.adagrad(0.1)),
    ("adagrad-set", lambda m: m.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-5),
     lambda: optax.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-5)),
    ("rmsprop", lambda m: m.rmsprop(1e-2), lambda: optax.rmsprop(1e-2)),
    ("rmsprop-all", lambda m: m.rmsprop(1e-2, decay=0.8, initial_scale=0.5, centered=True,
                                        momentum=0.9, nesterov=True),
     lambda: optax.rmsprop(1e-2, decay=0.8, initial_scale=0.5, centered=True, momentum=0.9,
                           nesterov=True)),
    ("rmsprop-torch-eps", lambda m: m.rmsprop(1e-2, eps_in_sqrt=False, momentum=0.5),
     lambda: optax.rmsprop(1e-2, eps_in_sqrt=False, momentum=0.5)),
    ("adamax", lambda m: m.adamax(1e-2, b1=0.8, eps=1e-6), lambda: optax.adamax(1e-2, b1=0.8,
                                                                                eps=1e-6)),
    ("adadelta", lambda m: m.adadelta(0.5, rho=0.8, weight_decay=0.01),
     lambda: optax.adadelta(0.5, rho=0.8, weight_decay=0.01)),
    ("adadelta-no-lr", lambda m: m.adadelta(), lambda: optax.adadelta()),
    ("radam", lambda m: m.radam(1e-2, b2=0.99), lambda: optax.radam(1e-2, b2=0.99)),
    ("radam-nesterov", lambda m: m.radam(1e-2, b1=0.8, b2=0.99, eps_root=1e-8, threshold=6.0,
                                         nesterov=True),
     lambda: optax.radam(1e-2, b1=0.8, b2=0.99, eps_root=1e-8, threshold=6.0, nesterov=True)),
    ("nadam", lambda m: m.nadam(1e-2, b1=0.8), lambda: optax.nadam(1e-2, b1=0.8)),
    ("nadamw", lambda m: m.nadamw(1e-2, weight_decay=0.05), lambda: optax.nadamw(1e-2,
                                                                              weight_decay=0.05)),
])
def test_shipped_rules_follow_optax(fused, name, ours, theirs):
    class Fused:  # the fused forms take the same constructor arguments
        def __getattr__(self, attr):
            return getattr(mtx, f"fused_{attr}")

    _against_optax(ours(Fused() if fused else mtx), theirs(), seed=4)


def test_adadelta_refuses_what_it_cannot_take():
    with pytest.raises(NotImplementedError, match="weight_decay_mask"):
        mtx.adadelta(0.5, weight_decay_mask={"w": True})


def test_one_state_type_per_rule():
    params = _tree(np.random.default_rng(5))
    first, second = mtx.lion(1e-3), mtx.fused_lion(1e-2)
    assert type(first.init(params)) is type(second.init(params))
    assert jax.tree.structure(first.init(params)) == jax.tree.structure(second.init(params))


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
@pytest.mark.parametrize("hyper", [dict(learning_rate=1e-2),
                                   dict(learning_rate=3e-2, warmup_steps=3, b1=0.8, b2=0.99,
                                        weight_decay=0.05, weight_lr_power=1.0)],
                         ids=["constant", "warmup"])
def test_schedule_free_adamw_follows_optax_contrib(fused, hyper):
    make = mtx.fused_schedule_free_adamw if fused else mtx.schedule_free_adamw
    params, (mine, state), (want, their_state) = _against_optax(
        make(**hyper), optax.contrib.schedule_free_adamw(**hyper), seed=6)
    evaluated = mtx.schedule_free_eval_params(state, mine)
    their_eval = optax.contrib.schedule_free_eval_params(their_state, want)
    for got, expected in zip(jax.tree.leaves(evaluated), jax.tree.leaves(their_eval)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(state.weight_sum), float(their_state.weight_sum), rtol=1e-6)


def test_a_rule_that_reads_the_params_only_in_its_sums_reads_them():
    """The update is taken as new - old params (not from zero params) where only a sum reads
    them: its norms are the params'. (This rule's update sets the params afresh.)"""
    rule = mtapply.rule("normed", slots="param:rw grad:r", hyper=dict(lr=None),
                        sums=dict(p2="param * param"),
                        update="param = 0 - lr * grad * sqrt(p2)")
    rng = np.random.default_rng(7)
    params, grads = _tree(rng), _tree(rng)
    updates, _ = mtx.transformation(rule, 0.1).update(grads, mtx.transformation(rule, 0.1)
                                                      .init(params), params)
    for k in ("w", "b"):
        norm = np.sqrt(np.sum(np.asarray(params[k], np.float64) ** 2))
        new = -0.1 * np.asarray(grads[k]) * norm
        np.testing.assert_allclose(np.asarray(updates[k]), new - np.asarray(params[k]),
                                   rtol=1e-5, atol=1e-6)
