"""Adafactor (fp32; torch.optim.Adafactor's defaults, lr=1e-2): data, competitors, targets.

The floor counts the params and grads only (read p and g, write p: 12 B/param); the factored
second moment (a row and a column vector per matrix, a full variance for the others) adds about
0.01 B/param on GPT-2, so each row's note gives its state's bytes per param. torch's rows are
torch.optim.Adafactor with foreach=True (its default on CUDA lists) and with foreach=False;
JAX's are optax.adafactor under jit and mtapply.optax.adafactor, a different update (optax's
chain: clipping, param scale, decay_rate) that its rows share with each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, fused_step, generator,
                     jax_lists, optax_state, params_with_grads, randn_list, transformation_step)

NAME = "adafactor"
DESCRIPTION = ("adafactor fp32 (torch.optim.Adafactor's defaults, lr=1e-2; optax.adafactor's, "
               "lr=1e-2), floor: p read and written, g read (factored state left out)")
BYTES_PER_PARAM = 12  # read p, g and write p; the row and column vectors are negligible
REFERENCE = "torch-foreach"
DEFAULT_WORKLOADS = ("gpt2-124M", "t5-base")
TARGETS = {name: (("x_torch_foreach_gpu", 0.2), ("x_floor", 1.3))
           for name in DEFAULT_WORKLOADS}
LR = 1e-2
OPTAX_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor


@dataclass
class AdafactorData(TensorLists):
    params: list
    grads: list


def make_data(shapes, device, seed: int = 0) -> AdafactorData:
    """Random params and grads; the state starts at zero, as both libraries initialize it."""
    gen = generator(device, seed)
    return AdafactorData(randn_list(shapes, gen, 0.02), randn_list(shapes, gen))


def state_bytes_per_param(shapes, min_dim: int | None = None) -> float:
    """fp32 bytes of the second moment per param: for a factored param a row and a column
    vector (their lengths: the product of the other dimensions, times one of the pair), for
    the others the full variance. torch (`min_dim` None) factors any param of two or more
    dimensions over its last two; optax over its two largest, where the smaller is at least
    `min_dim`."""
    state = 0
    for shape in shapes:
        pair = sorted(shape)[-2:] if min_dim is not None else list(shape[-2:])
        if len(shape) >= 2 and min(pair) >= (min_dim or 0):
            state += math.prod(shape) // max(pair[0], 1) + math.prod(shape) // max(pair[1], 1)
        else:
            state += math.prod(shape)
    params = sum(math.prod(shape) for shape in shapes)
    return 4 * state / max(params, 1)


def _state_note(data, min_dim: int | None = None) -> str:
    shapes = [tuple(p.shape) for p in data.params]
    return (f"state {state_bytes_per_param(shapes, min_dim):.4f} B/param on "
            f"{len(shapes)} tensors (factored second moment)")


def mtapply_torch(data: AdafactorData) -> Stepper:
    import mtapply.torch as mt

    opt = mt.Adafactor(params_with_grads(data), lr=LR)
    return Stepper(opt.step, opt, data, note=_state_note(data))


def torch_adafactor(data: AdafactorData, foreach: bool) -> Stepper:
    import torch

    opt = torch.optim.Adafactor(params_with_grads(data), lr=LR, foreach=foreach)
    return Stepper(opt.step, opt, data, note=_state_note(data))


def optax_jit(data: AdafactorData) -> Stepper:
    """optax.adafactor under jax.jit, params and state donated."""
    import optax

    params, grads = jax_lists(data.lists())
    optimizer = optax.adafactor(LR)
    loop = JaxLoop(transformation_step(optimizer), params, optax_state(optimizer, params), grads)
    stepper = loop.stepper()
    stepper.note = _state_note(data, OPTAX_MIN_DIM)
    return stepper


def mtapply_optax(data: AdafactorData, fused: bool, flat_state: bool = False) -> Stepper:
    """mtapply.optax.adafactor (its state optax's, or flat) or its fused step under jax.jit:
    on a GPU its factored rule's kernels in the XLA FFI call."""
    import mtapply.optax as mtx

    params, grads = jax_lists(data.lists())
    optimizer = mtx.fused_adafactor(LR) if fused else mtx.adafactor(LR, flat_state=flat_state)
    step = fused_step(optimizer) if fused else transformation_step(optimizer)
    loop = JaxLoop(step, params, optax_state(optimizer, params), grads)
    stepper = loop.stepper()
    stepper.note = _state_note(data, OPTAX_MIN_DIM)
    return stepper


COMPETITORS = {
    "mtapply": Competitor(mtapply_torch, "mtapply.torch.Adafactor(...).step()"),
    "torch-foreach": Competitor(lambda data: torch_adafactor(data, foreach=True),
                                "torch.optim.Adafactor(foreach=True)"),
    "torch-loop": Competitor(lambda data: torch_adafactor(data, foreach=False),
                             "torch.optim.Adafactor(foreach=False), tensor by tensor"),
    "optax-adafactor": Competitor(optax_jit, "optax.adafactor under jax.jit, donated"),
    "mtapply-optax": Competitor(lambda data: mtapply_optax(data, fused=False),
                                "mtapply.optax.adafactor under jax.jit, donated"),
    "mtapply-optax-flat": Competitor(
        lambda data: mtapply_optax(data, fused=False, flat_state=True),
        "mtapply.optax.adafactor(flat_state=True) under jax.jit, donated"),
    "mtapply-optax-fused": Competitor(lambda data: mtapply_optax(data, fused=True),
                                      "mtapply.optax.fused_adafactor(...).step under jax.jit"),
}
