"""AdamW after clipping the gradients' global norm (fp32; lr=1e-3, wd=0.01, max_norm=1.0, every
step clipping): mtapply's fused chain of optax-named links (a first pass sums the whole list's
squares, the second steps) against torch's `clip_grad_norm_` then fused AdamW, and
optax.chain(clip_by_global_norm, adamw) under jit."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, generator, jax_lists,
                     optax_state, params_with_grads, randn_list, transformation_step)

NAME = "clipped-adamw"
DESCRIPTION = ("clip_by_global_norm(1.0) then adamw fp32 (mtapply.chain of the library's links), "
               "lr=1e-3, wd=0.01")
BYTES_PER_PARAM = 32  # the norm pass reads g; the step reads p, g, m, v and writes p, m, v
REFERENCE = "torch-clip-fused"
DEFAULT_WORKLOADS = ("gpt2-124M", "small10k")
TARGETS = {"gpt2-124M": ("x_floor", 1.05)}
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0


@dataclass
class ClippedData(TensorLists):
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list


def make_data(shapes, device, seed: int = 0) -> ClippedData:
    """Random tensors (never zeros): grads of a global norm far above MAX_NORM."""
    gen = generator(device, seed)
    return ClippedData(randn_list(shapes, gen), randn_list(shapes, gen),
                       randn_list(shapes, gen, 0.1), [x.abs_() for x in randn_list(shapes, gen, 0.01)])


def _chain():
    import mtapply
    from mtapply.rules import library as L

    return mtapply.chain(L.clip_by_global_norm(MAX_NORM), L.scale_by_adam(),
                         L.add_decayed_weights(WEIGHT_DECAY), L.scale_by_learning_rate())


def mtapply_plan(data: ClippedData) -> Stepper:
    plan = _chain().plan(*data.lists())
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter))

    return Stepper(step, plan, data)



def mtapply_torch(data: ClippedData) -> Stepper:
    import mtapply.torch as mt

    import torch

    opt = mt.optimizer(_chain(), params_with_grads(data), lr=LR)
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        opt.state[p].update(step=torch.tensor(0.0), mu=m, nu=v)
    return Stepper(opt.step, opt, data)


def torch_clip_fused(data: ClippedData) -> Stepper:
    """torch.nn.utils.clip_grad_norm_ (foreach) then torch.optim.AdamW(fused=True). The clip
    scales the grads in place (to a norm of MAX_NORM at the first step; each later step
    multiplies them again, by about 1), so the steps equal mtapply's clipping of the same
    grads."""
    import torch

    params = params_with_grads(data)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        opt.state[p].update(step=torch.tensor(0.0, device=p.device), exp_avg=m, exp_avg_sq=v)

    def step():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()

    return Stepper(step, opt, data)


def optax_jit(data: ClippedData) -> Stepper:
    import optax

    params, grads, mu, nu = jax_lists(data.lists())
    optimizer = optax.chain(optax.clip_by_global_norm(MAX_NORM),
                            optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    state = optax_state(optimizer, params, mu=mu, nu=nu)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


COMPETITORS = {
    "mtapply": Competitor(mtapply_plan, "mtapply.chain(clip_by_global_norm, scale_by_adam, "
                                        "add_decayed_weights, scale_by_learning_rate).plan"),
    "mtapply-torch": Competitor(mtapply_torch, "mtapply.torch.optimizer(that chain).step()"),
    "torch-clip-fused": Competitor(torch_clip_fused, "clip_grad_norm_ then AdamW(fused=True)"),
    "optax-jit": Competitor(optax_jit, "optax.chain(clip_by_global_norm, adamw) under jax.jit"),
}
