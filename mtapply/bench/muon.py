"""Muon (fp32 params and grads; torch.optim.Muon's defaults but lr=0.02): momentum, Newton-Schulz
on each matrix in bfloat16, decoupled weight decay. The floor counts the elementwise passes
only (momentum: read g, b, write b and the bfloat16 update; apply: read p and the update, write
p); Newton-Schulz's products are compute, so x_floor is no target here: the rows are compared
with torch.optim.Muon (matrix by matrix), the same update grouped by shape with torch.bmm (as
users batch it by hand), optax.contrib.muon under jit and, where it is installed, HeavyBall's
Muon (stepped under torch.compile)."""
from __future__ import annotations

from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, generator, jax_lists,
                     optax_state, params_with_grads, randn_list, transformation_step)

NAME = "muon"
DESCRIPTION = "muon fp32 params, bf16 Newton-Schulz (5 steps), lr=0.02, momentum 0.95, nesterov"
BYTES_PER_PARAM = 24
REFERENCE = "torch"
DEFAULT_WORKLOADS = ("gpt2-hidden", "gpt2-hidden72", "matrices400")
TARGETS = {name: ("x_torch_gpu", 0.125) for name in DEFAULT_WORKLOADS}
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.1


@dataclass
class MuonData(TensorLists):
    params: list
    grads: list


def make_data(shapes, device, seed: int = 0) -> MuonData:
    gen = generator(device, seed)
    return MuonData(randn_list(shapes, gen, 0.02), randn_list(shapes, gen))


def mtapply_torch(data: MuonData) -> Stepper:
    import mtapply.torch as mt

    opt = mt.Muon(params_with_grads(data), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    return Stepper(opt.step, opt, data)


def torch_muon(data: MuonData) -> Stepper:
    import torch

    opt = torch.optim.Muon(params_with_grads(data), lr=LR, momentum=MOMENTUM,
                           weight_decay=WEIGHT_DECAY)
    return Stepper(opt.step, opt, data)


def torch_bmm(data: MuonData) -> Stepper:
    """The update of torch.optim.Muon with its matrices grouped by shape by hand: foreach ops
    for the momentum and the apply, one stack, Newton-Schulz in torch.bmm and one unstack per
    shape."""
    import math

    import torch

    params, grads = data.params, data.grads
    buffers = [torch.zeros_like(p) for p in params]
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault(tuple(p.shape), []).append(i)
    a, b, c = 3.4445, -4.7750, 2.0315

    def newton_schulz(x):
        tall = x.shape[1] > x.shape[2]
        x = x.mT if tall else x
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=1e-7)
        for _ in range(5):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.mT if tall else x

    def step():
        with torch.no_grad():
            torch._foreach_lerp_(buffers, grads, 1 - MOMENTUM)
            updates = torch._foreach_lerp(grads, buffers, MOMENTUM)
            out = [None] * len(params)
            for shape, members in groups.items():
                ortho = newton_schulz(torch.stack([updates[i] for i in members]).bfloat16())
                scale = -LR * math.sqrt(max(1.0, shape[0] / shape[1]))
                for k, i in enumerate(members):
                    out[i] = ortho[k].float().mul_(scale)
            torch._foreach_mul_(params, 1 - LR * WEIGHT_DECAY)
            torch._foreach_add_(params, out)

    return Stepper(step, buffers, data)


def heavyball_muon(data: MuonData) -> Stepper:
    """HeavyBall's Muon with the nearest settings (Nesterov momentum 0.95, lr 0.02, decoupled
    weight decay 0.1; its step compiled by torch.compile at the first call). Its momentum and
    Newton-Schulz are its own: after 4 steps of Gaussian grads its params are 0.44 lr from
    torch.optim.Muon's (CPU, heavyball 3.2.1), for steps of about 1.2 lr. Compiled in
    torch.compile's default mode: HeavyBall's own, max-autotune, spent over 200 s autotuning
    gpt2-hidden's products before its first step on an H200 (the row ran out of time)."""
    import heavyball
    import heavyball.utils

    heavyball.utils.compile_mode = "default"
    opt = heavyball.Muon(params_with_grads(data), lr=LR, betas=(MOMENTUM, 0.99),
                         weight_decay=WEIGHT_DECAY)

    def step():  # (its step sets each param's grad to None: a backward pass would set it)
        for p, g in zip(data.params, data.grads):
            p.grad = g
        opt.step()

    return Stepper(step, opt, data)


def optax_jit(data: MuonData) -> Stepper:
    """optax.contrib.muon under jax.jit (every leaf a matrix), params and state donated."""
    import optax

    params, grads = jax_lists(data.lists())
    optimizer = optax.contrib.muon(LR, beta=MOMENTUM, weight_decay=WEIGHT_DECAY)
    state = optax_state(optimizer, params)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


def mtapply_optax(data: MuonData) -> Stepper:
    """mtapply.optax.muon under jax.jit: optax.contrib.muon's update, each shape one batch."""
    import mtapply.optax as mtx

    params, grads = jax_lists(data.lists())
    optimizer = mtx.muon(LR, beta=MOMENTUM, weight_decay=WEIGHT_DECAY)
    state = optax_state(optimizer, params)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


COMPETITORS = {
    "mtapply-torch": Competitor(mtapply_torch, "mtapply.torch.Muon(...).step()"),
    "torch": Competitor(torch_muon, "torch.optim.Muon (matrix by matrix)"),
    "torch-bmm": Competitor(torch_bmm, "the same update grouped by shape: foreach + torch.bmm"),
    "optax-muon-jit": Competitor(optax_jit, "optax.contrib.muon under jax.jit, donated"),
    "heavyball": Competitor(heavyball_muon, "heavyball.Muon (torch.compile), the nearest settings"),
    "mtapply-optax": Competitor(mtapply_optax, "mtapply.optax.muon under jax.jit, donated"),
}
