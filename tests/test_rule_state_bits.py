"""Rules with 8-bit state (`Rule.with_state_bits`) on the CPU: the NumPy path against 8-bit Adam
and against each rule's float32 state, the state maker, the checks before anything is written,
and the generated 8-bit kernels compiled offline."""
import pickle

import numpy as np
import pytest

import mtapply
from mtapply import quantization
from mtapply.rules import library
from test_adam8bit import _draw
from test_adam8bit import _quantized_state as _adam_state

SHAPES = [(5000,), (70, 80), (10,), (256 * 20 + 7,), (0,), (4096,), (4095,)]


@pytest.mark.parametrize("decoupled", [False, True])
def test_the_adam_rule_in_8_bits_steps_as_8_bit_adam(decoupled):
    """The library's Adam rule with both moments in 8 bits (the second on the unsigned map)
    against mtapply.adam8bit_step: the same format, the same update."""
    rng = np.random.default_rng(0)
    params, grads = _draw(rng, SHAPES), _draw(rng, SHAPES)
    state = _adam_state(rng, params)
    twin_params = [p.copy() for p in params]
    twin = [[x.copy() for x in column] for column in state.lists()]
    rule = library.adam(decoupled_weight_decay=decoupled).with_state_bits(8, unsigned="exp_avg_sq")
    assert rule.slots[4:] == ("exp_avg_absmax", "exp_avg_sq_absmax")
    for t in range(1, 4):
        rule.step(params, grads, *state.lists(), lr=1e-2, step=t, weight_decay=0.1)
        mtapply.adam8bit_step(twin_params, grads, *twin, lr=1e-2, step=t, weight_decay=0.1,
                              decoupled_weight_decay=decoupled)
    for k, (got, want) in enumerate(zip(params, twin_params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"params[{k}]")
    for name, got_column, want_column in zip(("exp_avgs", "exp_avg_sqs", "m scales", "v scales"),
                                             state.lists(), twin):
        for k, (got, want) in enumerate(zip(got_column, want_column)):
            if got.dtype == np.uint8:  # a code may differ where a value lies on a midpoint
                assert np.mean(got != want) < 1e-3, f"{name}[{k}]"
            else:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=f"{name}[{k}]")


def test_8_bit_lion_follows_float32_lion_within_the_format():
    rng = np.random.default_rng(1)
    lion = library.lion()
    eight = lion.with_state_bits(8)
    params, grads = _draw(rng, SHAPES), _draw(rng, SHAPES)
    state = eight.state(params)
    floats = [p.copy() for p in params]
    moments = [np.zeros_like(p) for p in params]
    for t in range(1, 6):
        grads = _draw(rng, SHAPES)
        eight.step(params, grads, *state, lr=1e-3, step=t, weight_decay=0.1)
        lion.step(floats, grads, moments, lr=1e-3, step=t, weight_decay=0.1)
    codes, scales = state
    for k, (p, want_p, m, s, want_m) in enumerate(zip(params, floats, codes, scales, moments)):
        if m.dtype == np.float32:  # below the threshold: the rule as it is, exactly
            np.testing.assert_array_equal(m, want_m)
            np.testing.assert_array_equal(p, want_p)
            continue
        got_m = quantization.dequantize_blockwise(m, s, signed=True).reshape(p.shape)
        blockwise = np.repeat(s, 256)[:p.size].reshape(p.shape)
        assert np.all(np.abs(got_m - want_m) <= 0.05 * blockwise + 1e-7), f"exp_avg[{k}]"
        # sign(c) differs only where c lies within the format's error of zero
        assert np.mean(p != want_p) < 0.02, f"params[{k}]"
        assert p.size == 0 or np.abs(p - want_p).max() <= 2 * 5 * 1e-3 + 1e-6


