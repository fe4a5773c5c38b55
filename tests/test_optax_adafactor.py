"""mtapply.optax.adafactor against optax.adafactor: params and state over 50 steps (float32
here, float64 under jax_enable_x64 in a fresh interpreter), jitted and eager, for option sets
and shapes that factor (largest dimensions last or not) and that do not (1-D, 0-D, dimensions
below min_dim_size_to_factor, factored=False), with weight-decay masks (trees and callables,
20 steps in float32); the state's layout (optax's own) and what is refused, a GPU step among
it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

STEPS = 50
CPU = jax.devices("cpu")[0]
# factored by default: "matrix" (rows > cols), "wide" (cols > rows), "stack" (3-D, its largest
# dimensions first and last), "first" (3-D, largest first); not: "small" (below 128), "bias",
# "scalar"
SHAPES = {"matrix": (160, 130), "wide": (128, 200), "stack": (140, 3, 129),
          "first": (300, 130, 2), "small": (6, 40), "bias": (7,), "scalar": ()}

CASES = [
    {},
    dict(learning_rate=0.01),
    dict(learning_rate=optax.linear_schedule(0.02, 0.001, STEPS), momentum=0.9,
         weight_decay_rate=0.01),
    dict(learning_rate=0.05, multiply_by_parameter_scale=False, clipping_threshold=None,
         decay_rate=0.7, decay_offset=-3, eps=1e-20),
    dict(learning_rate=0.01, min_dim_size_to_factor=4, momentum=0.5, dtype_momentum=None),
    dict(learning_rate=0.01, factored=False, clipping_threshold=0.5),
]
IDS = ["defaults", "lr", "schedule-momentum-wd", "no-scale-no-clip-decay", "min-dim-4",
       "unfactored"]
MASKS = [
    {"matrix": True, "wide": False, "stack": False, "first": True, "small": False,
     "bias": False, "scalar": True},
    lambda p: jax.tree.map(lambda x: x.ndim > 1 and x.shape[0] >= 140, p),  # reads shapes
    lambda p: jax.tree.map(lambda x: False, p),
]


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return jax.device_put({k: jnp.asarray(rng.standard_normal(s), dtype)
                           for k, s in SHAPES.items()}, CPU)


def _grads(params, step: int):
    """Noisy grads of a quadratic pulling the params towards zero."""
    rng = np.random.default_rng(step + 1)
    return jax.device_put({k: p + jnp.asarray(rng.standard_normal(p.shape), p.dtype)
                           for k, p in params.items()}, CPU)


def _run(tx, params, jit=True, steps=STEPS):
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    for step in range(steps):
        updates, state = update(_grads(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _close(got, want, rtol, atol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, g, w in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path[0])
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path[0]))


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_follows_optax_adafactor(options):
    params = _params()
    want, want_state = _run(optax.adafactor(**options), params)
    got, state = _run(mtx.adafactor(**options), params)
    _close(got, want, 1e-5, 1e-6)
    _close(state, want_state, 1e-5, 1e-6)  # optax's layout: v_row, v_col, v, ema, counts


def _run_fused(opt, params, steps, donated=True):
    step = opt.donated_step if donated else opt.step
    params = jax.tree.map(jnp.copy, params)  # donated below
    state = opt.init(params)
    for k in range(steps):
        params, state = step(params, _grads(params, k), state)
    return params, state


@pytest.mark.parametrize("options", [
    dict(learning_rate=0.01),
    dict(learning_rate=optax.linear_schedule(0.02, 0.001, 20), momentum=0.9,
         weight_decay_rate=0.01, weight_decay_mask=MASKS[1]),
    dict(learning_rate=0.05, multiply_by_parameter_scale=False, clipping_threshold=None,
         min_dim_size_to_factor=4),
], ids=["lr", "schedule-momentum-masked-wd", "no-scale-no-clip-min-dim-4"])
def test_fused_adafactor_follows_optax_over_20_steps(options):
    params = _params()
    want, want_state = _run(optax.adafactor(**options), params, steps=20)
    opt = mtx.fused_adafactor(**options)
    got, state = _run_fused(opt, params, steps=20)
    _close(got, want, 1e-5, 1e-6)
    _close(opt.tree_state(state, got), want_state, 1e-5, 1e-6)  # optax's state, its values
    undonated, _ = _run_fused(opt, params, steps=3, donated=False)
    jitted, _ = _run_fused(opt, params, steps=3)
    _close(undonated, jitted, 0.0, 0.0)


def test_fused_adafactor_keeps_each_slot_in_one_buffer_per_dtype():
    """The fused form's state: the rule's count and slots, each a dict of one buffer per dtype
    (a few arrays for any number of params), which optax's state converts to and from."""
    params = {**_params(), "half": jnp.ones((130, 140), jnp.bfloat16)}
    opt = mtx.fused_adafactor(learning_rate=0.01, momentum=0.9)
    state = opt.init(params)
    assert state._fields == ("count", "row_var", "col_var", "variance", "ema")
    assert len(jax.tree.leaves(state)) == 8  # the count, three slots of two dtypes, the ema
    for field in ("row_var", "col_var", "variance"):  # the params' dtypes
        assert set(getattr(state, field)) == {"float32", "bfloat16"}
        assert all(x.ndim == 1 for x in getattr(state, field).values())
    assert set(state.ema) == {"float32"}  # dtype_momentum's
    # each param's rows and columns (two largest dimensions last), or its full variance, each
    # at a 16-byte offset: 130 rows take 136 bfloat16s
    assert state.row_var["bfloat16"].size == 136 and state.col_var["bfloat16"].size == 144
    assert state.variance["bfloat16"].size == 1  # factored: none (one element, never read)
    # optax's state converts to the flat one and back, values and counts kept
    tx = optax.adafactor(learning_rate=0.01, momentum=0.9)
    _, optax_state = _run(tx, _params(), steps=3)
    params = _params()
    flat = opt.flat_state(optax_state, params)
    assert int(flat.count) == 3 and len(jax.tree.leaves(flat)) == 5
    _close(opt.tree_state(flat, params), optax_state, 0.0, 0.0)
    # a step from the converted state is optax's step from its own
    want, _ = optax.adafactor(learning_rate=0.01, momentum=0.9).update(
        _grads(params, 3), optax_state, params)
    got, _ = opt.step(params, _grads(params, 3), flat)
    _close(got, optax.apply_updates(params, want), 1e-5, 1e-6)
    with pytest.raises(ValueError, match="flat_state"):
        opt.step(params, _grads(params, 3), optax_state)
    with pytest.raises(ValueError, match="own tree_state"):  # the module's: params-shaped slots
        mtx.tree_state(flat, params)
    # a state of other options is refused before anything is made of it
    with pytest.raises(ValueError, match="min_dim_size_to_factor must match"):
        opt.flat_state(optax.adafactor(0.01, min_dim_size_to_factor=4, momentum=0.9).init(
            params), params)
    with pytest.raises(ValueError, match="momentum, weight_decay_rate"):
        opt.flat_state(optax.adafactor(0.01).init(params), params)


