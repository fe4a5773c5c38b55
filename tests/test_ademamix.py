"""AdEMAMix (`mtapply.rules.library.ademamix`, `mtapply.torch.AdEMAMix`): the rule against a
float64 NumPy definition of its formulas (with and without the alpha and beta3 warm-ups, weight
decay), the torch class as the functional rule bit for bit, 8-bit state against float state,
state_dict round trips, refused arguments, bitsandbytes' AdEMAMix where it is installed, and
the NVRTC compile of its kernels."""
import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from _torch_steps import run_steps as _run, seeded_grads as _grads, seeded_params as _params  # noqa: E402
from mtapply import quantization  # noqa: E402
from mtapply.rules import library  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

HYPER = {
    "plain": dict(lr=1e-2, weight_decay=0.0),
    "decay": dict(lr=1e-2, weight_decay=0.1),
    "t_alpha": dict(lr=1e-2, t_alpha=8.0),
    "t_beta3": dict(lr=1e-2, t_beta3=12.0),
    "both": dict(lr=3e-3, beta1=0.8, beta2=0.99, beta3=0.999, alpha=2.0, t_alpha=5.0,
                 t_beta3=30.0, eps=1e-6, weight_decay=0.05),
}
DEFAULTS = dict(beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, t_alpha=0.0, t_beta3=0.0,
                eps=1e-8, weight_decay=0.01)


def _scheduled(step, beta1, beta3, alpha, t_alpha, t_beta3):
    """alpha and beta3 at `step` (1-based): the paper's warm-ups, as bitsandbytes writes them
    (0: none)."""
    alpha_t = min(step * alpha / t_alpha, alpha) if t_alpha else alpha
    if not t_beta3:
        return alpha_t, beta3
    s, l1, l3 = step / t_beta3, math.log(beta1), math.log(beta3)
    return alpha_t, min(math.exp(l1 * l3 / ((1 - s) * l3 + s * l1)), beta3)


def _reference_step(p, g, m1, m2, nu, step, lr, beta1, beta2, beta3, alpha, t_alpha, t_beta3,
                    eps, weight_decay):
    """One AdEMAMix step in float64 (new arrays)."""
    alpha_t, beta3_t = _scheduled(step, beta1, beta3, alpha, t_alpha, t_beta3)
    m1 = beta1 * m1 + (1 - beta1) * g
    m2 = beta3_t * m2 + (1 - beta3_t) * g
    nu = beta2 * nu + (1 - beta2) * g * g
    denom = np.sqrt(nu) / math.sqrt(1 - beta2 ** step) + eps
    update = (m1 / (1 - beta1 ** step) + alpha_t * m2) / denom
    return p * (1 - lr * weight_decay) - lr * update, m1, m2, nu


def _lists(rng, dtype):
    shapes = [(7, 5), (33,), (1,)]
    params = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return params, [[np.zeros_like(p) for p in params] for _ in range(3)]


@pytest.mark.parametrize("name", list(HYPER))
@pytest.mark.parametrize("dtype,rtol,atol", [(np.float64, 1e-12, 1e-14),
                                             (np.float32, 2e-5, 2e-6)])
def test_rule_follows_its_float64_definition(name, dtype, rtol, atol):
    hyper = dict(DEFAULTS, **HYPER[name])
    rng = np.random.default_rng(3)
    params, (m1, m2, nu) = _lists(rng, dtype)
    want = [[x.astype(np.float64) for x in xs] for xs in zip(params, m1, m2, nu)]
    rule = library.ademamix()
    for step in range(1, 21):
        grads = [rng.standard_normal(p.shape).astype(dtype) for p in params]
        rule.step(params, grads, m1, m2, nu, step=step, **hyper)
        want = [_reference_step(*w[:1], g.astype(np.float64), *w[1:], step, **hyper)
                for w, g in zip(want, grads)]
    for k, (got, w) in enumerate(zip(zip(params, m1, m2, nu), want)):
        for slot, a, b in zip(("param", "exp_avg", "exp_avg_slow", "exp_avg_sq"), got, w):
            assert a.dtype == dtype
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{slot}[{k}]")


def test_beta3_warm_up_from_a_beta1_of_zero_stays_finite():
    """beta1 = 0 puts log(0) in the schedule: beta3 then rises as beta3 ** (t_beta3 / step),
    the schedule's limit (bitsandbytes' form of it has no value there)."""
    rule = library.ademamix()
    params, (m1, m2, nu) = _lists(np.random.default_rng(4), np.float64)
    slow = [np.zeros_like(p) for p in params]
    for step in range(1, 8):
        grads = [np.full_like(p, 0.5) for p in params]
        rule.step(params, grads, m1, m2, nu, lr=1e-2, step=step, beta1=0.0, beta3=0.99,
                  t_beta3=4.0)
        beta3_t = min(0.99 ** (4.0 / step), 0.99)
        slow = [beta3_t * s + (1 - beta3_t) * g for s, g in zip(slow, grads)]
        for a, b in zip(m2, slow):
            np.testing.assert_allclose(a, b, rtol=1e-12)
    assert all(np.isfinite(p).all() for p in params)







