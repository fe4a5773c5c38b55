"""Adam/AdamW on the GPU against torch.optim (foreach=False) and the float64 reference."""
import itertools

import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import TOL, adam_state, assert_matches, reference_step, to64  # noqa: E402

SHAPES = [(1,), (0,), (16383,), (16384,), (16385,), (3, 5, 7), (278011,), (555, 555), (0, 4), (2048 * 32 + 1,), (0,)]
OPTIONS = [dict(weight_decay=wd, decoupled_weight_decay=dec, amsgrad=ams, maximize=mx)
           for wd, dec, ams, mx in itertools.product((0.0, 0.1), (False, True), (False, True), (False, True))
           if not (wd == 0.0 and dec)]


def draw_grads(grads, ref):
    """Fresh random grads, also given to the torch reference's params."""
    for g, r in zip(grads, ref):
        g.copy_(torch.randn_like(g))
        r.grad = g.clone()


def torch_optimizer(params, opts, lr):
    cls = torch.optim.AdamW if opts["decoupled_weight_decay"] else torch.optim.Adam
    return cls(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=opts["weight_decay"],
               amsgrad=opts["amsgrad"], maximize=opts["maximize"], foreach=False)


@pytest.mark.parametrize("table_mode", ["memcpy", "unified"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k[:3]}{int(v) if isinstance(v, bool) else v}" for k, v in o.items()))
def test_fp32_matches_torch_over_ten_steps(opts, table_mode):
    params, grads, exp_avgs, exp_avg_sqs, max_sqs = adam_state(SHAPES, seed=1)
    exp_avgs = [torch.zeros_like(p) for p in params]  # torch starts from zero state
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    max_sqs = [torch.zeros_like(p) for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch_optimizer(ref, opts, lr=1e-2)
    plan = mtapply.adam_plan(params, grads, exp_avgs, exp_avg_sqs,
                             max_exp_avg_sqs=max_sqs if opts["amsgrad"] else None,
                             amsgrad=opts["amsgrad"], maximize=opts["maximize"],
                             decoupled_weight_decay=opts["decoupled_weight_decay"], table_mode=table_mode)
    rtol, atol = TOL["float32"]
    for t in range(1, 11):
        draw_grads(grads, ref)
        opt.step()
        plan.step(lr=1e-2, step=t, weight_decay=opts["weight_decay"])
        for i, r in enumerate(ref):
            state = opt.state[r] if r.numel() else None
            torch.testing.assert_close(params[i], r.detach(), rtol=rtol, atol=atol)
            if state:
                torch.testing.assert_close(exp_avgs[i], state["exp_avg"], rtol=rtol, atol=atol)
                torch.testing.assert_close(exp_avg_sqs[i], state["exp_avg_sq"], rtol=rtol, atol=atol)
                if opts["amsgrad"]:
                    torch.testing.assert_close(max_sqs[i], state["max_exp_avg_sq"], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("opts", OPTIONS[::3])
def test_every_dtype_matches_float64_reference_each_step(dtype, opts):
    params, grads, exp_avgs, exp_avg_sqs, max_sqs = adam_state(SHAPES, dtype=dtype, seed=2)
    eps = 0.1 if dtype == "float16" else 1e-8
    plan = mtapply.adam_plan(params, grads, exp_avgs, exp_avg_sqs,
                             max_exp_avg_sqs=max_sqs if opts["amsgrad"] else None,
                             amsgrad=opts["amsgrad"], maximize=opts["maximize"],
                             decoupled_weight_decay=opts["decoupled_weight_decay"])
    for t in range(1, 11):
        for g in grads:
            g.copy_(torch.randn_like(g))
        kw = dict(lr=1e-2, step=t, eps=eps, weight_decay=opts["weight_decay"])
        expected = reference_step(params, grads, exp_avgs, exp_avg_sqs, max_sqs if opts["amsgrad"] else None,
                                  decoupled_weight_decay=opts["decoupled_weight_decay"],
                                  amsgrad=opts["amsgrad"], maximize=opts["maximize"], **kw)
        plan.step(**kw)
        for i, (p, m, v, vmax) in enumerate(expected):
            # 16-bit storage rounds every state each step: allow one rounding of the new value
            scale = 2.0 if dtype in ("float16", "bfloat16") else 1.0
            assert_matches(params[i], p, dtype, f"params[{i}] step {t}", scale)
            assert_matches(exp_avgs[i], m, dtype, f"exp_avgs[{i}] step {t}", scale)
            assert_matches(exp_avg_sqs[i], v, dtype, f"exp_avg_sqs[{i}] step {t}", scale)
            if opts["amsgrad"]:
                assert_matches(max_sqs[i], vmax, dtype, f"max_exp_avg_sqs[{i}] step {t}", scale)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_matches_torch_fused(dtype):
    """torch's fused Adam also computes in fp32 for 16-bit storage."""
    params, grads, *_ = adam_state(SHAPES, dtype=dtype, seed=3)
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-3, eps=1e-3, weight_decay=0.01, fused=True)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    plan = mtapply.adam_plan(params, grads, exp_avgs, exp_avg_sqs, decoupled_weight_decay=True)
    for t in range(1, 11):
        draw_grads(grads, ref)
        opt.step()
        plan.step(lr=1e-3, step=t, eps=1e-3, weight_decay=0.01)
    # lr is about one ulp of the params here, so the two kernels' float32 roundings can each flip
    # the 16-bit rounding of a param once a step: at most 10 ulps apart, rarely more than one.
    ours = torch.cat([p.float().reshape(-1) for p in params])
    theirs = torch.cat([r.detach().float().reshape(-1) for r in ref])
    ulp = torch.finfo(params[0].dtype).eps * theirs.abs().clamp_min(1e-3)
    diff = (ours - theirs).abs()
    assert (diff <= 10 * ulp).all()
    assert (diff > ulp).float().mean().item() < 1e-3


def test_mixed_dtypes_in_one_call_form_groups():
    shapes = [(1000,), (33,), (4097,), (5,)]
    dtypes = ["float32", "bfloat16", "float16", "float32"]
    tensors = [adam_state([s], dtype=d, seed=10 + k) for k, (s, d) in enumerate(zip(shapes, dtypes))]
    params, grads, ms, vs = ([t[j][0] for t in tensors] for j in range(4))
    expected = reference_step(params, grads, ms, vs, None, lr=1e-2, step=3, eps=1e-3)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    assert len(plan._cuda.launches) == 3
    plan.step(lr=1e-2, step=3, eps=1e-3)
    for i, d in enumerate(dtypes):
        assert_matches(params[i], expected[i][0], d, f"params[{i}]", 2.0)


def test_table_modes_give_identical_bits():
    results = []
    for mode in ("memcpy", "unified"):
        params, grads, ms, vs, _ = adam_state(SHAPES, seed=4)
        plan = mtapply.adam_plan(params, grads, ms, vs, table_mode=mode)
        for t in range(1, 4):
            plan.step(lr=1e-2, step=t, weight_decay=0.1)
        results.append([to64(p) for p in params])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_zero_grads_and_tiny_lr_leave_params_bit_identical():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=5)
    before = [p.clone() for p in params]
    zero = [torch.zeros_like(g) for g in grads]
    mtapply.adam_step(params, zero, [torch.zeros_like(p) for p in params],
                      [torch.zeros_like(p) for p in params], lr=1e-2, step=1)
    for a, b in zip(params, before):
        assert torch.equal(a, b)
    mtapply.adam_step(params, grads, ms, vs, lr=1e-28, step=1)
    for a, b in zip(params, before):
        assert torch.equal(a, b)


def test_first_and_last_element_of_big_tensors_change():
    params, grads, ms, vs, _ = adam_state([(2**26 + 3,), (7777 * 77,)], seed=6)
    expected = reference_step(params, grads, ms, vs, None, lr=1e-2, step=1)
    before = [p.clone() for p in params]
    mtapply.adam_step(params, grads, ms, vs, lr=1e-2, step=1)
    for i, p in enumerate(params):
        assert p[0] != before[i][0] and p[-1] != before[i][-1]
        assert_matches(p, expected[i][0], "float32", f"params[{i}]")


def test_denormals_are_not_flushed_like_torch():
    """g**2 * (1 - beta2) is a float32 denormal; flushing it to zero would divide by zero (eps=0)."""
    params = [torch.randn(4096, device="cuda")]
    grads = [torch.full((4096,), 1e-20, device="cuda")]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(ref, lr=1e-3, eps=0.0, foreach=False)
    ref[0].grad = grads[0].clone()
    opt.step()
    exp_avgs, exp_avg_sqs = [torch.zeros_like(params[0])], [torch.zeros_like(params[0])]
    mtapply.adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, step=1, eps=0.0)
    assert 0 < exp_avg_sqs[0][0].item() < 1.18e-38  # a denormal, kept
    assert torch.isfinite(params[0]).all()
    torch.testing.assert_close(params[0], ref[0].detach(), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(exp_avg_sqs[0], opt.state[ref[0]]["exp_avg_sq"], rtol=1.3e-6, atol=0.0)
