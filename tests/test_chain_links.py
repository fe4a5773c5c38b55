"""Links of `mtapply.chain` with optax's finer arguments, against optax's own links in float64:
add_decayed_weights with a mask, scale_by_schedule (through mtapply.optax.transformation), and
links as optax GradientTransformations inside optax.chain."""
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
    engine._OPERANDS_PER_CALL = 4  # two leaves per call ("zero" mode: updates and grads)
    try:
        with pytest.raises(ValueError, match="takes 3 calls"):
            tx.update(params, state, params)
    finally:
        engine._OPERANDS_PER_CALL = saved


SCHEDULES = {
    "linear": lambda: optax.linear_schedule(1.0, 0.1, STEPS - 1),
    "cosine": lambda: optax.cosine_decay_schedule(0.5, STEPS),
    "jnp": lambda: (lambda count: 0.5 + 0.25 * jnp.sin(0.7 * count)),
}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_scale_by_schedule_steps_as_optax(schedule, jit):
    """Adam, then the schedule's value at the count of steps taken, then the learning rate."""
    fn = SCHEDULES[schedule]()
    ours = mtapply.chain(L.scale_by_adam(), L.scale_by_schedule(fn), L.scale_by_learning_rate())
    assert list(ours.schedules) == ["step_size"] and ours.hyper["step_size"] is None
    theirs = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(fn),
                         optax.scale_by_learning_rate(0.05))
    _assert_equal_runs(mtx.transformation(ours, 0.05), theirs, jit=jit)


def test_a_chain_without_a_learning_rate_steps_by_its_schedule():
    """optax's idiom: the schedule gives the (negative) step size; no lr, learning_rate None."""
    lr = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, STEPS)
    ours = mtapply.chain(L.clip(0.8), L.scale_by_adam(), L.scale_by_schedule(lambda c: -lr(c)))
    theirs = optax.chain(optax.clip(0.8), optax.scale_by_adam(),
                         optax.scale_by_schedule(lambda c: -lr(c)))
    _assert_equal_runs(mtx.transformation(ours), theirs)
    _assert_equal_runs(mtx.transformation(ours, flat_state=False), theirs, jit=False)


def test_the_schedule_is_traced_once_and_read_at_each_step():
    """Under jit the schedule is a traced value: one trace, a new value each step."""
    calls = []

    def schedule(count):
        calls.append(count)
        return 1.0 / (1.0 + count)

    ours = mtapply.chain(L.trace(0.5), L.scale_by_schedule(schedule), L.scale_by_learning_rate())
    theirs = optax.chain(optax.trace(0.5), optax.scale_by_schedule(lambda c: 1.0 / (1.0 + c)),
                         optax.scale_by_learning_rate(0.1))
    _assert_equal_runs(mtx.transformation(ours, 0.1), theirs)
    assert len(calls) == 1 and isinstance(calls[0], jax.core.Tracer)


def test_a_scheduled_weight_decay_steps_as_optax():
    """add_decayed_weights(schedule), as optax's, with a mask too."""
    decay = optax.exponential_decay(0.1, 1, 0.5)
    ours = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(decay, MASKS["pytree"]),
                         L.scale_by_schedule(optax.linear_schedule(-0.1, -0.01, STEPS)))
    theirs = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(decay, MASKS["pytree"]),
                         optax.scale_by_schedule(optax.linear_schedule(-0.1, -0.01, STEPS)))
    assert list(ours.schedules) == ["weight_decay", "step_size"]
    _assert_equal_runs(mtx.transformation(ours), theirs, seed=4)


def test_a_scheduled_chain_as_a_fused_step():
    fn = optax.linear_schedule(1.0, 0.2, STEPS)
    rule = mtapply.chain(L.scale_by_adam(), L.scale_by_schedule(fn), L.scale_by_learning_rate())
    theirs = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(fn),
                         optax.scale_by_learning_rate(0.05))
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        params = _tree(rng)
        grads_seq = [_tree(rng) for _ in range(STEPS)]
        want = _run(theirs, params, grads_seq)
        opt = mtx.fused(rule, 0.05)
        state = opt.init(params)
        step = jax.jit(opt.step)
        for grads in grads_seq:
            params, state = step(params, grads, state)
        assert int(state.count) == STEPS
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_schedules_are_refused_where_they_cannot_apply():
    fn = optax.constant_schedule(0.5)
    scheduled = mtapply.chain(L.scale_by_schedule(fn), L.scale_by_learning_rate())
    with pytest.raises(TypeError, match="step_size is scheduled"):
        mtx.transformation(scheduled, 0.1, step_size=0.5)
    with pytest.raises(TypeError, match="takes a function of the step count"):
        L.scale_by_schedule(0.5)
    with pytest.raises(TypeError, match="must be a function of the step count"):
        mtapply.Link("s", "", dict(rate=None), "update = rate * grad", schedules={"rate": 0.5})
    with pytest.raises(TypeError, match="has no lr, so learning_rate would change nothing"):
        mtx.transformation(mtapply.chain(L.scale_by_schedule(fn)), 0.1)
    with pytest.raises(TypeError, match="reads lr: give learning_rate"):
        mtx.transformation(scheduled)
    factory = mtx.alias(mtapply.chain(L.scale_by_adam(), L.scale_by_schedule(fn)))
    assert "step_size" not in str(__import__("inspect").signature(factory))
    params = {"w": jnp.ones(3)}
    tx = factory()
    updates, _ = tx.update(params, tx.init(params))
    np.testing.assert_allclose(np.asarray(updates["w"]), 0.5, rtol=1e-6)


