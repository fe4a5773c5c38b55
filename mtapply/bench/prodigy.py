"""Prodigy (fp32; prodigyopt's defaults, lr=1.0, weight_decay=0.01 decoupled): its step size is
scalar state fed by two whole-list sums each step. mtapply's rule plan and mtapply.torch.Prodigy
against prodigyopt.Prodigy (per-tensor torch ops, two host reads of sums per step) where it is
installed."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .common import (Competitor, Stepper, TensorLists, generator, params_with_grads,
                     randn_list)

NAME = "prodigy"
DESCRIPTION = "prodigy fp32 (mtapply.rules.library.prodigy), lr=1.0, wd=0.01 decoupled"
# pass 1 (the sums) reads p, g, s, p0; pass 2 reads p, g, m, v, s, p0 and writes p, m, v, s. The
# read-only first pass streams faster than a copy, so a step may come in under this floor.
BYTES_PER_PARAM = 56
REFERENCE = "prodigyopt"
DEFAULT_WORKLOADS = ("gpt2-124M", "small10k")
TARGETS = {"gpt2-124M": ("x_floor", 1.1)}
WEIGHT_DECAY = 0.01


@dataclass
class ProdigyData(TensorLists):
    params: list
    grads: list


def make_data(shapes, device, seed: int = 0) -> ProdigyData:
    gen = generator(device, seed)
    return ProdigyData(randn_list(shapes, gen), randn_list(shapes, gen))


def mtapply_plan(data: ProdigyData) -> Stepper:
    import torch

    from mtapply.rules import library

    rule = library.prodigy()
    state = [[torch.zeros_like(p) for p in data.params] for _ in range(3)]
    p0 = [p.clone() for p in data.params]
    scalars = torch.tensor(rule.initial_scalars(), device=data.params[0].device)
    plan = rule.plan(data.params, data.grads, *state, p0)
    counter = itertools.count(1)

    def step():
        plan.step(step=next(counter), beta3=math.sqrt(0.999), weight_decay=WEIGHT_DECAY,
                  scalars_out=scalars)

    return Stepper(step, plan, state, p0, scalars, data)



def mtapply_torch(data: ProdigyData) -> Stepper:
    import mtapply.torch as mt

    opt = mt.Prodigy(params_with_grads(data), weight_decay=WEIGHT_DECAY)
    return Stepper(opt.step, opt, data)


def prodigyopt(data: ProdigyData) -> Stepper:
    from prodigyopt import Prodigy

    opt = Prodigy(params_with_grads(data), weight_decay=WEIGHT_DECAY)
    return Stepper(opt.step, opt, data)


COMPETITORS = {
    "mtapply": Competitor(mtapply_plan, "mtapply.rules.library.prodigy().plan(...).step"),
    "mtapply-torch": Competitor(mtapply_torch, "mtapply.torch.Prodigy(...).step()"),
    "prodigyopt": Competitor(prodigyopt, "prodigyopt.Prodigy (torch ops per tensor)"),
}