def test_defaults_are_bitsandbytes():
    opt = mt.AdEMAMix(_params(shapes=[(3,)]))
    assert opt.defaults == dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                                t_beta3=None, eps=1e-8, weight_decay=1e-2)
    assert type(opt).__module__ == "mtapply.torch" and "AdEMAMix" in mt.__all__


@pytest.mark.parametrize("device", DEVICES)
def test_torch_class_steps_as_the_functional_rule(device):
    """Two param groups (one with both warm-ups, one with neither) step as one plan; each
    param equals the rule's functional step with its group's values, bit for bit (lrs that
    float32 holds exactly, as a GPU plan keeps merged groups' lrs)."""
    params = _params(device=device)
    groups = [dict(params=params[:2], t_alpha=6, t_beta3=9),
              dict(params=params[2:], lr=2 ** -9, betas=(0.8, 0.99, 0.999), alpha=3.0,
                   weight_decay=0.0)]
    opt = mt.AdEMAMix(groups, lr=2 ** -7, weight_decay=0.1)
    twin = [p.detach().clone() for p in params]
    state = [[torch.zeros_like(p) for p in twin] for _ in range(3)]
    rule = library.ademamix()
    hyper = [dict(lr=2 ** -7, t_alpha=6.0, t_beta3=9.0, weight_decay=0.1),
             dict(lr=2 ** -9, beta1=0.8, beta2=0.99, beta3=0.999, alpha=3.0, weight_decay=0.0)]
    for t in range(1, 13):
        grads = _grads(params, t)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        for part, h in ((slice(0, 2), hyper[0]), (slice(2, 4), hyper[1])):
            rule.step(twin[part], grads[part], *(s[part] for s in state), step=t, **h)
    for k, (p, q) in enumerate(zip(params, twin)):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=f"params[{k}]")
        entry = opt.state[p]
        assert set(entry) == {"step", "exp_avg", "exp_avg_slow", "exp_avg_sq"}
        for name, s in zip(("exp_avg", "exp_avg_slow", "exp_avg_sq"), state):
            torch.testing.assert_close(entry[name], s[k], rtol=0, atol=0, msg=f"{name}[{k}]")
        assert float(entry["step"]) == 12


@pytest.mark.parametrize("device", DEVICES)
def test_8_bit_state_steps_as_the_8_bit_rule_and_follows_float_state(device):
    eight, floats, twin = (_params(device=device) for _ in range(3))
    options = dict(lr=1e-3, t_alpha=4, t_beta3=6)
    opt8 = mt.AdEMAMix(eight, state_bits=8, **options)
    opt32 = mt.AdEMAMix(floats, **options)
    rule = library.ademamix().with_state_bits(8, unsigned="exp_avg_sq")
    state = rule.state([p.detach() for p in twin])
    for t in range(5):
        grads = _grads(eight, t)
        for a, b, g in zip(eight, floats, grads):
            a.grad, b.grad = g, g.clone()
        opt8.step()
        opt32.step()
        with torch.no_grad():
            rule.step(twin, grads, *state, lr=1e-3, step=t + 1, t_alpha=4.0, t_beta3=6.0)
    start = _params(device=device)
    for k, (p, q, w) in enumerate(zip(eight, floats, twin)):
        torch.testing.assert_close(p.detach(), w.detach(), rtol=0, atol=0, msg=f"params[{k}]")
        entry = opt8.state[p]
        quantized = p.numel() >= 4096
        for j, name in enumerate(("exp_avg", "exp_avg_slow", "exp_avg_sq")):
            assert entry[name].dtype == (torch.uint8 if quantized else torch.float32)
            assert entry[f"{name}_absmax"].numel() == (
                quantization.n_blocks(p.numel()) if quantized else 0)
            torch.testing.assert_close(entry[name], state[j][k], rtol=0, atol=0)
            torch.testing.assert_close(entry[f"{name}_absmax"], state[3 + j][k], rtol=0, atol=0)
        if not quantized:  # float32 state: the same step as state_bits=32; on a GPU the
            # 8-bit kernel is another compilation, free to contract a multiply-add differently
            exact = device == "cpu"
            torch.testing.assert_close(p, q, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7,
                                       msg=f"params[{k}]")
            continue
        moved = (q.detach() - start[k].detach()).abs().mean()
        assert (p - q).abs().mean() <= 0.1 * moved, f"params[{k}] strays from float state"


@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_state_dict_round_trip_continues_the_same_run(state_bits):
    params = _params(1)
    opt = mt.AdEMAMix(params, lr=1e-2, t_alpha=3, t_beta3=7, weight_decay=0.05,
                      state_bits=state_bits)
    _run(opt, params, 5)
    saved = copy.deepcopy(opt.state_dict())  # as from a file: shares nothing
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = mt.AdEMAMix(resumed_params, lr=1.0, state_bits=state_bits)
    resumed.load_state_dict(saved)
    group = resumed.param_groups[0]
    assert (group["lr"], group["t_alpha"], group["t_beta3"], group["weight_decay"]) == (
        1e-2, 3, 7, 0.05)
    _run(opt, params, 5, first_seed=20)
    _run(resumed, resumed_params, 5, first_seed=20)
    for k, (p, q) in enumerate(zip(params, resumed_params)):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"params[{k}]")
        for name, value in opt.state[p].items():
            torch.testing.assert_close(resumed.state[q][name], value, rtol=0, atol=0)
        assert float(resumed.state[q]["step"]) == 10


