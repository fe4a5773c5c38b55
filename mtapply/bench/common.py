"""What every op's data and competitors share: tensor lists, steppers, random data, graphs.

torch is imported inside the functions so that listing the ops and competitors needs no torch.
"""
from __future__ import annotations

import dataclasses
import os
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

    def __init__(self, step, *keep_alive, sync=None, moves=None, note=None, first_call_s=None):
        self.step = step
        self.keep_alive = keep_alive
        self.sync = sync
        self.moves = moves
        self.note = note
        self.first_call_s = first_call_s  # seconds of the first step (JAX: trace and compile)


@dataclass(frozen=True)
class Competitor:
    build: object  # the op's data -> Stepper
    description: str
    mixed_only: bool = False  # on an all-fp32 workload it would repeat another row
    fp32_only: bool = False  # it runs fp32 copies of the data only


def params_with_grads(data) -> list:
    """The data's params, each with its grad attached (for torch.optim-style optimizers)."""
    for p, g in zip(data.params, data.grads):
        p.requires_grad_(True)
        p.grad = g
    return data.params


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


def import_jax():
    """(jax, optax). JAX would otherwise reserve most of the GPU's memory at its first use,
    leaving too little for the rows and workloads that follow."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import optax
    except ImportError as error:
        raise RuntimeError(f"needs jax (with CUDA) and optax: {error}") from None
    return jax, optax


def jax_lists(lists) -> list:
    """JAX copies of torch tensor lists, on the JAX device of the tensors' GPU."""
    jax, _ = import_jax()
    index = lists[0][0].device.index or 0 if lists and lists[0] else 0
    device = jax.devices("gpu")[index]
    return [[jax.device_put(t.cpu().numpy(), device) for t in tensors] for tensors in lists]


def optax_state(optimizer, params, **slots):
    """optimizer's initial state with `slots` (e.g. mu=..., nu=...) set to the given pytrees,
    built without running init eagerly: optax's eager init compiles one zeros_like per leaf
    shape (minutes on small10k)."""
    jax, optax = import_jax()
    state = optax.tree_utils.tree_set(jax.eval_shape(optimizer.init, params), **slots)
    return jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype)
                        if isinstance(x, jax.ShapeDtypeStruct) else x, state)


def transformation_step(optimizer):
    """params, state = step(params, state, grads) with an optax transformation."""
    jax, optax = import_jax()

    def update(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(update, donate_argnums=(0, 1))


def fused_step(optimizer):
    """The same with an mtapply.optax fused optimizer."""
    jax, _ = import_jax()
    return jax.jit(lambda params, state, grads: optimizer.step(params, grads, state),
                   donate_argnums=(0, 1))


class JaxLoop:
    """`params, state = step(params, state, grads)` once per step: a jitted step whose params
    and state are donated, so that XLA updates them in place. JAX runs on its own streams: the
    harness times it by wall clock, waiting with jax.block_until_ready."""

    def __init__(self, step, params, state, grads):
        self.update, self.params, self.state, self.grads = step, params, state, grads

    def step(self) -> None:
        self.params, self.state = self.update(self.params, self.state, self.grads)

    def sync(self) -> None:
        import jax

        jax.block_until_ready((self.params, self.state))

    def stepper(self) -> Stepper:
        """The stepper, after a first step whose time (tracing and compilation) it notes."""
        import time

        start = time.perf_counter()
        self.step()
        self.sync()
        first = time.perf_counter() - start
        return Stepper(self.step, self, sync=self.sync, first_call_s=first)