MIXED = {  # name -> (optax.chain with mtapply links among optax's, the all-optax chain)
    "adamw": (lambda: [L.scale_by_adam(b1=0.8), optax.add_decayed_weights(0.01),
                       L.scale_by_learning_rate(0.05)],
              lambda: [optax.scale_by_adam(b1=0.8), optax.add_decayed_weights(0.01),
                       optax.scale_by_learning_rate(0.05)]),
    "masked-trace": (lambda: [optax.clip(1.0), L.add_decayed_weights(0.1, MASKS["callable"]),
                              L.trace(0.9, nesterov=True), optax.scale(-0.1)],
                     lambda: [optax.clip(1.0), optax.add_decayed_weights(0.1, MASKS["callable"]),
                              optax.trace(0.9, nesterov=True), optax.scale(-0.1)]),
    # (a float64 schedule: optax.linear_schedule's float32 value is rounded eagerly and not
    # under jit, where XLA drops the round trip, so optax's own eager and jitted runs differ)
    "schedule": (lambda: [L.scale_by_rms(decay=0.8, initial_scale=0.1), optax.scale_by_adam(),
                          L.scale_by_schedule(lambda count: -0.1 / (1.0 + 0.5 * count))],
                 lambda: [optax.scale_by_rms(decay=0.8, initial_scale=0.1), optax.scale_by_adam(),
                          optax.scale_by_schedule(lambda count: -0.1 / (1.0 + 0.5 * count))]),
}
SUMMED = {  # the same, with links whose sums are float32 as the kernel's: optax's to 1e-6
    "clip-by-global-norm": (
        lambda: [L.clip_by_global_norm(1.0), optax.scale_by_adam(), L.scale(-0.1)],
        lambda: [optax.clip_by_global_norm(1.0), optax.scale_by_adam(), optax.scale(-0.1)]),
    "trust-ratio": (lambda: [L.scale_by_belief(), optax.add_decayed_weights(0.01),
                             L.scale_by_trust_ratio(), optax.scale(-0.05)],
                    lambda: [optax.scale_by_belief(), optax.add_decayed_weights(0.01),
                             optax.scale_by_trust_ratio(), optax.scale(-0.05)]),
}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", list(MIXED))
def test_links_run_inside_optax_chain_beside_optax_links(name, jit):
    ours, theirs = MIXED[name]
    _assert_equal_runs(optax.chain(*ours()), optax.chain(*theirs()), seed=6, jit=jit)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", list(SUMMED))
def test_summing_links_run_inside_optax_chain(name, jit):
    ours, theirs = SUMMED[name]
    _assert_equal_runs(optax.chain(*ours()), optax.chain(*theirs()), seed=7, rtol=1e-6,
                       atol=1e-8, jit=jit)


def test_a_link_is_a_gradient_transformation_of_its_own():
    link = L.trace(0.5)
    params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    state = link.init(params)
    assert int(state.count) == 0
    updates, state = link.update(params, state)  # trace reads no params: none needed
    updates, state = link.update(params, state, loss=1.0)  # optax's extra arguments: ignored
    np.testing.assert_allclose(np.asarray(updates["w"]), 1.5 * np.arange(3.0))
    assert int(state.count) == 2
    assert link._transformation() is link._transformation()  # made once
    copied = __import__("copy").deepcopy(link)
    assert "_optax" not in vars(copied) and copied.update_text == link.update_text
    with pytest.raises(ValueError, match="reads the params"):
        L.add_decayed_weights(0.1).update(params, L.add_decayed_weights(0.1).init(params))
    with pytest.raises(TypeError, match="scales by a learning rate it was not given"):
        optax.chain(L.scale_by_learning_rate()).init(params)


def test_links_import_jax_only_when_run_in_optax():
    import subprocess
    import sys

    code = ("import sys, mtapply\n"
            "from mtapply.rules import library as L\n"
            "link = L.scale_by_adam()\n"
            "mtapply.chain(link, L.scale_by_learning_rate())\n"
            "assert 'jax' not in sys.modules and 'optax' not in sys.modules\n"
            "link.init([__import__('numpy').ones(3, 'float32')])\n"
            "assert 'jax' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_masked_chain_is_refused_as_a_torch_optimizer():
    """torch has param groups, not pytrees: a mask it cannot apply is refused, naming the fix."""
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    chain = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(0.01, mask={"w": True}),
                          L.scale_by_learning_rate())
    param = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="per param group"):
        mt.optimizer(chain, [param], lr=1e-3)
    unmasked = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(0.01),
                             L.scale_by_learning_rate())
    mt.optimizer(unmasked, [param], lr=1e-3)  # the same chain without a mask is taken
