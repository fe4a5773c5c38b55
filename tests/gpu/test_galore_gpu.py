"""GaLoreAdamW on the GPU: the same steps as on the CPU (and as galore-torch on the GPU, where
installed), projector refreshes included, and no host synchronisation between refreshes
(torch's sync debug mode)."""
import copy

import pytest

import mtapply.torch as mt

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 512), torch.nn.GELU(),
                               torch.nn.Linear(512, 10))


def _groups(model, **galore):
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [{"params": [m.weight for m in linears], **galore},
            {"params": [m.bias for m in linears]}]


def _train(model, opt, steps, device):
    for k in range(steps):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(k)).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_cuda_steps_follow_the_cpu_steps():
    """One projector for the run: the SVDs of the CPU and the GPU may choose a singular vector's
    other sign, which cancels between the projection and the projection back."""
    galore = dict(rank=16, update_proj_gap=100, scale=0.25)
    cpu_model = _model()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    _train(cpu_model, mt.GaLoreAdamW(_groups(cpu_model, **galore), lr=1e-3, weight_decay=0.01),
           10, "cpu")
    _train(gpu_model, mt.GaLoreAdamW(_groups(gpu_model, **galore), lr=1e-3, weight_decay=0.01),
           10, "cuda")
    for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=2e-5)


def test_matches_galore_torch_on_the_gpu():
    """Between refreshes. At a refresh the GPU's SVD turns a singular vector's sign on a
    last-bit difference of the grad, in galore-torch's runs as in ours, so runs part there."""
    galore_torch = pytest.importorskip("galore_torch")
    galore = dict(rank=16, update_proj_gap=100, scale=0.25, proj_type="std")
    ours, theirs = _model().cuda(), _model().cuda()
    _train(ours, mt.GaLoreAdamW(_groups(ours, **galore), lr=1e-3, weight_decay=0.01), 10, "cuda")
    _train(theirs, galore_torch.GaLoreAdamW(_groups(theirs, **galore), lr=1e-3,
                                            weight_decay=0.01), 10, "cuda")
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_a_refresh_projects_onto_the_grads_leading_singular_vectors():
    model = _model().cuda()
    opt = mt.GaLoreAdamW(_groups(model, rank=16, update_proj_gap=4), lr=1e-3)
    _train(model, opt, 4, "cuda")
    before = {p: opt.state[p]["ortho"] for p in model.parameters() if p.dim() == 2}
    _train(model, opt, 1, "cuda")  # the fifth step refreshes, from these grads
    for p, old in before.items():
        ortho = opt.state[p]["ortho"]
        assert ortho is not old and ortho.shape == old.shape
        u, _, vh = torch.linalg.svd(p.grad.double(), full_matrices=False)
        exact = (u[:, :16] if opt.state[p]["left"] else vh[:16].t()).float()
        basis = ortho if opt.state[p]["left"] else ortho.t()
        # the same subspace, whatever the signs: the projections onto it agree
        torch.testing.assert_close(basis @ basis.t(), exact @ exact.t(), atol=1e-3, rtol=0)


def test_no_host_sync_between_projector_refreshes():
    model = _model().cuda()
    opt = mt.GaLoreAdamW(_groups(model, rank=16, update_proj_gap=100), lr=1e-3)
    _train(model, opt, 2, "cuda")  # the refresh at the first step, plans bound at the second
    x = torch.randn(64, 256, device="cuda")
    opt.zero_grad()
    model(x).square().mean().backward()
    before = model[0].weight.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.equal(model[0].weight, before)


def test_functional_steps_on_cupy_arrays_follow_numpy():
    """One projector for the whole run: a singular vector's sign, which the GPU's SVD may
    choose otherwise, then cancels between the projection and the projection back."""
    cupy = pytest.importorskip("cupy")
    import numpy as np

    import mtapply

    rng = np.random.default_rng(0)
    shapes = [(256, 96), (64, 300), (50,)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    device = [cupy.asarray(p) for p in host]
    states = [mtapply.galore_state(params, rank=8, update_proj_gap=1000) for params in (host, device)]
    for t in range(1, 6):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        mtapply.galore_adamw_step(host, grads, states[0], lr=1e-3, step=t, weight_decay=0.01)
        mtapply.galore_adamw_step(device, [cupy.asarray(g) for g in grads], states[1], lr=1e-3,
                                  step=t, weight_decay=0.01)
    for a, b in zip(device, host):
        np.testing.assert_allclose(cupy.asnumpy(a), b, rtol=1e-4, atol=2e-5)


def test_batched_projections_and_a_grad_of_another_layout_follow_the_cpu():
    """Matrices that share a shape project as batched products, bound once; a step whose grad is
    a transposed view (not row-major) projects every matrix by its own matmul. Both follow the
    CPU's steps."""
    shapes = [(96, 64)] * 3 + [(64, 96)] * 3 + [(80, 48)]
    generator = torch.Generator().manual_seed(5)
    cpu = [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.1) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    initial = [p.detach().clone() for p in cpu]
    galore = dict(rank=8, update_proj_gap=100, scale=0.25)
    opts = [mt.GaLoreAdamW([{"params": params, **galore}], lr=1e-2, weight_decay=0.01)
            for params in (cpu, gpu)]
    for k in range(6):
        for p, q in zip(cpu, gpu):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.cuda()
        if k == 3:
            gpu[1].grad = gpu[1].grad.t().contiguous().t()  # the same values, column-major
            assert not gpu[1].grad.is_contiguous()
        for opt in opts:
            opt.step()
    (bound,) = opts[1]._steps._steps.values()
    assert len(bound._forward.bound.batches) == 2 and len(bound._back.bound.batches) == 2
    for a, b, start in zip(cpu, gpu, initial):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=2e-5)
        assert (a.detach() - start).abs().max() > 1e-3  # the steps moved every matrix
