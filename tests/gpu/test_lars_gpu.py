"""LARS on the GPU: per-tensor norms on the device, both passes in one launch, against the float64
reference."""
import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import assert_matches, count_launches, to64  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(1,), (0,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (64, 3, 7, 7), (278011,), (100_000,),
          (2048,), (0,)]
HYPER = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8)


def _lists(shapes, dtype="float32", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    make = lambda s, scale: (torch.randn(s, generator=g, device="cuda") * scale).to(dt)  # noqa: E731
    return ([make(s, 0.05) for s in shapes], [make(s, 0.01) for s in shapes],
            [make(s, 0.001) for s in shapes])


def _expected(params, grads, buffers, exclude, **hyper):
    return [mtapply.reference.lars(to64(p), to64(g), to64(v), adapt=not ex, **hyper)
            for p, g, v, ex in zip(params, grads, buffers, exclude)]


@pytest.mark.parametrize("table_mode", ["memcpy", "unified"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_matches_reference_each_step(dtype, table_mode):
    params, grads, buffers = _lists(SHAPES, dtype, seed=1)
    exclude = [len(p.shape) == 1 and p.numel() < 3000 for p in params]
    plan = mtapply.lars_plan(params, grads, buffers, exclude=exclude, table_mode=table_mode)
    scale = 2.0 if dtype == "bfloat16" else 1.0
    for step in range(1, 6):
        for g in grads:
            g.copy_(torch.randn_like(g) * 0.01)
        expected = _expected(params, grads, buffers, exclude, **HYPER)
        plan.step(**HYPER)
        for i, (p, v) in enumerate(expected):
            # the trust ratio comes from fp32 sums: allow their rounding on top of the storage's
            assert_matches(params[i], p, dtype, f"params[{i}] step {step}", max(scale, 4.0))
            assert_matches(buffers[i], v, dtype, f"momentum_buffers[{i}] step {step}", max(scale, 4.0))


def test_results_are_deterministic():
    runs = []
    for _ in range(2):
        params, grads, buffers = _lists(SHAPES, seed=2)
        plan = mtapply.lars_plan(params, grads, buffers)
        for _ in range(3):
            plan.step(**HYPER)
        runs.append([to64(p) for p in params])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_hundred_thousand_tensors_take_one_launch():
    n = 100_000
    shapes = [(int(k % 13) + 1,) for k in range(n)] + [(3 * CHUNK + 5,)]
    params, grads, buffers = _lists(shapes, seed=3)
    flat = [to64(torch.cat([t.reshape(-1) for t in ts])) for ts in (params, grads, buffers)]
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    plan = mtapply.lars_plan(params, grads, buffers)
    # the norms and the update (kernels/walker.cuh, walk_fused)
    assert count_launches(lambda: plan.step(**HYPER)) == 1
    got = to64(torch.cat([p.reshape(-1) for p in params]))
    for k in list(range(0, n, 997)) + [n - 1, n]:
        a, b = sizes[k], sizes[k + 1]
        p, _ = mtapply.reference.lars(flat[0][a:b], flat[1][a:b], flat[2][a:b], **HYPER)
        np.testing.assert_allclose(got[a:b], p, rtol=4 * 1.3e-6, atol=4e-5, err_msg=f"params[{k}]")


def test_device_lr_amp_and_graph_replay_match_eager_steps():
    params, grads, buffers = _lists(SHAPES, seed=4)
    twin = [[t.clone() for t in ts] for ts in (params, grads, buffers)]
    for g in grads:
        g.mul_(256.0)
    lr = torch.tensor([0.1], device="cuda")
    scale = torch.tensor(256.0, device="cuda")
    found_inf = torch.zeros((), device="cuda")
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    plan = mtapply.lars_plan(params, grads, buffers)
    plan.step(lr=lr, grad_scale=scale, found_inf=found_inf, **hyper)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr, grad_scale=scale, found_inf=found_inf, **hyper)
    for flag in (0.0, 1.0, 0.0):
        found_inf.fill_(flag)
        graph.replay()
    plan_twin = mtapply.lars_plan(*twin)
    for _ in range(3):  # one eager step and two replays were not skipped
        plan_twin.step(lr=float(np.float32(0.1)), **hyper)
    torch.cuda.synchronize()
    for a, b in zip(params + buffers, twin[0] + twin[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