@pytest.mark.parametrize("options,message", [
    (dict(lr=-1e-3), "Invalid learning rate"),
    (dict(betas=(1.0, 0.999, 0.9999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1, 0.9999)), "beta parameter at index 1"),
    (dict(betas=(0.9, 0.999, 1.0)), "beta parameter at index 2"),
    (dict(betas=(0.9, 0.999)), "Invalid betas"),
    (dict(alpha=-1.0), "Invalid alpha value"),
    (dict(alpha=float("nan")), "Invalid alpha value"),
    (dict(t_alpha=0), "Invalid t_alpha value"),
    (dict(t_alpha=-10), "Invalid t_alpha value"),
    (dict(t_beta3=0), "Invalid t_beta3 value"),
    (dict(t_beta3=float("inf")), "Invalid t_beta3 value"),
    (dict(eps=-1e-8), "Invalid epsilon value"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value"),
    (dict(state_bits=4), "state_bits must be 8, 16"),
])
def test_bad_arguments_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        mt.AdEMAMix(_params(shapes=[(3,)]), **options)


@pytest.mark.parametrize("group,message", [
    (dict(t_alpha=0), "param group 1: Invalid t_alpha value"),
    (dict(alpha=-1.0), "param group 1: alpha must be >= 0"),
    (dict(betas=(0.9, 0.999, 1.5)), r"param group 1: betas\[2\] must be \[0, 1\), got 1.5"),
])
def test_a_bad_group_is_refused_before_anything_is_written(group, message):
    first, second = _params(shapes=[(4,)]), _params(2, shapes=[(5,)])
    opt = mt.AdEMAMix(first, lr=1e-2)
    opt.add_param_group(dict(params=second, **group))
    for p in first + second:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in first + second]
    with pytest.raises(ValueError, match=message):
        opt.step()
    for p, b in zip(first + second, before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("options", [dict(), dict(t_alpha=6, t_beta3=10),
                                     dict(betas=(0.8, 0.99, 0.999), alpha=2.0, weight_decay=0.1,
                                          eps=1e-6)])
def test_follows_bitsandbytes_ademamix(options):
    bnb = pytest.importorskip("bitsandbytes")
    params, theirs = _params(5, shapes=[(40, 7), (300,)]), _params(5, shapes=[(40, 7), (300,)])
    opt = mt.AdEMAMix(params, lr=1e-2, **options)
    ref = bnb.optim.AdEMAMix(theirs, lr=1e-2, **options)
    for t in range(15):
        for p, q, g in zip(params, theirs, _grads(params, t)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        m1, m2 = ref.state[q]["state1"]
        for name, value in (("exp_avg", m1), ("exp_avg_slow", m2),
                            ("exp_avg_sq", ref.state[q]["state2"])):
            torch.testing.assert_close(opt.state[p][name], value, rtol=1e-5, atol=1e-7)


def test_8_bit_state_follows_bitsandbytes_ademamix8bit():
    """Both keep the three moments in the same blockwise 8-bit format (256 elements a block,
    nu on the unsigned map): the params stay far closer to each other than to float state."""
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(70, 80)]
    ours, theirs, floats = (_params(6, shapes=shapes) for _ in range(3))
    opt = mt.AdEMAMix(ours, lr=1e-3, state_bits=8)
    ref = bnb.optim.AdEMAMix8bit(theirs, lr=1e-3)
    exact = mt.AdEMAMix(floats, lr=1e-3)
    for t in range(6):
        for p, q, f, g in zip(ours, theirs, floats, _grads(ours, t)):
            p.grad, q.grad, f.grad = g, g.clone(), g.clone()
        opt.step()
        ref.step()
        exact.step()
    assert ref.state[theirs[0]]["state1"].dtype == torch.uint8
    moved = (floats[0] - _params(6, shapes=shapes)[0]).abs().mean()
    off_float = (ours[0] - floats[0]).abs().mean()
    assert 0 < off_float <= 0.1 * moved
    assert (ours[0] - theirs[0]).abs().mean() <= 0.1 * off_float


@pytest.mark.parametrize("params", ["float32", "bfloat16"])
def test_kernels_compile(params):
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _source

    plain = library.ademamix()
    source = plain.spec().source((params, params) + ("float32",) * 3)
    for arch in ("sm_80", "sm_90"):
        assert _source.compile_offline(source, arch)[:4] == b"\x7fELF"
    rule = plain.with_state_bits(8, unsigned="exp_avg_sq")
    spec = rule.spec()
    dtypes = (params, params) + ("uint8",) * 3 + ("float32",) * 3
    assert "Quantized<" in spec.source(dtypes)
    cubin = _source.compile_offline(spec.source(dtypes), "sm_90", spec.compile_options(dtypes))
    assert cubin[:4] == b"\x7fELF"
