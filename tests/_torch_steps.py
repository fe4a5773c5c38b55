"""Seeded params, grads and steps of a torch optimizer, shared by the state-format tests."""
import torch

SHAPES = [(5000,), (10,), (70, 80), (256 * 20 + 7,)]  # 8-bit, small (float32 state), 2-D, partial block


def seeded_params(seed=0, device="cpu", shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def seeded_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


def run_steps(opt, params, steps, first_seed=0):
    """`steps` steps of `opt`, the grads of step t drawn with seed first_seed + t."""
    for t in range(steps):
        for p, g in zip(params, seeded_grads(params, first_seed + t)):
            p.grad = g
        opt.step()