def test_small_params_keep_float32_state_and_step_as_the_rule():
    rng = np.random.default_rng(2)
    eight = library.adan().with_state_bits(8, slots=("m", "v", "n"), unsigned="n", threshold=100)
    shapes = [(99,), (100,), (3, 50)]
    params, grads = _draw(rng, shapes), _draw(rng, shapes)
    state = eight.state(params)
    by_slot = dict(zip(eight.slots[2:], state))
    assert [x.dtype for x in by_slot["m"]] == [np.float32, np.uint8, np.uint8]
    assert [x.dtype for x in by_slot["prev_grad"]] == [np.float32] * 3  # kept in float32
    assert [x.shape for x in by_slot["n_absmax"]] == [(0,), (1,), (1,)]
    plain = library.adan()
    twin, twin_state = [params[0].copy()], [[c[0].copy()] for c in state[:4]]
    eight.step(params, grads, *state, lr=1e-2, step=1)
    plain.step(twin, grads[:1], *twin_state, lr=1e-2, step=1)
    np.testing.assert_array_equal(params[0], twin[0])


def test_state_starts_at_the_declared_first_values():
    yogi_like = mtapply.rule("first", slots="param:rw grad:r v:rw=0.5 w:rw=param",
                             hyper=dict(lr=None),
                             update="v = v * 0.5 + grad * grad\nw = w\nparam = param - lr * grad")
    eight = yogi_like.with_state_bits(8, slots=("v", "w"), unsigned="v")
    params = _draw(np.random.default_rng(3), [(300,), (5000,)])
    v, w, v_scales, w_scales = eight.state(params)
    assert v[0].dtype == np.float32 and np.all(v[0] == 0.5)  # below the threshold
    np.testing.assert_array_equal(w[0], params[0])
    np.testing.assert_allclose(quantization.dequantize_blockwise(v[1], v_scales[1], False), 0.5)
    back = quantization.dequantize_blockwise(w[1], w_scales[1], True).reshape(params[1].shape)
    blockwise = np.repeat(w_scales[1], 256)[:5000]
    assert np.all(np.abs(back - params[1]) <= 0.05 * blockwise)


def test_refusals_name_the_argument_and_change_nothing():
    rng = np.random.default_rng(4)
    lion = library.lion()
    with pytest.raises(ValueError, match="bits must be 8"):
        lion.with_state_bits(4)
    assert lion.with_state_bits(32) is lion
    with pytest.raises(ValueError, match="'grad'"):
        lion.with_state_bits(8, slots="grad")
    with pytest.raises(ValueError, match="unsigned names 'v'"):
        lion.with_state_bits(8, unsigned="v")
    eight = lion.with_state_bits(8)
    with pytest.raises(ValueError, match="master_params"):
        eight.spec(master_weights=True)
    params, grads = _draw(rng, [(5000,), (5000,)]), _draw(rng, [(5000,), (5000,)])
    codes, scales = eight.state(params)
    before = [p.copy() for p in params]
    wrong = [scales[0], np.zeros(3, np.float32)]
    with pytest.raises(ValueError, match=r"exp_avg_absmax\[1\] has shape \(3,\)"):
        eight.step(params, grads, codes, wrong, lr=1e-3, step=1)
    mixed = [codes[0], np.zeros(5000, np.float32)]
    with pytest.raises(ValueError, match=r"exp_avg_absmax\[1\]"):  # float32 state, 20 scales
        eight.step(params, grads, mixed, scales, lr=1e-3, step=1)
    with pytest.raises(TypeError, match="takes 4 lists"):
        eight.step(params, grads, codes, lr=1e-3, step=1)
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p, b)


def test_scales_follow_the_slots_order_whatever_order_slots_are_named_in():
    """The kernel finds the k-th 8-bit slot's scales in the k-th scale list."""
    eight = library.rmsprop(centered=True).with_state_bits(
        8, slots=("grad_avg", "square_avg"), unsigned="square_avg")
    slots = library.rmsprop(centered=True).slots
    assert eight.eight_bit == tuple(s for s in slots if s in ("grad_avg", "square_avg"))
    assert eight.spec().scale_slots == tuple(f"{s}_absmax" for s in eight.eight_bit)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_value_is_stored_as_zero_and_leaves_its_block_alone(bad):
    values = np.array([bad, 1.0, -2.0, 0.5], np.float32)
    codes, absmax = quantization.quantize_blockwise(values, True)
    clean_codes, clean_absmax = quantization.quantize_blockwise(np.where(np.isfinite(values), values, 0), True)
    assert absmax[0] == 2.0 and clean_absmax[0] == 2.0
    np.testing.assert_array_equal(codes, clean_codes)
    assert quantization.dequantize_blockwise(codes, absmax, True)[0] == 0


