"""SGD on the GPU against torch.optim.SGD (foreach=False) and the float64 reference."""
import itertools

import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import assert_matches, to64  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(1,), (0,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (3, 5, 7), (278011,), (0,)]
CASES = [dict(momentum=m, dampening=d, weight_decay=wd, nesterov=n, maximize=mx)
         for m, d, wd, n, mx in itertools.product((0.0, 0.9), (0.0, 0.25), (0.0, 0.05), (False, True),
                                                  (False, True))
         if not (n and (m == 0 or d != 0))]


@pytest.mark.parametrize("table_mode", ["memcpy", "unified"])
@pytest.mark.parametrize("opts", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_fp32_matches_torch_sgd_over_ten_steps(opts, table_mode):
    params = [torch.randn(s, device="cuda") for s in SHAPES]
    theirs = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.SGD(theirs, lr=0.05, foreach=False, **opts)
    grads = [torch.zeros_like(p) for p in params]
    buffers = [torch.randn_like(p) for p in params] if opts["momentum"] else None
    plan = mtapply.sgd_plan(params, grads, buffers, nesterov=opts["nesterov"],
                            maximize=opts["maximize"], table_mode=table_mode)
    hyper = {k: v for k, v in opts.items() if k not in ("nesterov", "maximize")}
    for step in range(1, 11):
        for g, p in zip(grads, theirs):
            g.copy_(torch.randn_like(g))
            p.grad = g.clone()
        optimizer.step()
        plan.step(lr=0.05, step=step, **hyper)
        for i, p in enumerate(theirs):
            torch.testing.assert_close(params[i], p.detach(), rtol=1.3e-6, atol=1e-5)
            if buffers is not None and p.numel():
                torch.testing.assert_close(buffers[i], optimizer.state[p]["momentum_buffer"],
                                           rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_every_dtype_matches_float64_reference_each_step(dtype):
    dt = getattr(torch, dtype)
    params = [torch.randn(s, device="cuda").to(dt) for s in SHAPES]
    grads = [torch.zeros_like(p) for p in params]
    buffers = [torch.randn_like(p) for p in params]
    plan = mtapply.sgd_plan(params, grads, buffers, nesterov=True)
    for step in range(1, 11):
        for g in grads:
            g.copy_(torch.randn_like(g))
        expected = [mtapply.reference.sgd(to64(p), to64(g), to64(b), lr=0.05, step=step, momentum=0.9,
                                          weight_decay=0.01, nesterov=True)
                    for p, g, b in zip(params, grads, buffers)]
        plan.step(lr=0.05, step=step, momentum=0.9, weight_decay=0.01)
        scale = 2.0 if dtype in ("float16", "bfloat16") else 1.0
        for i, (p, b) in enumerate(expected):
            assert_matches(params[i], p, dtype, f"params[{i}] step {step}", scale)
            assert_matches(buffers[i], b, dtype, f"momentum_buffers[{i}] step {step}", scale)


def test_device_scalar_step_sets_buffers_on_the_first_step_inside_a_graph():
    params = [torch.randn(1000, device="cuda"), torch.randn(CHUNK + 3, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    buffers = [torch.randn_like(p) for p in params]
    twin = [[t.clone() for t in ts] for ts in (params, grads, buffers)]
    lr = torch.tensor([0.05], device="cuda")
    step = torch.tensor([0.0], device="cuda")
    plan = mtapply.sgd_plan(params, grads, buffers)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.add_(1)
        plan.step(lr=lr, step=step, momentum=0.9)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.add_(1)
        plan.step(lr=lr, step=step, momentum=0.9)
    for _ in range(3):
        graph.replay()
    plan_twin = mtapply.sgd_plan(*twin)
    for t in range(1, 5):
        plan_twin.step(lr=float(np.float32(0.05)), step=t, momentum=0.9)
    torch.cuda.synchronize()
    for a, b in zip(params + buffers, twin[0] + twin[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
