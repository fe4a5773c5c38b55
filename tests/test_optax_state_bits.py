"""8-bit state in mtapply.optax: a rule made with `with_state_bits(8)` as a transformation and
a fused form steps as the rule's own functional 8-bit step does (codes and block scales equal,
params to float32 rounding), on the CPU and on a GPU (the XLA FFI call); its state is a tree
of uint8 codes (float32 for small params) beside `<slot>_absmax` scales, made at the declared
first values; it goes through jit, optax.chain and pickle; a slot that starts as the params is
refused."""
import pickle

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply  # noqa: E402
import mtapply.optax as mtx  # noqa: E402
from mtapply.rules import library  # noqa: E402

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
SHAPES = {"w": (300, 20), "b": (7,), "e": (0,), "v": (256 * 20 + 7,)}  # 8-bit: w and v
RULES = {"lion": lambda: library.lion().with_state_bits(8),
         "adam": lambda: library.adam(decoupled_weight_decay=True).with_state_bits(
             8, unsigned="exp_avg_sq"),
         "adan": lambda: library.adan().with_state_bits(8, unsigned="n")}


def _tree(rng, device):
    return jax.device_put({k: jnp.asarray(rng.standard_normal(s), jnp.float32)
                           for k, s in SHAPES.items()}, jax.devices(device)[0])


def _functional(eight, params, grads_seq, hyper):
    """The rule's own 8-bit step on NumPy copies: (params, state lists) after every step."""
    names = sorted(params)
    mine = [np.array(params[k]) for k in names]
    state = eight.state(mine)
    for t, grads in enumerate(grads_seq, start=1):
        counted = dict(step=t) if eight.program.uses_step else {}
        eight.step(mine, [np.array(grads[k]) for k in names], *state, **hyper, **counted)
    return dict(zip(names, mine)), dict(zip(eight.slots[2:], state)), names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["transformation", "fused"])
@pytest.mark.parametrize("name", sorted(RULES))
def test_8_bit_rule_steps_as_its_functional_step(name, form, device):
    eight = RULES[name]()
    rng = np.random.default_rng(0)
    params = _tree(rng, device)
    grads_seq = [_tree(rng, device) for _ in range(4)]
    hyper = dict(weight_decay=0.1)
    if form == "transformation":
        tx = mtx.transformation(eight, 1e-2, **hyper)

        @jax.jit
        def step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s
    else:
        tx = mtx.fused(eight, 1e-2, **hyper)
        step = jax.jit(lambda p, s, g: tx.step(p, g, s))
    state = tx.init(params)
    mine = params
    for grads in grads_seq:
        mine, state = step(mine, state, grads)
    want, lists, names = _functional(eight, params, grads_seq, dict(hyper, lr=1e-2))
    for k in names:
        np.testing.assert_allclose(np.asarray(mine[k]), want[k], rtol=1e-6, atol=1e-6)
    for field, values in lists.items():
        for i, k in enumerate(names):
            got, expected = np.asarray(getattr(state, field)[k]), values[i]
            assert got.dtype == expected.dtype and got.shape == expected.shape, (field, k)
            if got.dtype == np.uint8:  # codes: equal, but for values on a rounding boundary
                assert np.mean(got != expected) < 1e-3, (field, k)
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)



