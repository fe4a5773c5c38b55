"""8-bit Adam on the CPU: the NumPy path of adam8bit_step against reference.adam8bit (exactly),
its state, its checks, and how closely it follows fp32 AdamW."""
import numpy as np
import pytest

import mtapply
from mtapply import quantization, reference

SHAPES = [(5000,), (70, 80), (10,), (256 * 20 + 7,), (0,), (4096,), (4095,)]


def _draw(rng, shapes, scale=1.0):
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]


def _quantized_state(rng, params):
    """A state holding random moments (never zeros), as 8-bit codes where the state says."""
    state = mtapply.adam8bit_state(params)
    for k, p in enumerate(params):
        m, v = rng.standard_normal(p.shape) * 0.1, np.abs(rng.standard_normal(p.shape)) * 0.01
        if state.exp_avgs[k].dtype == np.float32:
            state.exp_avgs[k][...], state.exp_avg_sqs[k][...] = m, v
            continue
        for moment, codes, scales, signed in ((m, state.exp_avgs[k], state.exp_avg_absmax[k], True),
                                              (v, state.exp_avg_sqs[k], state.exp_avg_sq_absmax[k],
                                               False)):
            c, s = quantization.quantize_blockwise(moment, signed)
            codes[...], scales[...] = c.reshape(codes.shape), s
    return state


def test_state_layout_and_bytes():
    params = [np.ones(s, np.float32) for s in SHAPES]
    state = mtapply.adam8bit_state(params)
    for p, m, v, ms, vs in zip(params, *state.lists()):
        quantized = p.size >= mtapply.adam8bit.THRESHOLD
        assert m.dtype == v.dtype == (np.uint8 if quantized else np.float32)
        assert m.shape == v.shape == p.shape
        assert ms.shape == vs.shape == ((-(-p.size // 256),) if quantized else (0,))
        assert ms.dtype == vs.dtype == np.float32
    big = [np.ones((1024, 768), np.float32)]
    per_param = mtapply.adam8bit_state(big).nbytes() / big[0].size
    assert per_param == pytest.approx(2 + 2 * 4 / 256) and per_param <= 2.1


@pytest.mark.parametrize("decoupled,maximize,weight_decay", [(False, False, 0.0), (True, False, 0.01),
                                                              (False, True, 0.1)])
def test_numpy_steps_equal_the_reference(decoupled, maximize, weight_decay):
    rng = np.random.default_rng(0)
    params = _draw(rng, SHAPES)
    state = _quantized_state(rng, params)
    want = [p.copy() for p in params]
    want_state = [[x.copy() for x in column] for column in state.lists()]
    options = dict(weight_decay=weight_decay, decoupled_weight_decay=decoupled, maximize=maximize)
    for t in range(1, 5):
        grads = _draw(rng, SHAPES)
        mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-2, step=t, **options)
        for k, (p, g) in enumerate(zip(want, grads)):
            if p.size == 0:
                continue
            m, v, ms, vs = (column[k] for column in want_state)
            if m.dtype == np.float32:
                p2, m2, v2, _ = reference.adam(p, g, m, v, lr=1e-2, step=t, dtype=np.float32,
                                               **options)
                want_state[0][k], want_state[1][k] = m2.astype(np.float32), v2.astype(np.float32)
            else:
                p2, (mc, ms2), (vc, vs2) = reference.adam8bit(
                    p, g, (m.reshape(-1), ms), (v.reshape(-1), vs), lr=1e-2, step=t, **options)
                want_state[0][k], want_state[1][k] = mc.reshape(m.shape), vc.reshape(v.shape)
                want_state[2][k], want_state[3][k] = ms2, vs2
            want[k] = p2.astype(np.float32).reshape(p.shape)
    for k in range(len(SHAPES)):
        np.testing.assert_array_equal(params[k], want[k], err_msg=f"params[{k}]")
        for column, expected, name in zip(state.lists(), want_state, ("m", "v", "m scale", "v scale")):
            np.testing.assert_array_equal(column[k], expected[k], err_msg=f"{name}[{k}]")
    assert not np.array_equal(params[0], _draw(np.random.default_rng(0), SHAPES)[0])


def test_torch_cpu_tensors_step_like_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    params = _draw(rng, SHAPES[:4])
    state = _quantized_state(rng, params)
    tparams = [torch.from_numpy(p.copy()) for p in params]
    tstate = [[torch.from_numpy(x.copy()) for x in column] for column in state.lists()]
    for t in range(1, 3):
        grads = _draw(rng, SHAPES[:4])
        mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-3, step=t)
        mtapply.adam8bit_step(tparams, [torch.from_numpy(g) for g in grads], *tstate, lr=1e-3, step=t)
    for got, want in zip(tparams + [x for c in tstate for x in c],
                         params + [x for c in state.lists() for x in c]):
        np.testing.assert_array_equal(got.numpy(), want)


def _bad_cases():
    def moments_differ(args):
        args[3][0] = np.zeros(5000, np.float32)

    def scale_too_short(args):
        args[4][0] = np.zeros(3, np.float32)

    def scale_of_fp32_moment(args):
        args[5][1] = np.zeros(1, np.float32)

    def half_scales(args):
        args[4][0] = np.zeros(20, np.float16)

    def codes_of_another_shape(args):
        args[2][0] = np.zeros(4999, np.uint8)

    def int8_codes(args):
        args[2][0] = np.zeros(5000, np.int8)

    return [
        (moments_differ, TypeError, r"exp_avgs\[0\] is uint8 but exp_avg_sqs\[0\] is float32"),
        (scale_too_short, ValueError, r"exp_avg_absmax\[0\] has shape \(3,\).*20 elements"),
        (scale_of_fp32_moment, ValueError, r"exp_avg_sq_absmax\[1\].*0 elements for float32"),
        (half_scales, TypeError, r"exp_avg_absmax\[0\] has dtype float16; this slot takes float32"),
        (codes_of_another_shape, ValueError, r"exp_avgs\[0\] has shape \(4999,\)"),
        (int8_codes, TypeError, r"exp_avgs\[0\] has dtype int8; this slot takes uint8, float32"),
    ]


@pytest.mark.parametrize("corrupt,error,message", _bad_cases())
def test_bad_state_is_refused_before_anything_is_written(corrupt, error, message):
    rng = np.random.default_rng(2)
    params = _draw(rng, [(5000,), (10,)])
    grads = _draw(rng, [(5000,), (10,)])
    args = [params, grads, *(list(column) for column in _quantized_state(rng, params).lists())]
    corrupt(args)
    before = [[x.copy() for x in column] for column in args]
    with pytest.raises(error, match=message):
        mtapply.adam8bit_step(*args, lr=1e-3, step=1)
    for column, saved in zip(args, before):
        for x, y in zip(column, saved):
            np.testing.assert_array_equal(x, y)


def test_float64_params_with_8bit_moments_are_refused():
    params = [np.zeros(5000)]
    state = mtapply.adam8bit_state(params)
    with pytest.raises(TypeError, match=r"params\[0\] and grads\[0\] are float64 and float64"):
        mtapply.adam8bit_step(params, [np.ones(5000)], *state.lists(), lr=1e-3, step=1)
    assert not params[0].any()


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_params_round_the_fp32_update(stochastic):
    torch = pytest.importorskip("torch")
    from mtapply.stochastic import round_to_bfloat16_stochastic

    rng = np.random.default_rng(4)
    values = _draw(rng, [(5000,), (300,)])
    state = _quantized_state(rng, values)
    params = [torch.from_numpy(v).to(torch.bfloat16) for v in values]
    grads = [torch.from_numpy(g).to(torch.bfloat16) for g in _draw(rng, [(5000,), (300,)])]
    start = [p.float().numpy() for p in params]
    codes = [(state.exp_avgs[0].copy(), state.exp_avg_absmax[0].copy()),
             (state.exp_avg_sqs[0].copy(), state.exp_avg_sq_absmax[0].copy())]
    mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-2, step=2, seed=11,
                          stochastic_rounding=stochastic)
    new, _, _ = reference.adam8bit(start[0], grads[0].float().numpy(), *codes, lr=1e-2, step=2)
    bits = params[0].view(torch.int16).numpy().view(np.uint16)
    if stochastic:
        np.testing.assert_array_equal(bits, round_to_bfloat16_stochastic(new, 11, 2, 0))
    else:
        np.testing.assert_array_equal(params[0].float().numpy(),
                                      torch.from_numpy(new).to(torch.bfloat16).float().numpy())


