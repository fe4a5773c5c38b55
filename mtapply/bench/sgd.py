"""SGD with momentum (fp32, momentum=0.9, lr=0.01, no dampening, no weight decay): data,
competitors, targets.

Every competitor gets its own copy of the same random initial data and returns a `Stepper`
whose `step()` performs one optimizer step with the gradients already in place.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .common import (Competitor, Stepper, TensorLists, attach_grads, generator, graph_stepper,
                     randn_list)

NAME = "sgd"
DESCRIPTION = "sgd fp32, momentum=0.9, lr=0.01, dampening=0, weight_decay=0"
BYTES_PER_PARAM = 20  # read p, g, buf and write p, buf: 5 fp32 words per parameter
REFERENCE = "torch-fused"  # the peer every row's time is divided by
DEFAULT_WORKLOADS = ("gpt2-124M", "small10k")
TARGETS = {"gpt2-124M": ("x_floor", 1.05)}  # as Adam's: GPU time over the byte floor
LR = 0.01
MOMENTUM = 0.9


@dataclass
class SGDData(TensorLists):
    params: list
    grads: list
    momentum_buffers: list


def make_data(shapes, device, seed: int = 0) -> SGDData:
    """Random tensors (never zeros, which can flatter a kernel): buffers as if mid-training."""
    gen = generator(device, seed)
    params = randn_list(shapes, gen)
    grads = randn_list(shapes, gen)
    momentum_buffers = randn_list(shapes, gen, 0.1)
    return SGDData(params, grads, momentum_buffers)


def mtapply_plan(data: SGDData) -> Stepper:
    """mtapply as a user calls it: bind the lists once, then one `plan.step` per step."""
    import mtapply

    plan = mtapply.sgd_plan(*data.lists())
    # Counting from 1 as a training loop does: step 1 sets the buffers to the grads (torch's
    # first step), every later step blends them.
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter), momentum=MOMENTUM)

    return Stepper(step, plan, data)


def torch_fused(data: SGDData) -> Stepper:
    opt = _torch_sgd(data, lr=LR, fused=True)
    return Stepper(opt.step, opt, data)


def torch_foreach(data: SGDData) -> Stepper:
    opt = _torch_sgd(data, lr=LR, foreach=True)
    return Stepper(opt.step, opt, data)


def torch_fused_graph(data: SGDData) -> Stepper:
    """Fused SGD replayed from a CUDA graph. SGD keeps no step count, so once its buffers exist
    a step does no host work that capture forbids; the lr is a device tensor, as a schedule
    under a graph needs (fused SGD takes one)."""
    import torch

    lr = torch.tensor(LR, device=data.params[0].device)
    opt = _torch_sgd(data, lr=lr, fused=True)
    return graph_stepper(opt.step, opt, lr, data)


def _torch_sgd(data: SGDData, **options):
    """torch.optim.SGD over `data`, its momentum buffers preset to `data`'s: without them the
    first step would only copy the grads into new buffers."""
    import torch

    attach_grads(data.params, data.grads)
    opt = torch.optim.SGD(data.params, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                          **options)
    for p, buf in zip(data.params, data.momentum_buffers):
        opt.state[p] = {"momentum_buffer": buf}
    return opt


COMPETITORS = {
    "mtapply": Competitor(mtapply_plan, "mtapply.sgd_plan(...), table_mode='memcpy' (the default)"),
    "torch-fused": Competitor(torch_fused, "torch.optim.SGD(momentum=0.9, fused=True)"),
    "torch-fused-graph": Competitor(
        torch_fused_graph, "torch.optim.SGD(momentum=0.9, fused=True, lr=tensor), "
                           "CUDA graph replay"),
    "torch-foreach": Competitor(torch_foreach, "torch.optim.SGD(momentum=0.9, foreach=True)"),
}