def test_an_8_bit_rule_pickles_and_keeps_its_choice():
    eight = library.adam().with_state_bits(8, unsigned=("exp_avg_sq",))
    again = pickle.loads(pickle.dumps(eight))
    assert again.slots == eight.slots and again.unsigned == ("exp_avg_sq",)
    assert "with_state_bits(8" in repr(again)


@pytest.mark.parametrize("make,unsigned", [(library.lion, ()), (library.adam, ("exp_avg_sq",)),
                                           (library.adan, ("n",)), (library.adagrad, ("sum",)),
                                           (library.ademamix, ("exp_avg_sq",))])
@pytest.mark.parametrize("params", ["float32", "bfloat16"])
def test_8_bit_rule_kernels_compile(make, unsigned, params):
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _source

    rule = make().with_state_bits(8, unsigned=unsigned)
    spec = rule.spec()
    n_rule = len(make().slots)
    states = tuple("uint8" if list_slot[:-1] in rule.eight_bit else "float32"
                   for list_slot in spec.slots[2:n_rule])
    dtypes = (params, params) + states + ("float32",) * len(rule.eight_bit)
    assert spec.functors_for(dtypes)[0].startswith("mta::Rule_")
    assert "Quantized<" in spec.source(dtypes)
    for arch in ("sm_80", "sm_90"):
        cubin = _source.compile_offline(spec.source(dtypes), arch, spec.compile_options(dtypes))
        assert cubin[:4] == b"\x7fELF"
    plain = (params, params) + ("float32",) * (len(spec.slots) - 2)  # small params' group
    assert spec.functors_for(plain) == make().spec().functors
    assert _source.compile_offline(spec.source(plain), "sm_90")[:4] == b"\x7fELF"