def test_state_is_codes_and_scales_at_the_declared_first_values():
    rule = mtapply.rule("decaying", slots="param:rw grad:r acc:rw=0.5",
                        hyper=dict(lr=None, rho=0.9),
                        update="""
                            acc = rho * acc + (1 - rho) * grad * grad
                            param = param - lr * grad / sqrt(acc + 1e-8)
                        """).with_state_bits(8, unsigned="acc")
    params = _tree(np.random.default_rng(1), "cpu")
    state = mtx.transformation(rule, 1e-2).init(params)
    assert state._fields == ("count", "acc", "acc_absmax")
    for k, shape in SHAPES.items():
        codes, scales = np.asarray(state.acc[k]), np.asarray(state.acc_absmax[k])
        if np.prod(shape) >= 4096:
            assert codes.dtype == np.uint8 and codes.shape == shape
            assert scales.shape == (-(-int(np.prod(shape)) // 256),)
            values = mtapply.quantization.dequantize_blockwise(codes.reshape(-1), scales,
                                                               signed=False)
            np.testing.assert_allclose(values, 0.5, rtol=1e-7)
        else:  # small params keep float32 state, without scales
            assert codes.dtype == np.float32 and np.all(codes == 0.5) and scales.shape == (0,)


def test_a_chain_in_jit_and_a_pickled_state():
    eight = RULES["lion"]()
    rng = np.random.default_rng(2)
    params, grads = _tree(rng, "cpu"), _tree(rng, "cpu")
    tx = optax.chain(optax.clip_by_global_norm(1.0), mtx.transformation(eight, 1e-2))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    again = pickle.loads(pickle.dumps(state))
    assert jax.tree.structure(again) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # clipped grads, then Lion's sign step: every update is +-lr (nonzero grads) or 0
    moved = np.abs(np.asarray(updates["w"]))
    assert np.allclose(moved[moved > 0], 1e-2, rtol=1e-5) and moved.max() > 0


def test_a_slot_that_starts_as_the_params_is_refused():
    rule = library.schedule_free_adamw().with_state_bits(8, slots="z")
    with pytest.raises(NotImplementedError, match="'z' starts as a copy of the params"):
        mtx.transformation(rule, 1e-2)


def _steps_of(tx, params, grads_seq):
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    state = tx.init(params)
    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params, state


def test_state_bits_option_is_the_rule_with_state_bits():
    rule = library.adam(decoupled_weight_decay=True)
    rng = np.random.default_rng(3)
    params = _tree(rng, "cpu")
    grads_seq = [_tree(rng, "cpu") for _ in range(3)]
    by_option = _steps_of(mtx.transformation(rule, 1e-2, state_bits=8, unsigned="exp_avg_sq",
                                             min_8bit_size=1000), params, grads_seq)
    by_rule = _steps_of(mtx.transformation(
        rule.with_state_bits(8, unsigned="exp_avg_sq", threshold=1000), 1e-2), params, grads_seq)
    assert by_option[1].exp_avg["b"].dtype == jnp.float32  # 7 elements: float32 state
    assert by_option[1].exp_avg["w"].dtype == jnp.uint8
    for a, b in zip(jax.tree.leaves(by_option), jax.tree.leaves(by_rule), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_16_bit_state_steps_as_float_state_then_rounds_it():
    """The first step (from zero state) moves the params as float32 state does; the new state
    is the float32 one rounded to bfloat16."""
    rule = library.adam(decoupled_weight_decay=True)
    rng = np.random.default_rng(4)
    params = _tree(rng, "cpu")
    grads = [_tree(rng, "cpu")]
    sixteen = _steps_of(mtx.transformation(rule, 1e-2, state_bits=16), params, grads)
    float32 = _steps_of(mtx.transformation(rule, 1e-2), params, grads)
    for a, b in zip(jax.tree.leaves(sixteen[0]), jax.tree.leaves(float32[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    for field in ("exp_avg", "exp_avg_sq"):
        mine, theirs = mtx.tree_state(sixteen[1], params), mtx.tree_state(float32[1], params)
        for k in SHAPES:
            got, want = getattr(mine, field)[k], getattr(theirs, field)[k]
            assert got.dtype == jnp.bfloat16 and want.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(got, np.float32),
                                       np.asarray(want.astype(jnp.bfloat16), np.float32),
                                       rtol=2.0 ** -7, atol=1e-30)


def test_bad_state_bits_options_are_refused():
    with pytest.raises(ValueError, match="state_bits must be 8, 16"):
        mtx.transformation(library.lion(), 1e-2, state_bits=4)
    with pytest.raises(ValueError, match="unsigned and slots .* take state_bits=8"):
        mtx.fused(library.adam(), 1e-2, unsigned="exp_avg_sq")
    with pytest.raises(ValueError, match="already keeps 8-bit state"):
        mtx.transformation(RULES["lion"](), 1e-2, state_bits=8)


def test_bfloat16_params_and_the_state_conversions():
    """bfloat16 params step through the 8-bit walk's updates (delta) as the functional step;
    tree_state and flat_state leave an 8-bit state as it is (its fields' shapes are their own);
    slots= keeps the others in float32; a bad min_8bit_size is refused."""
    eight = RULES["adam"]()
    rng = np.random.default_rng(6)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(rng, "cpu"))
    grads_seq = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(rng, "cpu"))
                 for _ in range(2)]
    tx = mtx.transformation(eight, 1e-2, weight_decay=0.1)
    mine, state = _steps_of(tx, params, grads_seq)
    torch = pytest.importorskip("torch")  # (bfloat16 lists on the host: NumPy has none)
    names = sorted(params)

    def bf16(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)

    want = [bf16(params[k]) for k in names]
    lists = eight.state(want)
    for t, grads in enumerate(grads_seq, start=1):
        eight.step(want, [bf16(grads[k]) for k in names], *lists, lr=1e-2, weight_decay=0.1,
                   step=t)
    # optax's contract rounds twice in bfloat16: the update (new - old, some lr = 1e-2 in size:
    # a unit of it is 6e-5) and params + update; the in-place step rounds once. Per step and
    # element that is a unit of the param (2**-8 of it, relative) and one of the update.
    for k, w in zip(names, want):
        np.testing.assert_allclose(np.asarray(mine[k], np.float32), w.float().numpy(),
                                   rtol=2.0 ** -6, atol=1.5e-4)
    for convert in (mtx.tree_state, mtx.flat_state):
        converted = convert(state, params)
        for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(state), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
    partly = mtx.transformation(library.adam(), 1e-2, state_bits=8, slots="exp_avg").init(params)
    assert partly.exp_avg["w"].dtype == jnp.uint8  # and the other slot as the params (bf16)
    assert partly.exp_avg_sq["w"].dtype == params["w"].dtype
    with pytest.raises(ValueError, match="min_8bit_size"):
        mtx.fused(library.lion(), 1e-2, state_bits=8, min_8bit_size=0)


# optax's own constructors with state_bits: (mtapply's, optax's, arguments besides the lr)
NAMED = {"adam": (mtx.adam, optax.adam, {}),
         "adamw": (mtx.adamw, optax.adamw, dict(weight_decay=0.1)),
         "nadam": (mtx.nadam, optax.nadam, {}),
         "sgd": (mtx.sgd, optax.sgd, dict(momentum=0.9, nesterov=True)),
         "lion": (mtx.lion, optax.lion, {}),
         "adan": (mtx.adan, optax.adan, {}),
         "adamax": (mtx.adamax, optax.adamax, {}),
         "radam": (mtx.radam, optax.radam, {}),
         "adadelta": (mtx.adadelta, optax.adadelta, {}),
         "adagrad": (mtx.adagrad, optax.adagrad, {}),
         "rmsprop": (mtx.rmsprop, optax.rmsprop, dict(centered=True, momentum=0.5)),
         "lars": (mtx.lars, optax.lars, {}),
         "lamb": (mtx.lamb, optax.lamb, dict(weight_decay=0.01))}
NAMED_FUSED = {"adam": mtx.fused_adam, "adamw": mtx.fused_adamw, "nadam": mtx.fused_nadam,
               "sgd": mtx.fused_sgd, "lion": mtx.fused_lion, "adan": mtx.fused_adan,
               "adamax": mtx.fused_adamax, "radam": mtx.fused_radam,
               "adadelta": mtx.fused_adadelta, "adagrad": mtx.fused_adagrad,
               "rmsprop": mtx.fused_rmsprop, "lars": mtx.fused_lars, "lamb": mtx.fused_lamb}
# the state fields that never go negative: kept on the unsigned map of values >= 0
NAMED_UNSIGNED = {"adam": "exp_avg_sq", "adamw": "exp_avg_sq", "nadam": "exp_avg_sq",
                  "adan": "n", "adamax": "nu", "radam": "nu", "adadelta": "e_x",
                  "adagrad": "sum_of_squares", "rmsprop": "nu", "lamb": "exp_avg_sq"}


def _named_run(tx, params, grads_seq, fused=False):
    if fused:
        step = jax.jit(lambda p, s, g: tx.step(p, g, s))
        state = tx.init(params)
        for grads in grads_seq:
            params, state = step(params, state, grads)
        return params, state
    return _steps_of(tx, params, grads_seq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("name", sorted(NAMED))
def test_optax_named_constructors_take_state_bits_and_track_optax(name, bits, device):
    """`mtapply.optax.<name>(..., state_bits=8|16)` and its fused form step alike and follow
    optax's own transformation to the precision of the state: the median element's step within
    2% (8 bits) or 0.3% (bfloat16) of optax's, few elements far off."""
    ours, theirs, kw = NAMED[name]
    lr = 1.0 if name == "adadelta" else 1e-2
    rng = np.random.default_rng(7)
    params = _tree(rng, device)
    grads_seq = [_tree(rng, device) for _ in range(4)]
    mine, state = _named_run(ours(lr, **kw, state_bits=bits), params, grads_seq)
    fused, _ = _named_run(NAMED_FUSED[name](lr, **kw, state_bits=bits), params, grads_seq,
                          fused=True)
    want, _ = _steps_of(theirs(lr, **kw), params, grads_seq)
    median, far = (0.02, 0.03) if bits == 8 else (0.003, 0.01)
    for k in ("w", "v"):
        start, got, ref = (np.asarray(t[k], np.float64) for t in (params, mine, want))
        np.testing.assert_allclose(np.asarray(fused[k]), got, rtol=1e-6, atol=1e-7)
        relative = np.abs(got - ref) / np.maximum(np.abs(ref - start), 1e-12)
        assert np.median(relative) < median, (k, np.median(relative))
        assert np.mean(relative > 0.5) < far, (k, np.mean(relative > 0.5))
    dtype = np.uint8 if bits == 8 else jnp.bfloat16
    fields = [f for f in state._fields if f != "count" and not f.endswith("_absmax")]
    if bits == 16:
        state = mtx.tree_state(state, params)
    for field in fields:
        assert getattr(state, field)["w"].dtype == dtype, field
        if bits == 8:  # 7 elements: float32, without scales
            assert getattr(state, field)["b"].dtype == np.float32, field
            assert getattr(state, field + "_absmax")["b"].shape == (0,), field


def test_8_bit_adam_is_optaxs_adam_rule_with_its_second_moment_unsigned():
    from mtapply import _optax_rules
    rng = np.random.default_rng(8)
    params = _tree(rng, "cpu")
    grads_seq = [_tree(rng, "cpu") for _ in range(3)]
    mine, state = _steps_of(mtx.adamw(1e-2, weight_decay=0.1, state_bits=8, min_8bit_size=1000),
                            params, grads_seq)
    eight = _optax_rules.adam().with_state_bits(8, unsigned="exp_avg_sq", threshold=1000)
    want, lists, names = _functional(eight, params, grads_seq, dict(lr=1e-2, weight_decay=0.1))
    for k in names:
        np.testing.assert_allclose(np.asarray(mine[k]), want[k], rtol=1e-6, atol=1e-6)
    for i, k in enumerate(names):
        got, expected = np.asarray(state.exp_avg_sq[k]), lists["exp_avg_sq"][i]
        assert got.dtype == expected.dtype
        assert got.size == 0 or np.mean(got != expected) < 1e-3, k


@pytest.mark.parametrize("name", sorted(NAMED_UNSIGNED))
def test_8_bit_second_moments_use_the_unsigned_map(name):
    """Every code of a never-negative slot decodes to a value >= 0 (the unsigned map), and a
    signed slot beside it takes negative values."""
    ours, _, kw = NAMED[name]
    rng = np.random.default_rng(9)
    params = _tree(rng, "cpu")
    _, state = _steps_of(ours(1e-2, **kw, state_bits=8), params, [_tree(rng, "cpu")] * 2)
    field = NAMED_UNSIGNED[name]
    codes = np.asarray(getattr(state, field)["w"]).reshape(-1)
    scales = np.asarray(getattr(state, field + "_absmax")["w"])
    values = mtapply.quantization.dequantize_blockwise(codes, scales, signed=False)
    assert values.min() >= 0 and values.max() > 0
    signed = mtapply.quantization.dequantize_blockwise(codes, scales, signed=True)
    assert signed.min() < 0  # (the same codes on the signed map: it was not that one)


def _masked(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


# lars's and lamb's masks (a leaf out of one steps in a call of its own) and lamb's clip by the
# grads' global norm, which their rules take as arguments
MASKED = {"lars": (mtx.lars, dict(weight_decay=1e-3, weight_decay_mask=_masked,
                                  trust_ratio_mask=_masked)),
          # (an eps near the clipped grads' size, so that the clip changes the direction)
          "lamb": (mtx.lamb, dict(weight_decay=0.01, mask=_masked, max_grad_norm=1.0, eps=0.1))}


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("name", sorted(MASKED))
def test_lars_and_lamb_keep_their_masks_and_clip_with_state_bits(name, bits):
    """With state_bits, lars's and lamb's masks and lamb's max_grad_norm step as they do in
    float32: every leaf within the state's precision of the float32 state's step, and far from
    the step without them (so that a mask or clip left out would show)."""
    ours, kw = MASKED[name]
    rng = np.random.default_rng(11)
    params = _tree(rng, "cpu")
    grads_seq = [_tree(rng, "cpu") for _ in range(4)]
    want, _ = _steps_of(ours(1e-2, **kw), params, grads_seq)
    got, _ = _steps_of(ours(1e-2, **kw, state_bits=bits, min_8bit_size=1), params, grads_seq)
    plain = {k: v for k, v in kw.items() if k in ("weight_decay", "eps")}
    without, _ = _steps_of(ours(1e-2, **plain, state_bits=bits, min_8bit_size=1), params,
                           grads_seq)
    median = 0.02 if bits == 8 else 0.003
    for k in ("w", "b", "v"):
        start = np.asarray(params[k], np.float64)
        step = np.asarray(want[k], np.float64) - start
        size = np.maximum(np.abs(step), 1e-12)
        relative = np.abs(np.asarray(got[k], np.float64) - start - step) / size
        assert np.median(relative) < median, (k, np.median(relative))
        apart = np.abs(np.asarray(without[k], np.float64) - start - step) / size
        if k == "b" or name == "lamb":  # (lars's masks leave the matrices and v alone)
            assert np.median(apart) > 0.1, (k, np.median(apart))


def test_state_bits_on_named_constructors_refuse_what_they_cannot_keep():
    with pytest.raises(NotImplementedError, match="mu_dtype"):
        mtx.adam(1e-3, mu_dtype=jnp.bfloat16, state_bits=8)
    with pytest.raises(NotImplementedError, match="mask"):
        mtx.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), state_bits=8)
    with pytest.raises(ValueError, match="sgd without momentum keeps no state"):
        mtx.sgd(1e-3, state_bits=8)
    with pytest.raises(ValueError, match="state_bits and mu_dtype"):
        mtx.lion(1e-3, mu_dtype=jnp.bfloat16, state_bits=16)
    with pytest.raises(ValueError, match="state_bits must be 8, 16"):
        mtx.fused_adagrad(1e-3, state_bits=4)
    with pytest.raises(ValueError, match="min_8bit_size"):
        mtx.adam(1e-3, state_bits=8, min_8bit_size=0)
    with pytest.raises(NotImplementedError, match="'nu' starts as an array"):
        mtx.rmsprop(1e-3, initial_scale=jnp.asarray(0.5), state_bits=8)
    assert mtx.adam(1e-3, state_bits=32).init({"w": jnp.ones(3)}).mu["w"].dtype == jnp.float32


def test_8_bit_adagrad_starts_at_its_initial_accumulator_value():
    params = _tree(np.random.default_rng(10), "cpu")
    state = mtx.adagrad(1e-2, initial_accumulator_value=0.25, state_bits=8).init(params)
    codes = np.asarray(state.sum_of_squares["w"]).reshape(-1)
    values = mtapply.quantization.dequantize_blockwise(
        codes, np.asarray(state.sum_of_squares_absmax["w"]), signed=False)
    np.testing.assert_allclose(values, 0.25, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(state.sum_of_squares["b"]), 0.25)


def test_state_bits_through_inject_hyperparams():
    """Its defaults (None) stay out of the injected state; a number given must be static (an
    array cannot choose the state's layout), and then steps as the plain constructor."""
    params = _tree(np.random.default_rng(11), "cpu")
    grads = [_tree(np.random.default_rng(12), "cpu")]
    plain = _steps_of(mtx.adam(1e-2, state_bits=8), params, grads)[0]
    with pytest.raises(TypeError, match=r"static_args=\('state_bits',\)"):
        optax.inject_hyperparams(mtx.adam)(learning_rate=1e-2, state_bits=8).init(params)
    injected = optax.inject_hyperparams(mtx.adam, static_args=("state_bits",))(
        learning_rate=1e-2, state_bits=8)
    assert "state_bits" not in injected.init(params).hyperparams
    for a, b in zip(jax.tree.leaves(_steps_of(injected, params, grads)[0]), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