@pytest.mark.parametrize("options", CASES[1:4], ids=IDS[1:4])
def test_the_transformation_with_flat_state_follows_optax(options):
    """adafactor(flat_state=True): the updates optax's, the state fused_adafactor's (a few
    buffers), whose optax form holds optax's values."""
    params = _params()
    want, want_state = _run(optax.adafactor(**options), params, steps=20)
    got, state = _run(mtx.adafactor(**options, flat_state=True), params, steps=20)
    _close(got, want, 1e-5, 1e-6)
    assert len(jax.tree.leaves(state)) == 1 + 3 + ("momentum" in options)
    _close(mtx.fused_adafactor(**options).tree_state(state, got), want_state, 1e-5, 1e-6)


def test_the_transformation_s_flat_state_is_its_own():
    params = _params()
    tx = mtx.adafactor(0.01, flat_state=True)
    optax_state = optax.adafactor(0.01).init(params)
    with pytest.raises(ValueError, match="flat_state=True"):
        tx.update(_grads(params, 0), optax_state, params)
    with pytest.raises(ValueError, match="a fused_adafactor of the same options"):
        mtx.tree_state(tx.init(params), params)
    with pytest.raises(TypeError, match="flat_state must be a bool"):
        mtx.adafactor(0.01, flat_state="yes")
    # 8-bit momentum keeps optax's chain state, flat_state or not
    eight = mtx.adafactor(0.01, momentum=0.9, state_bits=8, flat_state=True).init(params)
    assert any(isinstance(link, mtx.EightBitEmaState) for link in eight)


def test_fused_adafactor_of_one_param_keeps_its_slots_as_a_tree():
    params = {"matrix": _params()["matrix"]}
    opt = mtx.fused_adafactor(learning_rate=0.01)
    got, state = _run_fused(opt, params, steps=5)
    want, want_state = _run(optax.adafactor(learning_rate=0.01), params, steps=5)
    assert state.row_var["matrix"].size == 160 and state.variance["matrix"].size == 0
    _close(got, want, 1e-5, 1e-6)
    _close(opt.tree_state(state, got), want_state, 1e-5, 1e-6)


