"""Adam (fp32, lr=1e-3, default betas, eps=1e-8, no weight decay): the data and the competitors.

Every competitor gets its own copy of the same random initial data and returns a `Stepper`
whose `step()` performs one optimizer step with the gradients already in place. Another op
(SGD, LARS) adds a module like this one with its own bytes per parameter, data and competitors.
torch is imported inside the functions so that listing the competitors needs no torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

BYTES_PER_PARAM = 28  # read p, g, m, v and write p, m, v: 7 fp32 words per parameter
LR = 1e-3
EPS = 1e-8
REFERENCE = "torch-fused"  # the peer every row's time is divided by


@dataclass
class AdamData:
    """One set of tensors of an Adam step, each a separate allocation as in a real model."""

    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list

    def clone(self) -> "AdamData":
        return AdamData(*([t.clone() for t in tensors] for tensors in self.lists()))

    def lists(self) -> tuple:
        return self.params, self.grads, self.exp_avgs, self.exp_avg_sqs


def make_data(shapes, device, seed: int = 0) -> AdamData:
    """Random tensors (never zeros, which can flatter a kernel): states as if mid-training."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    def randn(shape, scale=1.0):
        return torch.randn(shape, generator=generator, device=device).mul_(scale)

    return AdamData(params=[randn(s) for s in shapes], grads=[randn(s) for s in shapes],
                    exp_avgs=[randn(s, 0.1) for s in shapes],
                    exp_avg_sqs=[torch.rand(s, generator=generator, device=device) for s in shapes])


class Stepper:
    """A step function plus everything it uses, so that nothing it points to (a CUDA graph
    holds raw addresses) is freed before the stepper itself is dropped."""

    def __init__(self, step, *keep_alive):
        self.step = step
        self.keep_alive = keep_alive


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
    """Fused Adam captured in a CUDA graph, per the PyTorch docs: a tensor lr and
    capturable=True, a few warm-up steps on a side stream, capture, then replay."""
    import torch

    lr = torch.tensor(LR, device=data.params[0].device)
    opt = _torch_adam(data, lr=lr, fused=True, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return Stepper(graph.replay, graph, opt, lr, data)


def _torch_adam(data: AdamData, **options):
    """torch.optim.Adam over `data`: params as leaves with .grad set once, and the optimizer
    state preset to `data`'s moments (its lazy init would make them zeros)."""
    import torch

    for p, g in zip(data.params, data.grads):
        p.requires_grad_(True)  # clones of plain tensors are leaves
        p.grad = g
    opt = torch.optim.Adam(data.params, eps=EPS, weight_decay=0.0, **options)
    # Where torch.optim.Adam keeps `step`: on the device for fused/capturable, else on the host.
    on_device = options.get("fused") or options.get("capturable")
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        opt.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
    return opt


@dataclass(frozen=True)
class Competitor:
    build: object  # AdamData -> Stepper
    description: str


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