def test_eight_bit_adamw_follows_fp32_adamw_on_a_least_squares_fit():
    """A linear least-squares fit trained 300 steps: the 8-bit moments end within a few percent
    of fp32 AdamW's loss, far below the starting loss."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    w_true = rng.standard_normal((64, 80)).astype(np.float32)
    y = x @ w_true
    start = (rng.standard_normal((64, 80)) * 0.1).astype(np.float32)

    def loss_and_grad(w):
        r = x @ w - y
        return float((r * r).mean()), (2 * x.T @ r / r.size).astype(np.float32)

    w8, w32 = start.copy(), start.copy()
    state = mtapply.adam8bit_state([w8])
    m, v = np.zeros_like(w32), np.zeros_like(w32)
    for t in range(1, 301):
        _, g8 = loss_and_grad(w8)
        mtapply.adam8bit_step([w8], [g8], *state.lists(), lr=3e-2, step=t, weight_decay=1e-4,
                              decoupled_weight_decay=True)
        _, g32 = loss_and_grad(w32)
        mtapply.adam_step([w32], [g32], [m], [v], lr=3e-2, step=t, weight_decay=1e-4,
                          decoupled_weight_decay=True)
    first = loss_and_grad(start)[0]
    last8, last32 = loss_and_grad(w8)[0], loss_and_grad(w32)[0]
    assert state.exp_avgs[0].dtype == np.uint8
    assert last32 < 1e-2 * first
    assert last8 < 1e-2 * first and abs(last8 - last32) <= 0.5 * last32 + 1e-3 * first
