"""What every op's data and competitors share: tensor lists, steppers, random data, graphs.

torch is imported inside the functions so that listing the ops and competitors needs no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class TensorLists:
    """Base of an op's data: a dataclass whose fields are all lists of tensors, one tensor per
    parameter, each a separate allocation as in a real model."""

    def lists(self) -> tuple:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def clone(self):
        return type(self)(*([t.clone() for t in tensors] for tensors in self.lists()))


class Stepper:
    """A step function plus everything it uses, so that nothing it points to (a CUDA graph
    holds raw addresses) is freed before the stepper itself is dropped.

    `sync`, for a step whose work runs outside torch's streams (JAX), waits for that work; the
    harness then times the step by wall clock alone, since CUDA events on torch's stream would
    not see it. `moves`, for a step that moves other than the op's floor bytes per parameter
    (a peer keeping its states in the params' low precision), is what it moves; `note` says
    what the row's reader must know about it."""

    def __init__(self, step, *keep_alive, sync=None, moves=None, note=None):
        self.step = step
        self.keep_alive = keep_alive
        self.sync = sync
        self.moves = moves
        self.note = note


@dataclass(frozen=True)
class Competitor:
    build: object  # the op's data -> Stepper
    description: str
    mixed_only: bool = False  # on an all-fp32 workload it would repeat another row


def generator(device, seed: int):
    """A seeded generator on `device`, so every op draws the same numbers for a given seed."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def randn_list(shapes, generator, scale: float = 1.0) -> list:
    """One normal tensor per shape, on the generator's device, times `scale`."""
    import torch

    return [torch.randn(shape, generator=generator, device=generator.device).mul_(scale)
            for shape in shapes]


def cast_list(tensors: list, dtype: str) -> list:
    """`tensors` stored as `dtype` (a torch dtype name); the same tensors where they already are."""
    import torch

    return [t.to(getattr(torch, dtype)) for t in tensors]


def attach_grads(params: list, grads: list) -> None:
    """Makes `params` leaves with `.grad` set once, as torch.optim finds them after backward."""
    for p, g in zip(params, grads):
        p.requires_grad_(True)  # clones of plain tensors are leaves
        p.grad = g


def graph_stepper(step, *keep_alive, **notes) -> Stepper:
    """`step` captured in a CUDA graph, per the PyTorch docs: a few warm-up steps on a side
    stream, capture, then every step is a replay. `notes`: Stepper's `moves` and `note`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return Stepper(graph.replay, graph, *keep_alive, **notes)
