"""LAMB on the GPU against the float64 reference (Apex FusedLAMB semantics), two launches."""
import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import assert_matches, count_launches, to64  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(1,), (0,), (CHUNK - 1,), (CHUNK + 1,), (64, 3, 7, 7), (278011,), (2048,), (0,)]
BASE = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)


def _lists(dtype, seed):
    """params and grads of `dtype`; fp32 moments, as mixed-precision LAMB keeps them.

    The update pass recomputes the update from the moments as stored, so with 16-bit moments it
    would differ from the float64 reference, whose moments are never rounded.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda s, scale, dt: (torch.randn(s, generator=g, device="cuda") * scale).to(dt)  # noqa: E731
    dt = getattr(torch, dtype)
    params = [make(s, 1.0, dt) for s in SHAPES]
    grads = [make(s, 1.0, dt) for s in SHAPES]
    ms = [make(s, 0.1, torch.float32) for s in SHAPES]
    vs = [make(s, 0.1, torch.float32).abs_() for s in SHAPES]
    return params, grads, ms, vs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("adam_w_mode,use_nvlamb", [(True, False), (False, True)])
@pytest.mark.parametrize("extra", [{}, dict(weight_decay=0.0), dict(max_grad_norm=1.0),
                                   dict(grad_averaging=False, bias_correction=False)],
                         ids=["base", "no-decay", "clipped", "plain-moments"])
def test_matches_reference_each_step(dtype, adam_w_mode, use_nvlamb, extra):
    params, grads, ms, vs = _lists(dtype, seed=5)
    plan = mtapply.lamb_plan(params, grads, ms, vs, adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb)
    scale = 4.0  # the trust ratio comes from fp32 sums: a few roundings more than the storage
    for step in range(1, 6):
        for g in grads:
            g.copy_(torch.randn_like(g))
        hyper = dict(BASE, **extra)
        if "max_grad_norm" in extra:
            norm = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
            hyper["global_grad_norm"] = torch.tensor([norm], device="cuda")
            ref_hyper = dict(hyper, global_grad_norm=float(np.float32(norm)))
        else:
            ref_hyper = hyper
        expected = [mtapply.reference.lamb(to64(p), to64(g), to64(m), to64(v), step=step,
                                           adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb, **ref_hyper)
                    for p, g, m, v in zip(params, grads, ms, vs)]
        plan.step(step=step, **hyper)
        for i, (p, m, v) in enumerate(expected):
            assert_matches(params[i], p, dtype, f"params[{i}] step {step}", scale)
            assert_matches(ms[i], m, "float32", f"exp_avgs[{i}] step {step}", scale)
            assert_matches(vs[i], v, "float32", f"exp_avg_sqs[{i}] step {step}", scale)


def test_two_launches_and_found_inf_skips_both():
    params, grads, ms, vs = _lists("float32", seed=6)
    before = [t.clone() for t in params + ms + vs]
    plan = mtapply.lamb_plan(params, grads, ms, vs)
    step = lambda: plan.step(step=1, found_inf=torch.ones((), device="cuda"), **BASE)  # noqa: E731
    assert count_launches(step) == 2
    torch.cuda.synchronize()
    for a, b in zip(params + ms + vs, before):
        assert torch.equal(a, b)


def test_16_bit_moments_follow_the_reference_within_one_rounding_of_the_update():
    # With bf16 moments the update pass recomputes the update u from the moments as stored: u
    # then carries their rounding (2**-8 relative each), so a param may differ from the float64
    # reference by up to lr * ratio * |u| * 2**-7 beyond the usual bf16 tolerance.
    g = torch.Generator(device="cuda").manual_seed(8)
    make = lambda s, scale: (torch.randn(s, generator=g, device="cuda") * scale).bfloat16()  # noqa: E731
    params, grads = [make(s, 1.0) for s in SHAPES], [make(s, 1.0) for s in SHAPES]
    ms, vs = [make(s, 0.1) for s in SHAPES], [make(s, 0.1).abs_() for s in SHAPES]
    old = [to64(p) for p in params]
    expected = [mtapply.reference.lamb(to64(p), to64(gr), to64(m), to64(v), step=1, **BASE)
                for p, gr, m, v in zip(params, grads, ms, vs)]
    mtapply.lamb_step(params, grads, ms, vs, step=1, **BASE)
    b1, b2 = BASE["beta1"], BASE["beta2"]
    for i, (p, m, v) in enumerate(expected):
        if not p.size:
            continue
        u = (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + BASE["eps"]) + BASE["weight_decay"] * old[i]
        ratio = np.linalg.norm(old[i]) / np.linalg.norm(u)
        bound = 1.6e-2 * np.abs(p) + 1e-5 + BASE["lr"] * ratio * np.abs(u) * 2.0 ** -7
        error = np.abs(to64(params[i]) - p.reshape(params[i].shape))
        assert (error <= bound.reshape(error.shape)).all(), f"params[{i}]: {error.max()}"
        assert_matches(ms[i], m, "bfloat16", f"exp_avgs[{i}]")
        assert_matches(vs[i], v, "bfloat16", f"exp_avg_sqs[{i}]")
