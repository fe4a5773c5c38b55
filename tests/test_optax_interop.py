"""mtapply.optax with optax's and JAX's machinery: optax.tree_map_params on the flat state,
optax's extra arguments, jax.vmap over an update (ensembles), jax.grad through one (a clear
refusal), state dtypes (mu_dtype and the like) kept across updates, pickled states, float64
steps under jax_enable_x64, and integer or complex params refused naming the leaf."""
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply.rules import library  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {  # name -> a transformation of each kind
    "adam": lambda **kw: mtx.adam(1e-2, **kw),
    "adamw": lambda **kw: mtx.adamw(1e-2, weight_decay=0.1, **kw),
    "sgd": lambda **kw: mtx.sgd(1e-2, momentum=0.9, **kw),
    "lars": lambda **kw: mtx.lars(0.3, **kw),
    "lamb": lambda **kw: mtx.lamb(1e-2, weight_decay=0.01, **kw),
    "lion": lambda **kw: mtx.lion(1e-3, **kw),
    "adan": lambda **kw: mtx.adan(1e-2, **kw),
    "adagrad": lambda **kw: mtx.adagrad(1e-2, **kw),
    "adamax": lambda **kw: mtx.adamax(1e-2, **kw),
    "adadelta": lambda **kw: mtx.adadelta(0.5, weight_decay=0.01, **kw),
    "radam": lambda **kw: mtx.radam(1e-2, **kw),
    "nadamw": lambda **kw: mtx.nadamw(1e-2, **kw),
    "rmsprop": lambda **kw: mtx.rmsprop(1e-2, centered=True, momentum=0.9, **kw),
    "schedule_free_adamw": lambda **kw: mtx.schedule_free_adamw(1e-2, **kw),
    "rule": lambda **kw: mtx.transformation(library.lion(), 1e-3, **kw),
}


def _tree(rng, scale=1.0, dtype=jnp.float32):
    return {"w": jnp.asarray(rng.standard_normal((6, 4)) * scale, dtype),
            "b": jnp.asarray(rng.standard_normal(4) * scale, dtype)}


def _steps(tx, params, grads_seq):
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------
# optax.tree_map_params


@pytest.mark.parametrize("name", list(FACTORIES))
def test_tree_map_params_keeps_optax_placeholders_in_the_flat_slots(name):
    tx, params = FACTORIES[name](), _tree(np.random.default_rng(0))
    state = tx.init(params)
    _assert_trees_equal(optax.tree_map_params(tx, lambda v: v, state), state)
    with_placeholders = tx.init(optax.tree_utils._state_utils._ParamsPlaceholder())
    for field in type(state).slot_fields if hasattr(type(state), "slot_fields") else \
            state._fields[1:]:
        slot = getattr(with_placeholders, field)
        assert slot is None or type(slot).__name__ == "_ParamsPlaceholder", field
    # every flat buffer mapped, the rest as transform_non_params says
    marked = optax.tree_map_params(tx, lambda v: "slot", state, transform_non_params=lambda v: 0)
    assert set(jax.tree.leaves(marked)) <= {"slot", 0} and "slot" in jax.tree.leaves(marked)


def test_a_map_that_changes_the_flat_state_is_refused_at_the_next_update():
    tx, params = mtx.adam(1e-2), _tree(np.random.default_rng(1))
    state = optax.tree_map_params(tx, lambda v: v.astype(jnp.bfloat16), tx.init(params))
    with pytest.raises(ValueError, match=r"state.mu\['float32'\] is bfloat16.*flat_state=False"):
        tx.update(params, state, params)


def test_tree_map_params_with_params_like_trees_on_optax_layout():
    """Sharding specs are built from a tree like params: with flat_state=False the state's
    slots are such trees, as optax's."""
    params = _tree(np.random.default_rng(2))
    specs = {"w": "row", "b": "col"}
    for name in ("adamw", "lamb", "lion"):
        tx = FACTORIES[name](flat_state=False)
        mapped = optax.tree_map_params(tx, lambda _, spec: spec, tx.init(params), specs,
                                       transform_non_params=lambda _: None)
        slots = [getattr(mapped, f) for f in type(mapped)._fields if getattr(mapped, f) is not None]
        assert slots and all(slot == specs for slot in slots)


# ---------------------------------------------------------------------------------------------
# optax's extra arguments


@pytest.mark.parametrize("name", list(FACTORIES))
def test_update_takes_optax_extra_arguments(name):
    tx, rng = FACTORIES[name](), np.random.default_rng(3)
    params, grads = _tree(rng), _tree(rng)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    state = tx.init(params)
    want = tx.update(grads, state, params)
    got = tx.update(grads, state, params, loss=jnp.float32(2.0), note="not an array")
    _assert_trees_equal(got, want)