def _copies(compiled_text: str) -> list:
    """The copies (copy instructions and copy fusions) of a compiled module's entry that move
    at least one element."""
    entry = compiled_text[compiled_text.index("\nENTRY"):]
    return [line.strip() for line in entry.splitlines()
            if re.search(r"%[\w.\-]*copy[\w.\-]* = \w+\[[1-9][0-9,]*\]", line)]


def test_the_donated_step_copies_no_factored_vector():
    """optax's row and column vectors of a matrix go into the aliased call as they are: XLA
    would copy a donated vector reshaped on its way in, and again on its way out."""
    params = {k: _params()[k] for k in ("matrix", "wide", "small", "bias")}
    opt = mtx.fused_adafactor(learning_rate=0.01)
    state = opt.init(params)
    text = opt.donated_step.lower(params, _grads(params, 0), state).compile().as_text()
    assert _copies(text) == []
    assert "custom-call" in text or "custom_call" in text  # the step's one call


def test_eager_steps_as_jitted():
    params = _params()
    tx = mtx.adafactor(learning_rate=0.01, momentum=0.9)
    jitted, _ = _run(tx, params, steps=5)
    eager, _ = _run(tx, params, jit=False, steps=5)
    _close(eager, jitted, 0.0, 0.0)


def test_in_a_chain_with_inject_hyperparams():
    params = _params()
    options = dict(learning_rate=0.01, decay_rate=0.9, weight_decay_rate=0.01)
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(**options))
    want, _ = _run(theirs, params, steps=10)
    static = ("min_dim_size_to_factor", "factored", "multiply_by_parameter_scale",
              "dtype_momentum")  # shapes and types, not numbers
    ours = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(
        mtx.adafactor, static_args=static)(**options))
    got, _ = _run(ours, params, steps=10)
    _close(got, want, 1e-5, 1e-6)


@pytest.mark.parametrize("mask", MASKS, ids=["tree", "callable-of-shapes", "none-decays"])
@pytest.mark.parametrize("options", [dict(learning_rate=0.01, weight_decay_rate=0.1),
                                     dict(learning_rate=0.01, momentum=0.9,
                                          weight_decay_rate=jnp.asarray(0.05))],
                         ids=["wd", "array-wd-momentum"])
def test_weight_decay_mask_follows_optax_over_20_steps(mask, options):
    params = _params()
    want, want_state = _run(optax.adafactor(**options, weight_decay_mask=mask), params, steps=20)
    got, state = _run(mtx.adafactor(**options, weight_decay_mask=mask), params, steps=20)
    _close(got, want, 1e-5, 1e-6)
    _close(state, want_state, 1e-5, 1e-6)
    unmasked, _ = _run(mtx.adafactor(**options), params, steps=20)
    assert not np.allclose(got["bias"], unmasked["bias"])  # the mask did leave it out


def test_weight_decay_mask_without_weight_decay_is_ignored_as_optax_does():
    params = _params()
    want, _ = _run(optax.adafactor(0.01, weight_decay_mask=MASKS[0]), params, steps=3)
    got, _ = _run(mtx.adafactor(0.01, weight_decay_mask=MASKS[0]), params, steps=3)
    _close(got, want, 1e-5, 1e-6)


def test_state_is_optax_state():
    params = _params()
    for options in CASES:
        ours, theirs = (tx(**options).init(params) for tx in (mtx.adafactor, optax.adafactor))
        assert jax.tree.structure(ours) == jax.tree.structure(theirs)


def test_refusals():
    with pytest.raises(TypeError, match="min_dim_size_to_factor must be a Python int"):
        mtx.adafactor(min_dim_size_to_factor=jnp.asarray(128))
    with pytest.raises(TypeError, match="factored must be a bool"):
        mtx.adafactor(factored=jnp.asarray(True))
    with pytest.raises(TypeError, match="decay_rate must be a number"):
        mtx.adafactor(decay_rate=optax.constant_schedule(0.8))
    with pytest.raises(NotImplementedError, match="dtype_momentum=int32"):
        mtx.adafactor(momentum=0.9, dtype_momentum=jnp.int32)
    with pytest.raises(ValueError, match="clipping_threshold"):
        mtx.adafactor(clipping_threshold=0.0)
    params = _params()
    tx = mtx.adafactor(weight_decay_rate=0.1,
                       weight_decay_mask=lambda p: jax.tree.map(lambda x: 1, p))
    with pytest.raises(TypeError, match="weight_decay_mask must hold Python bools"):
        tx.update(_grads(params, 0), tx.init(params), params)
    tx = mtx.adafactor()
    with pytest.raises(ValueError, match="reads the params"):
        tx.update(_grads(params, 0), tx.init(params))