@pytest.mark.parametrize("mode", ["delta", "zero"])
@pytest.mark.parametrize("params", ["float32", "bfloat16"])
def test_8_bit_walk_compiles_in_the_update_modes(mode, params):
    """mtapply.optax's modes on the 8-bit walk: new - old params into an updates slot after
    the scales (delta), or the params taken as zeros (zero)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _source

    spec = library.adam().with_state_bits(8, unsigned="exp_avg_sq").spec().with_param_mode(mode)
    updates = (params,) if mode == "delta" else ()
    assert spec.slots[-1] == ("updates" if mode == "delta" else "exp_avg_sq_absmax")
    dtypes = (params, params, "uint8", "uint8", "float32", "float32") + updates
    source = spec.source(dtypes)
    assert "Quantized<" in source and ("DELTA 1" in source or "ZERO_PARAM 1" in source)
    assert _source.compile_offline(source, "sm_90", spec.compile_options(dtypes))[:4] == b"\x7fELF"


def test_a_rule_with_sums_over_other_slots_keeps_8_bit_state():
    """LARS's norms sum params and grads on the chunk walker; its momentum is 8-bit: steps as
    the float rule within the codes' error, and each step is the float step of the dequantized
    state, quantized again."""
    from mtapply import _optax_rules

    lars, hyper = _optax_rules.lars(), dict(lr=0.1, momentum=0.9, weight_decay=1e-4,
                                            trust_coefficient=0.01)
    eight = lars.with_state_bits(8)
    assert sorted(lars.program.first_pass_slots) == ["grad", "param"]
    rng = np.random.default_rng(5)
    shapes = [(5000,), (300, 20), (10,)]
    floats = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params, moments = [p.copy() for p in floats], [np.zeros(s, np.float32) for s in shapes]
    first = [p.copy() for p in params]
    state = eight.state(params)
    for _ in range(4):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        before = [p.copy() for p in params]
        dequantized = [quantization.dequantize_blockwise(c.reshape(-1), a, True).reshape(c.shape)
                       if c.dtype == np.uint8 else c.copy() for c, a in zip(*state)]
        lars.step(before, grads, dequantized, **hyper)
        lars.step(floats, grads, moments, **hyper)
        eight.step(params, grads, *state, **hyper)
        for p, want in zip(params, before):
            np.testing.assert_allclose(p, want, rtol=1e-6, atol=1e-7)
    for p, q, p0 in zip(params, floats, first):  # the momentum's codes: within 1e-3 of it
        np.testing.assert_allclose(p, q, rtol=0, atol=1e-3)
        assert np.abs(p - p0).max() > 1e-3  # (steps of some 1e-2 moved them)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_sums_over_8_bit_slots_read_them_as_the_update_does(adam_w_mode):
    """LAMB's first pass sums ||u||^2 over the moments it updates: in 8 bits it reads their
    codes dequantized, as the update then does, so a step equals the float32 rule's step from
    the dequantized moments (the trust ratio included), its new moments quantized."""
    rng = np.random.default_rng(8)
    shapes = [(5000,), (70, 80), (10,)]
    params, grads = _draw(rng, shapes), _draw(rng, shapes)
    eight = library.lamb(adam_w_mode).with_state_bits(8, unsigned="exp_avg_sq", threshold=1)
    m, v, m_scales, v_scales = eight.state(params)
    for k, p in enumerate(params):  # moments as if mid-training
        m[k], m_scales[k] = _quantized(rng.standard_normal(p.size) * 0.1, True, p.shape)
        v[k], v_scales[k] = _quantized(rng.random(p.size) * 0.01, False, p.shape)
    floats = [p.copy() for p in params]
    float_m = [quantization.dequantize_blockwise(c, s, True).reshape(c.shape) for c, s in zip(m, m_scales)]
    float_v = [quantization.dequantize_blockwise(c, s, False).reshape(c.shape) for c, s in zip(v, v_scales)]
    hyper = dict(lr=1e-2, step=3, weight_decay=0.01)
    eight.step(params, grads, m, v, m_scales, v_scales, **hyper)
    library.lamb(adam_w_mode).step(floats, grads, float_m, float_v, **hyper)
    for k in range(len(params)):
        np.testing.assert_array_equal(params[k], floats[k], err_msg=f"params[{k}]")
        codes, scales = _quantized(float_m[k].reshape(-1), True, params[k].shape)
        np.testing.assert_array_equal(m[k], codes)
        np.testing.assert_array_equal(m_scales[k], scales)


def _quantized(values, signed, shape):
    codes, scales = quantization.quantize_blockwise(np.asarray(values, np.float32), signed=signed)
    return codes.reshape(shape), scales


def test_a_summing_rule_with_8_bit_state_compiles():
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _optax_rules, _source

    spec = _optax_rules.lars().with_state_bits(8).spec()
    dtypes = ("float32", "float32", "uint8", "float32")
    first, update = spec.functors_for(dtypes)  # both passes on the 8-bit walk
    assert "Sums_q" in first and "_q" in update and "Sums" not in update
    source = spec.source(dtypes)
    assert "static constexpr unsigned READ = (1u << PARAM) | (1u << GRAD);" in source
    assert _source.compile_offline(source, "sm_90", spec.compile_options(dtypes))[:4] == b"\x7fELF"
    lamb = library.lamb().with_state_bits(8, unsigned="exp_avg_sq").spec()  # sums read the codes
    dtypes = ("float32", "float32", "uint8", "uint8", "float32", "float32")
    assert all("_q12u8" in f for f in lamb.functors_for(dtypes))
    source = lamb.source(dtypes)
    assert _source.compile_offline(source, "sm_90", lamb.compile_options(dtypes))[:4] == b"\x7fELF"


def test_a_factored_rule_keeps_its_momentum_in_8_bits_beside_its_factored_state():
    """optax's Adafactor rule with momentum, the momentum (ema) in 8 bits: the state maker shapes
    the factored slots as rows and columns, not as the param; 20 steps stay within the 8-bit
    format of the float32 run."""
    rule = library.adafactor_optax(momentum=True)
    eight = rule.with_state_bits(8, slots=("ema",), threshold=1)
    shapes = [(300, 260), (7,), (5000,), (3, 130, 140)]
    rng = np.random.default_rng(4)
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    floats, start = [p.copy() for p in params], [p.copy() for p in params]
    state = eight.state(params, min_dim_size=128)
    assert eight.slots[2:] == ("row_var", "col_var", "variance", "ema", "ema_absmax")
    for name, column in zip(eight.slots[2:5], state):
        assert [x.shape for x in column] == [rule.state_shapes(s, 128)[name] for s in shapes]
    assert [x.dtype for x in state[3]] == [np.uint8] * 4
    float_state = [[np.zeros(rule.state_shapes(s, 128)[name], np.float32) for s in shapes]
                   for name in ("row_var", "col_var", "variance", "ema")]
    for t in range(1, 21):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        hyper = dict(lr=0.01, decay=1 - t ** -0.8, momentum=0.9)
        eight.step(params, grads, *state, **hyper)
        rule.step(floats, [g.copy() for g in grads], *float_state, **hyper)
    for k, (p, f, p0) in enumerate(zip(params, floats, start)):
        moved = np.abs(f - p0).mean()
        assert moved > 1e-3 and np.abs(p - f).mean() <= 0.05 * moved, f"params[{k}]"
    eight.spec().refuse_cuda()  # (its kernels: test_a_factored_rule_with_8_bit_state_compiles)


def _factored_dtypes(spec, param: str, eight_bit: bool) -> tuple:
    """A group's dtypes: params and grads of `param`, 8-bit slots as codes (or float32 state,
    for small params), every other slot float32."""
    codes = {f"{slot}s" for slot in spec.eight_bit} if eight_bit else set()
    return tuple(param if name in ("params", "grads") else "uint8" if name in codes
                 else "float32" for name in spec.slots)


@pytest.mark.parametrize("param,mode", [("float32", "inplace"), ("bfloat16", "inplace"),
                                        ("float32", "delta"), ("bfloat16", "delta"),
                                        ("bfloat16", "stochastic")])
def test_a_factored_rule_with_8_bit_state_compiles(param, mode):
    """Adafactor's momentum in 8 bits beside its factored slots: the reductions as they are,
    then the sums and the update on the 8-bit walk (indexed functors), in each param mode
    (optax's updates, stochastic rounding of bfloat16 params) and with float32 state."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _source

    eight = library.adafactor_optax(momentum=True).with_state_bits(8, slots=("ema",))
    spec = eight.spec(stochastic_rounding=mode == "stochastic")
    if mode == "delta":
        spec = spec.with_param_mode("delta")
    for quantized in (True, False):
        dtypes = _factored_dtypes(spec, param, quantized)  # (optax's updates float32)
        functors = spec.functors_for(dtypes)
        assert [f.endswith("_q32u0") for f in functors] == [False] * 3 + [quantized] * 2
        source = spec.source(dtypes)
        cubin = _source.compile_offline(source, "sm_90", spec.compile_options(dtypes))
        assert cubin[:4] == b"\x7fELF"
        for k in range(len(functors)):
            assert _source.entry_name(k).encode() in cubin


def test_an_8_bit_slot_that_a_factored_rule_sums_by_rows_is_refused_on_a_gpu():
    """The factor pass sums each element's terms from the slots as stored: a slot it reads
    cannot be 8-bit codes on a GPU (the CPU dequantizes it first)."""
    rule = mtapply.rule("ema_factored", slots="param:rw grad:r ema:rw row_var:rw@row "
                                              "col_var:rw@col variance:rw@unfactored",
                        hyper=dict(lr=(1e-2, "> 0")),
                        update="""
                            ema = 0.9 * ema + 0.1 * grad
                            row_var = 0.5 * row_var + 0.5 * row_mean(ema * ema + 1e-30)
                            col_var = 0.5 * col_var + 0.5 * col_mean(ema * ema + 1e-30)
                            variance = 0.5 * variance + 0.5 * (ema * ema + 1e-30)
                            v = row_var * col_var / col_mean(row_var) if factored else variance
                            param = param - lr * ema * rsqrt(v)
                        """)
    rule.spec().refuse_cuda()  # in float32: the GPU passes run it
    with pytest.raises(NotImplementedError, match=r"8-bit slot 'ema' is read by the row and "
                                                  r"column means"):
        rule.with_state_bits(8, slots=("ema",)).spec().refuse_cuda()
