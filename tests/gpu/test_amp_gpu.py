"""AMP loss scaling on the GPU: device-resident grad_scale and found_inf, also in a CUDA graph."""
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import adam_state  # noqa: E402

SHAPES = [(1000,), (0,), (mtapply._source.CHUNK_ELEMENTS + 3,), (7, 9)]


def _copy(ts):
    return [t.clone() for t in ts]


def test_device_grad_scale_and_found_inf_match_the_unscaled_step():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=21)
    twin = [_copy(t) for t in (params, grads, ms, vs)]
    scale = torch.tensor(2.0**14, device="cuda")
    for g in grads:
        g.mul_(scale)
    found_inf = torch.zeros((), device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan_twin = mtapply.adam_plan(*twin)
    plan.step(lr=1e-2, step=1, grad_scale=scale, found_inf=found_inf)
    plan_twin.step(lr=1e-2, step=1)
    found_inf.fill_(1.0)
    plan.step(lr=1e-2, step=2, grad_scale=scale, found_inf=found_inf)  # skipped on the device
    torch.cuda.synchronize()
    for a, b in zip(params + ms + vs, twin[0] + twin[2] + twin[3]):
        assert torch.equal(a, b)


def test_found_inf_toggled_between_graph_replays():
    params = [torch.randn(s, device="cuda") for s in SHAPES]
    grads = [torch.randn_like(p) * 1024 for p in params]
    buffers = [torch.randn_like(p) for p in params]
    twin = [_copy(t) for t in (params, grads, buffers)]
    for g in twin[1]:
        g.div_(1024)
    scale = torch.tensor(1024.0, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    step = torch.ones((), device="cuda")
    plan = mtapply.sgd_plan(params, grads, buffers)
    plan.step(lr=0.1, step=step, momentum=0.9, grad_scale=scale, found_inf=found_inf)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.add_(1)
        plan.step(lr=0.1, step=step, momentum=0.9, grad_scale=scale, found_inf=found_inf)
    pattern = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    for flag in pattern:
        found_inf.fill_(flag)
        graph.replay()
    plan_twin = mtapply.sgd_plan(*twin)
    plan_twin.step(lr=0.1, step=1, momentum=0.9)
    taken = 1
    for t, flag in enumerate(pattern, start=2):
        if flag == 0.0:
            plan_twin.step(lr=0.1, step=t, momentum=0.9)
            taken += 1
    torch.cuda.synchronize()
    assert taken == 4
    for a, b in zip(params + buffers, twin[0] + twin[2]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