def test_8_bit_momentum_follows_optax_to_the_precision_of_its_state():
    """state_bits=8: the momentum's codes beside optax's factored moments; the transformation
    and the fused step alike, each element's movement within a few percent of optax's."""
    params = _params()
    options = dict(learning_rate=0.01, momentum=0.9, weight_decay_rate=0.01)
    mine, state = _run(mtx.adafactor(**options, state_bits=8), params, steps=4)
    want, _ = _run(optax.adafactor(**options), params, steps=4)
    fused = mtx.fused_adafactor(**options, state_bits=8)
    got, fused_state = params, fused.init(params)
    for step in range(4):
        got, fused_state = fused.step(got, _grads(got, step), fused_state)
    _close(got, mine, rtol=1e-6, atol=1e-7)
    for k in ("matrix", "wide", "stack", "first"):
        start, ours, ref = (np.asarray(t[k], np.float64) for t in (params, mine, want))
        relative = np.abs(ours - ref) / np.maximum(np.abs(ref - start), 1e-12)
        assert np.median(relative) < 0.02 and np.mean(relative > 0.5) < 0.03, k
    for k in ("small", "bias", "scalar"):  # float32 momentum: optax's step
        np.testing.assert_allclose(np.asarray(mine[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


def test_8_bit_momentum_state_holds_codes_in_the_rules_layout():
    params = _params()
    state = mtx.adafactor(0.01, momentum=0.9, state_bits=8).init(params)
    assert jax.tree.structure(state[0]) == jax.tree.structure(optax.adafactor(0.01).init(params)[0])
    ema = next(link for link in state if isinstance(link, mtx.EightBitEmaState))
    assert ema.ema["first"].shape == (2, 300, 130)  # its two largest dimensions last
    assert ema.ema["stack"].shape == (3, 140, 129) and ema.ema["matrix"].shape == (160, 130)
    for k in ("matrix", "wide", "stack", "first"):
        assert ema.ema[k].dtype == jnp.uint8
        assert ema.ema_absmax[k].shape == (-(-params[k].size // 256),)
    for k in ("small", "bias", "scalar"):  # under min_8bit_size: float32, no scales
        assert ema.ema[k].dtype == jnp.float32 and ema.ema_absmax[k].shape == (0,)
    small = mtx.adafactor(0.01, momentum=0.9, state_bits=8, min_8bit_size=100).init(params)
    assert next(link for link in small if isinstance(link, mtx.EightBitEmaState)
                ).ema["small"].dtype == jnp.uint8


def test_8_bit_momentum_refusals():
    with pytest.raises(ValueError, match="keeps no momentum without momentum"):
        mtx.adafactor(0.01, state_bits=8)
    with pytest.raises(ValueError, match="state_bits and dtype_momentum both choose"):
        mtx.adafactor(0.01, momentum=0.9, dtype_momentum=jnp.bfloat16, state_bits=8)
    with pytest.raises(ValueError, match="dtype_momentum=jnp.bfloat16"):
        mtx.adafactor(0.01, momentum=0.9, state_bits=16)
    params = _params()
    eight, plain = (mtx.adafactor(0.01, momentum=0.9, state_bits=bits) for bits in (8, None))
    for tx, other in ((eight, plain), (plain, eight)):
        with pytest.raises(ValueError, match="init the state with the same state_bits"):
            tx.update(_grads(params, 0), other.init(params), params)


X64 = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, optax
import mtapply.optax as mtx
shapes = {"matrix": (160, 130), "stack": (140, 3, 129), "small": (6, 40), "bias": (7,)}
cases = [dict(learning_rate=0.01), dict(learning_rate=0.01, momentum=0.9,
         dtype_momentum=jnp.float64, weight_decay_rate=0.01),
         dict(learning_rate=0.05, multiply_by_parameter_scale=False, clipping_threshold=None),
         dict(learning_rate=0.01, weight_decay_rate=0.1,
              weight_decay_mask={"matrix": False, "stack": True, "small": False, "bias": True}),
         dict(learning_rate=0.01, momentum=0.9, dtype_momentum=jnp.float64,
              weight_decay_rate=0.1, weight_decay_mask=lambda p: jax.tree.map(
                  lambda x: x.ndim > 1 and x.shape[0] >= 140, p))]
for options in cases:
    runs = []
    for tx in (mtx.adafactor(**options), optax.adafactor(**options)):
        rng = np.random.default_rng(0)
        params = {k: jnp.asarray(rng.standard_normal(s)) for k, s in shapes.items()}
        state, update = tx.init(params), jax.jit(tx.update)
        for step in range(50):
            rng = np.random.default_rng(step + 1)
            grads = {k: p + rng.standard_normal(p.shape) for k, p in params.items()}
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
        runs.append((params, state))
    for got, want in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-14)
print("ok")
"""


def test_follows_optax_adafactor_in_float64():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", X64], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_schedule_takes_the_count_of_optax_s_schedule_link():
    """optax's learning-rate link keeps its own count (scale_by_schedule's state): where a
    state's counts differ (a restored or edited chain), the schedule reads that one, the
    second-moment decay the factored link's."""
    schedule = optax.linear_schedule(0.05, 0.001, 10)
    params = _params()
    txs = mtx.adafactor(schedule), optax.adafactor(schedule)

    def moved(state):
        return tuple(link._replace(count=jnp.asarray(7, jnp.int32))
                     if isinstance(link, optax.ScaleByScheduleState) else link for link in state)

    results = []
    for tx in txs:
        state = moved(tx.init(params))
        for step in range(2):
            updates, state = tx.update(_grads(params, step), state, params)
        results.append((updates, state))
    _close(*(updates for updates, _ in results), 1e-5, 1e-7)
    _close(*(state for _, state in results), 1e-5, 1e-7)


def test_swapped_in_for_optax_adafactor_it_still_starts_from_optax_s_own_state(monkeypatch):
    """A program may put mtapply's adafactor in optax's place, as a drop-in; its init must not
    then call itself."""
    monkeypatch.setattr(optax, "adafactor", mtx.adafactor)
    params = {"w": jnp.ones((6, 4)), "b": jnp.ones((4,))}
    opt = optax.adafactor(learning_rate=1e-2)
    state = opt.init(params)
    updates, _ = opt.update(params, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


# Up to two dimensions that may reach min_dim_size_to_factor and two small ones, in any order:
# every case of optax's factoring, in at most 300 * 300 * 4 * 4 elements.
_ANY_SHAPE = st.tuples(st.lists(st.integers(1, 300), max_size=2),
                       st.lists(st.integers(1, 4), max_size=2)).flatmap(
    lambda parts: st.permutations(parts[0] + parts[1])).map(tuple)


@given(shape=_ANY_SHAPE, min_dim=st.sampled_from([1, 4, 128, 200]), factored=st.booleans())
@settings(max_examples=25, deadline=None)
def test_the_flat_state_holds_what_optax_state_holds_for_any_shape(shape, min_dim, factored):
    """fused_adafactor's flat slots give each param the room of its rule slots: where optax
    factors it (over its two largest dimensions), a row vector and a column vector over those
    two moved last, elsewhere its full variance (each part of a buffer rounded up to 16 bytes);
    tree_state gives optax's shapes back."""
    from optax._src.factorized import _factored_dims

    params = {"x": jnp.ones(shape, jnp.float32), "y": jnp.ones((3,), jnp.float32)}
    opt = mtx.fused_adafactor(0.01, min_dim_size_to_factor=min_dim, factored=factored)
    rms = jax.eval_shape(optax.adafactor(0.01, min_dim_size_to_factor=min_dim,
                                         factored=factored).init, params)[0]
    dims, total = _factored_dims(shape, factored, min_dim), int(np.prod(shape))
    if dims is None:
        rows, cols, full = 0, 0, total
    else:  # the rule's rows run over the later of the two axes, its columns the earlier
        rows, cols, full = total // shape[max(dims)], total // shape[min(dims)], 0

    def room(*sizes):  # float32 parts at 16-byte offsets, a buffer of at least one element
        return max(sum(-(-n // 4) * 4 for n in sizes), 1)

    state = opt.init(params)
    assert state.row_var["float32"].size == room(rows)
    assert state.col_var["float32"].size == room(cols)
    assert state.variance["float32"].size == room(full, 3)  # y (3 elements) is not factored
    got = opt.tree_state(state, params)[0]
    for name in ("v_row", "v_col", "v"):
        assert jax.tree.map(jnp.shape, getattr(got, name)) == jax.tree.map(
            lambda x: x.shape, getattr(rms, name))