# ---------------------------------------------------------------------------------------------
# jax.vmap and jax.grad


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "tree"])
@pytest.mark.parametrize("name", ["adamw", "lamb", "lion", "sgd"])
def test_vmap_over_updates_equals_each_member_alone(name, flat):
    """An ensemble of 3 models, one update of all under jax.vmap (each member its own call)."""
    tx, rng = FACTORIES[name](flat_state=flat), np.random.default_rng(4)
    members = [_tree(rng) for _ in range(3)]
    grads = [[_tree(rng, 0.3) for _ in range(3)] for _ in range(4)]
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    params, state = stack(members), jax.vmap(tx.init)(stack(members))
    vstep = jax.jit(jax.vmap(step))
    for g in grads:
        params, state = vstep(params, state, stack(g))
    for k, member in enumerate(members):
        want, want_state = _steps(tx, member, [g[k] for g in grads])
        got = jax.tree.map(lambda x: x[k], (params, state))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves((want, want_state))):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_grad_through_an_update_is_refused_clearly():
    tx, rng = mtx.adam(1e-2), np.random.default_rng(5)
    params, grads = _tree(rng), _tree(rng)
    state = tx.init(params)

    def loss_after_update(g):
        updates, _ = tx.update(g, state, params)
        return sum(jnp.sum(u ** 2) for u in jax.tree.leaves(updates))

    with pytest.raises(TypeError, match=r"mtapply.optax.adam: jax.grad .* not supported"):
        jax.grad(loss_after_update)(grads)
    with pytest.raises(TypeError, match="jax.grad .* not supported"):
        jax.grad(lambda lr: jnp.sum(mtx.sgd(lr).update(grads, mtx.sgd(lr).init(params),
                                                        params)[0]["w"]))(0.1)
    # differentiating around the update (the usual train step) is untouched
    value, g = jax.value_and_grad(lambda p: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p)))(
        params)
    tx.update(g, state, params)


# ---------------------------------------------------------------------------------------------
# State dtypes


DTYPED = {  # name -> (ours, optax's, the state field of the chosen dtype, option)
    "adam": (mtx.adam, optax.adam, "mu", "mu_dtype"),
    "adamw": (mtx.adamw, optax.adamw, "mu", "mu_dtype"),
    "sgd": (lambda lr, **kw: mtx.sgd(lr, momentum=0.9, **kw),
            lambda lr, **kw: optax.sgd(lr, momentum=0.9, **kw), "trace", "accumulator_dtype"),
    "lion": (mtx.lion, optax.lion, "exp_avg", "mu_dtype"),
    "schedule_free_adamw": (mtx.schedule_free_adamw, optax.contrib.schedule_free_adamw, "z",
                            "state_dtype"),
}


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "tree"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name", list(DTYPED))
def test_state_dtype_options_follow_optax_and_stay_across_updates(name, dtype, flat):
    ours, theirs, field, option = DTYPED[name]
    rng = np.random.default_rng(6)
    params, grads_seq = _tree(rng), [_tree(rng, 0.3) for _ in range(5)]
    tx = ours(1e-2, **{option: dtype}, flat_state=flat)
    state = tx.init(params)
    tree = mtx.tree_state(state, params)
    slot = getattr(tree, field)
    assert {x.dtype for x in jax.tree.leaves(slot)} == {jnp.dtype(dtype)}

    @jax.jit
    def run(params, state):  # a scan carries the state: its dtypes must not change
        def body(carry, grads):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None
        return jax.lax.scan(body, (params, state), jax.tree.map(lambda *x: jnp.stack(x),
                                                                 *grads_seq))[0]

    got, got_state = run(params, state)
    assert jax.tree.map(lambda x: x.dtype, got_state) == jax.tree.map(lambda x: x.dtype, state)
    want, want_state = _steps(theirs(1e-2, **{option: dtype}), params, grads_seq)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tolerance, atol=tolerance)
    theirs_slot = optax.tree_utils.tree_get(want_state, field)
    for x, y in zip(jax.tree.leaves(getattr(mtx.tree_state(got_state, params), field)),
                    jax.tree.leaves(theirs_slot)):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "tree"])
@pytest.mark.parametrize("name", list(DTYPED))
def test_16_bit_params_with_float32_state_get_optaxs_updates_dtype(name, flat):
    """bfloat16 params with a float32 state slot: the updates take the dtype optax's do (the
    promotion of both, float32), not the params', and their values optax's."""
    ours, theirs, field, option = DTYPED[name]
    rng = np.random.default_rng(8)
    params, grads_seq = _tree(rng, dtype=jnp.bfloat16), [_tree(rng, 0.3, jnp.bfloat16)
                                                         for _ in range(3)]
    empty = jnp.zeros((0, 3), jnp.bfloat16)  # a leaf without elements: its update's dtype too
    params, grads_seq = {**params, "empty": empty}, [{**g, "empty": empty} for g in grads_seq]
    txs = ours(1e-2, **{option: "float32"}, flat_state=flat), theirs(1e-2, **{option: "float32"})
    states = [tx.init(params) for tx in txs]
    for grads in grads_seq:
        got, want = ((tx.update(grads, state, params)) for tx, state in zip(txs, states))
        (got, states[0]), (want, states[1]) = got, want
        assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       rtol=2e-2, atol=1e-4)
        params = optax.apply_updates(params, want)


