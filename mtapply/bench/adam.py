"""Adam (fp32, lr=1e-3, default betas, eps=1e-8, no weight decay): data, competitors, targets.

Every competitor gets its own copy of the same random initial data and returns a `Stepper`
whose `step()` performs one optimizer step with the gradients already in place.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .common import (Competitor, Stepper, TensorLists, attach_grads, generator, graph_stepper,
                     randn_list)

NAME = "adam"
DESCRIPTION = "adam fp32, lr=1e-3, eps=1e-8, weight_decay=0"
BYTES_PER_PARAM = 28  # read p, g, m, v and write p, m, v: 7 fp32 words per parameter
REFERENCE = "torch-fused"  # the peer every row's time is divided by
DEFAULT_WORKLOADS = ("big256M", "gpt2-124M", "small10k", "tiny2k")
# workload -> (metric, limit) for mtapply's rows. "x_floor" is GPU time over the byte floor;
# tiny lists are launch-bound, so there the target is wall-clock microseconds per step.
TARGETS = {
    "big256M": ("x_floor", 1.05),
    "gpt2-124M": ("x_floor", 1.05),
    "small10k": ("x_floor", 1.10),
    "tiny2k": ("wall_us", 20.0),
}
LR = 1e-3
EPS = 1e-8


@dataclass
class AdamData(TensorLists):
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list


def make_data(shapes, device, seed: int = 0) -> AdamData:
    """Random tensors (never zeros, which can flatter a kernel): states as if mid-training."""
    import torch

    gen = generator(device, seed)
    params = randn_list(shapes, gen)
    grads = randn_list(shapes, gen)
    exp_avgs = randn_list(shapes, gen, 0.1)
    exp_avg_sqs = [torch.rand(s, generator=gen, device=gen.device) for s in shapes]
    return AdamData(params, grads, exp_avgs, exp_avg_sqs)


def mtapply_plan(data: AdamData, table_mode: str) -> Stepper:
    """mtapply as a user calls it: bind the lists once, then one `plan.step` per step."""
    import mtapply

    plan = mtapply.adam_plan(*data.lists(), table_mode=table_mode)
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter))

    return Stepper(step, plan, data)


def torch_fused(data: AdamData) -> Stepper:
    opt = _torch_adam(data, lr=LR, fused=True)
    return Stepper(opt.step, opt, data)


def torch_foreach(data: AdamData) -> Stepper:
    opt = _torch_adam(data, lr=LR, foreach=True)
    return Stepper(opt.step, opt, data)


def torch_fused_graph(data: AdamData) -> Stepper:
    """Fused Adam replayed from a CUDA graph: capture needs a tensor lr and capturable=True."""
    import torch

    lr = torch.tensor(LR, device=data.params[0].device)
    opt = _torch_adam(data, lr=lr, fused=True, capturable=True)
    return graph_stepper(opt.step, opt, lr, data)


def _torch_adam(data: AdamData, **options):
    """torch.optim.Adam over `data`, its state preset to `data`'s moments (its lazy init
    would make them zeros)."""
    import torch

    attach_grads(data.params, data.grads)
    opt = torch.optim.Adam(data.params, eps=EPS, weight_decay=0.0, **options)
    # Where torch.optim.Adam keeps `step`: on the device for fused/capturable, else on the host.
    on_device = options.get("fused") or options.get("capturable")
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        opt.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    return opt


COMPETITORS = {
    "mtapply": Competitor(lambda data: mtapply_plan(data, "memcpy"),
                          "mtapply.adam_plan(...), table_mode='memcpy' (the default)"),
    "mtapply-unified": Competitor(lambda data: mtapply_plan(data, "unified"),
                                  "mtapply.adam_plan(..., table_mode='unified')"),
    "torch-fused": Competitor(torch_fused, "torch.optim.Adam(fused=True)"),
    "torch-fused-graph": Competitor(
        torch_fused_graph, "torch.optim.Adam(fused=True, capturable=True), CUDA graph replay"),
    "torch-foreach": Competitor(torch_foreach, "torch.optim.Adam(foreach=True)"),
}
