"""Lion (fp32; a shipped `mtapply.rule`, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1): data,
competitors, targets. torch has no Lion: its peers here are the per-tensor loop of the common
PyTorch implementation (lion-pytorch) and the same update in torch's foreach ops; in JAX,
optax.lion under jit.
"""
from __future__ import annotations

from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, fused_step, generator,
                     graph_stepper, jax_lists, optax_state, randn_list, transformation_step)

NAME = "lion"
DESCRIPTION = "lion fp32 (the rule mtapply.rules.library.lion), lr=1e-4, betas=(0.9, 0.99), wd=0.1"
BYTES_PER_PARAM = 20  # read p, g, m and write p, m: 5 fp32 words per parameter
REFERENCE = "torch-foreach"
DEFAULT_WORKLOADS = ("gpt2-124M", "small10k")
TARGETS = {"gpt2-124M": ("x_floor", 1.05)}
LR, BETA1, BETA2, WEIGHT_DECAY = 1e-4, 0.9, 0.99, 0.1


@dataclass
class LionData(TensorLists):
    params: list
    grads: list
    exp_avgs: list


def make_data(shapes, device, seed: int = 0) -> LionData:
    """Random tensors (never zeros): moments as if mid-training."""
    gen = generator(device, seed)
    return LionData(randn_list(shapes, gen), randn_list(shapes, gen), randn_list(shapes, gen, 0.1))


def mtapply_plan(data: LionData) -> Stepper:
    from mtapply.rules import library

    plan = library.lion().plan(*data.lists())

    def step():
        plan.step(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY)

    return Stepper(step, plan, data)


def mtapply_torch(data: LionData) -> Stepper:
    """mtapply.torch.Lion, its exp_avg preset to the data's."""
    import mtapply.torch as mt

    for p, g in zip(data.params, data.grads):
        p.requires_grad_(True)
        p.grad = g
    opt = mt.Lion(data.params, lr=LR, betas=(BETA1, BETA2), weight_decay=WEIGHT_DECAY)
    for p, m in zip(data.params, data.exp_avgs):
        opt.state[p]["exp_avg"] = m
    return Stepper(opt.step, opt, data)


def torch_loop(data: LionData) -> Stepper:
    """lion-pytorch's update, tensor by tensor."""
    import torch

    @torch.no_grad()
    def step():
        for p, g, m in zip(*data.lists()):
            p.mul_(1 - LR * WEIGHT_DECAY)
            update = m.clone().mul_(BETA1).add_(g, alpha=1 - BETA1).sign_()
            p.add_(update, alpha=-LR)
            m.mul_(BETA2).add_(g, alpha=1 - BETA2)

    return Stepper(step, data)


def torch_foreach(data: LionData) -> Stepper:
    """The same update in torch's foreach ops (multi-tensor kernels, several passes)."""
    import torch

    params, grads, moments = data.lists()

    @torch.no_grad()
    def step():
        torch._foreach_mul_(params, 1 - LR * WEIGHT_DECAY)
        update = torch._foreach_mul(moments, BETA1)
        torch._foreach_add_(update, grads, alpha=1 - BETA1)
        torch._foreach_sign_(update)
        torch._foreach_add_(params, update, alpha=-LR)
        torch._foreach_mul_(moments, BETA2)
        torch._foreach_add_(moments, grads, alpha=1 - BETA2)

    return Stepper(step, data)


def torch_foreach_graph(data: LionData) -> Stepper:
    """The foreach update replayed from a CUDA graph (no host work per step)."""
    return graph_stepper(torch_foreach(data).step, data)


def optax_jit(data: LionData) -> Stepper:
    """optax.lion under jax.jit, params and state donated."""
    import optax

    params, grads, moments = jax_lists(data.lists())
    optimizer = optax.lion(LR, b1=BETA1, b2=BETA2, weight_decay=WEIGHT_DECAY)
    state = optax_state(optimizer, params, mu=moments)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


def mtapply_optax(data: LionData, fused: bool) -> Stepper:
    import mtapply.optax as mtx

    params, grads, moments = jax_lists(data.lists())
    make = mtx.fused_lion if fused else mtx.lion
    optimizer = make(LR, b1=BETA1, b2=BETA2, weight_decay=WEIGHT_DECAY)
    state = mtx.flat_state(optimizer.init(params)._replace(exp_avg=moments), params)
    step = fused_step(optimizer) if fused else transformation_step(optimizer)
    return JaxLoop(step, params, state, grads).stepper()


COMPETITORS = {
    "mtapply": Competitor(mtapply_plan, "mtapply.rules.library.lion().plan(...)"),
    "mtapply-torch": Competitor(mtapply_torch, "mtapply.torch.Lion(...).step()"),
    "torch-loop": Competitor(torch_loop, "lion-pytorch's per-tensor update"),
    "torch-foreach": Competitor(torch_foreach, "the same update in torch._foreach ops"),
    "torch-foreach-graph": Competitor(torch_foreach_graph, "the foreach update, CUDA graph replay"),
    "optax-lion-jit": Competitor(optax_jit, "optax.lion under jax.jit, params and state donated"),
    "mtapply-optax": Competitor(lambda data: mtapply_optax(data, fused=False),
                                "mtapply.optax.lion under jax.jit, params and state donated"),
    "mtapply-optax-fused": Competitor(lambda data: mtapply_optax(data, fused=True),
                                      "mtapply.optax.fused_lion(...).step under jax.jit"),
}