def test_mu_dtype_with_params_of_two_dtypes_converts_both_ways():
    rng = np.random.default_rng(7)
    params = {"a": jnp.asarray(rng.standard_normal(5), jnp.float32),
              "h": jnp.asarray(rng.standard_normal(3), jnp.float16)}
    tx = mtx.adam(1e-2, mu_dtype=jnp.bfloat16)
    _, state = _steps(tx, params, [params, params])
    assert set(state.mu) == {"bfloat16"} and set(state.nu) == {"float32", "float16"}
    tree = mtx.tree_state(state, params)
    assert tree.mu["a"].dtype == tree.mu["h"].dtype == jnp.bfloat16
    assert tree.nu["h"].dtype == jnp.float16
    _assert_trees_equal(mtx.flat_state(tree, params), state)


# ---------------------------------------------------------------------------------------------
# Pickling


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "tree"])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_states_pickle_and_continue(name, flat):
    tx, rng = FACTORIES[name](flat_state=flat), np.random.default_rng(8)
    params, grads = _tree(rng), _tree(rng)
    state = tx.update(grads, tx.init(params), params)[1]
    copied = pickle.loads(pickle.dumps(state))
    assert type(copied) is type(state)
    _assert_trees_equal(copied, state)
    _assert_trees_equal(tx.update(grads, copied, params), tx.update(grads, state, params))


# ---------------------------------------------------------------------------------------------
# Params the kernels cannot step


@pytest.mark.parametrize("leaf,kind", [(1, "int32"), (jnp.arange(3), "int32"),
                                       (jnp.ones(2, jnp.complex64), "complex64")])
def test_integer_and_complex_params_are_refused_naming_the_leaf(leaf, kind):
    params = {"ok": jnp.ones(3), "bad": leaf}
    for tx in (mtx.adam(1e-2), mtx.lion(1e-3), mtx.sgd(0.1, flat_state=False)):
        with pytest.raises(TypeError, match=rf"params\['bad'\] has dtype {kind}"):
            tx.init(params)
        with pytest.raises(TypeError, match=rf"params\['bad'\] has dtype {kind}"):
            tx.update(params, tx.init({"ok": jnp.ones(3), "bad": jnp.ones(np.shape(leaf))}),
                      params)


# ---------------------------------------------------------------------------------------------
# float64 (jax_enable_x64, in a fresh interpreter)

X64 = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, optax
import mtapply.optax as mtx
rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.standard_normal((5, 3))), "b": jnp.asarray(rng.standard_normal(3))}
grads = {"w": jnp.asarray(rng.standard_normal((5, 3))), "b": jnp.asarray(rng.standard_normal(3))}
assert params["w"].dtype == jnp.float64
import mtapply
from mtapply.rules import library as L
adamw_chain = mtapply.chain(L.scale_by_adam(), L.add_decayed_weights(0.1), L.scale_by_learning_rate())
for ours, theirs in ((mtx.sgd(1 / 3, momentum=0.9), optax.sgd(1 / 3, momentum=0.9)),
                     (mtx.adam(1 / 3), optax.adam(1 / 3)),
                     (mtx.transformation(adamw_chain, 1 / 3),
                      optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1),
                                  optax.scale_by_learning_rate(1 / 3))),
                     (mtx.adam(1 / 3, b1=jnp.asarray(0.9)), optax.adam(1 / 3))):
    a, b = ours.init(params), theirs.init(params)
    for _ in range(3):
        u, a = ours.update(grads, a, params)
        v, b = theirs.update(grads, b, params)
        for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
            assert x.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-14, atol=1e-15)
# RAdam past its threshold (rho_t > 5 from the sixth step), and NAdam
for ours, theirs in ((mtx.radam(1 / 3), optax.radam(1 / 3)),
                     (mtx.radam(1 / 3, eps_root=1e-8, nesterov=True),
                      optax.radam(1 / 3, eps_root=1e-8, nesterov=True)),
                     (mtx.nadam(1 / 3), optax.nadam(1 / 3))):
    a, b = ours.init(params), theirs.init(params)
    for _ in range(9):
        u, a = ours.update(grads, a, params)
        v, b = theirs.update(grads, b, params)
        for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
            # rho_t is a difference of numbers near 2 / (1 - b2): its rounding is amplified
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-9, atol=1e-14)
# the step count past 2**24 (float32 counts no further), b2 close to 1
tx, ref = mtx.adam(1e-3, b2=1 - 1e-8), optax.adam(1e-3, b2=1 - 1e-8)
state = ref.init(params)
state = (state[0]._replace(count=jnp.asarray(2 ** 24 + 2, jnp.int32)),) + tuple(state[1:])
u = tx.update(grads, mtx.flat_state(tx.init(params)._replace(count=state[0].count,
              mu=state[0].mu, nu=state[0].nu), params), params)[0]
v = ref.update(grads, state, params)[0]
for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12)
print("ok")
"""


def test_float64_steps_use_float64_scalars():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", X64], env=env, timeout=600, capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
