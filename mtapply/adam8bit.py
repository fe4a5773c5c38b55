"""Adam/AdamW with 8-bit moments: the public entry points and the state they keep."""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import _calls, quantization
from ._dlpack import device_of, framework_of
from .plan import Plan
from .ops.adam8bit import Adam8bitSpec

THRESHOLD = 4096  # params of fewer elements keep float32 moments (as bitsandbytes does)


@dataclass
class Adam8bitState:
    """The moments of a list of params: `exp_avgs` and `exp_avg_sqs` hold uint8 codes shaped as
    the params, `exp_avg_absmax` and `exp_avg_sq_absmax` one float32 scale per block of
    `quantization.BLOCK` elements; params below the threshold keep float32 moments (and empty
    scales). Pass them to the step as `*state.lists()`."""

    exp_avgs: list
    exp_avg_sqs: list
    exp_avg_absmax: list
    exp_avg_sq_absmax: list

    def lists(self) -> tuple:
        return self.exp_avgs, self.exp_avg_sqs, self.exp_avg_absmax, self.exp_avg_sq_absmax

    def nbytes(self) -> int:
        """Bytes of all the moments and scales."""
        return sum(_nbytes(x) for column in self.lists() for x in column)


def adam8bit_state(params, *, threshold: int = THRESHOLD) -> Adam8bitState:
    """Zero moments for `params` (torch tensors, CuPy or NumPy arrays), in their framework and
    on their device: 8-bit codes for params of at least `threshold` elements, float32 below."""
    columns = ([], [], [], [])
    for i, param in enumerate(params):
        zeros = _zeros_maker(param, f"params[{i}]")
        shape, numel = tuple(param.shape), _numel(param)
        quantized = numel >= threshold
        for k in range(2):
            columns[k].append(zeros(shape, "uint8" if quantized else "float32"))
            columns[2 + k].append(zeros((quantization.n_blocks(numel) if quantized else 0,),
                                        "float32"))
    return Adam8bitState(*columns)


def adam8bit_plan(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, *,
                  decoupled_weight_decay=False, maximize=False, stochastic_rounding=False,
                  table_mode=None, stream=None) -> Plan:
    """Binds the lists of an 8-bit Adam step once (see `adam8bit_step`); `plan.step(lr=...,
    step=..., beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, seed=0, grad_scale=None,
    found_inf=None)` then updates them, one launch per group (8-bit moments; float32 moments).
    `stochastic_rounding`: bfloat16 params rounded stochastically, as `adam_plan` does.

    Example:
        >>> state = mtapply.adam8bit_state(params)
        >>> plan = mtapply.adam8bit_plan(params, grads, *state.lists(), decoupled_weight_decay=True)
        >>> for t in range(1, 11):
        ...     plan.step(lr=1e-3, step=t, weight_decay=0.01)
    """
    spec = Adam8bitSpec(decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                        stochastic_rounding=stochastic_rounding)
    return Plan(spec, _tensors(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax,
                               exp_avg_sq_absmax), table_mode=table_mode, stream=stream)


def adam8bit_step(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, *,
                  lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  decoupled_weight_decay=False, maximize=False, stochastic_rounding=False,
                  seed=0, grad_scale=None, found_inf=None, stream=None, table_mode=None) -> None:
    """One Adam/AdamW step (as `adam_step`) whose moments are stored in 8 bits per element.

    Each moment is a list of uint8 codes shaped as the params with one float32 scale per block
    of 256 elements (`exp_avg_absmax`, `exp_avg_sq_absmax`), in the blockwise dynamic format of
    `mtapply.quantization` (signed map for exp_avg, unsigned for exp_avg_sq); or, for a small
    param, float32 moments with empty scales. `adam8bit_state(params)` makes them. The kernel
    dequantizes each block, updates the param and the moments in float32, and quantizes the
    moments again with the block's fresh absolute maximum. Params and grads are float32 or
    16-bit; `stochastic_rounding` rounds bfloat16 params stochastically (see `adam_step`).
    Everything is checked before anything is written.
    """
    spec = Adam8bitSpec(decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                        stochastic_rounding=stochastic_rounding)
    spec.check_arguments(len(params), lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, seed=seed)
    _calls.step(spec, _tensors(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax,
                               exp_avg_sq_absmax), table_mode=table_mode, stream=stream, lr=lr,
                step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                seed=seed, grad_scale=grad_scale, found_inf=found_inf)


def _tensors(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax) -> dict:
    return {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
            "exp_avg_absmax": exp_avg_absmax, "exp_avg_sq_absmax": exp_avg_sq_absmax}


def _zeros_maker(param, where: str):
    """zeros(shape, dtype name) in the param's framework, on its device."""
    framework = framework_of(param)
    if framework == "torch":
        import torch

        return lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype),
                                                device=param.device)
    if framework == "cupy":
        import cupy

        def zeros(shape, dtype):
            with param.device:
                return cupy.zeros(shape, dtype)
        return zeros
    if framework == "numpy":
        import numpy

        return lambda shape, dtype: numpy.zeros(shape, dtype)
    device_of(param, where)  # a clear error for objects without DLPack
    raise TypeError(f"{where} is a {type(param).__name__}: adam8bit_state makes torch, CuPy or "
                    f"NumPy state; for other frameworks make uint8 codes and float32 scales of "
                    f"the shapes adam8bit_step documents")


def _numel(x) -> int:
    return int(math.prod(x.shape))


def _nbytes(x) -> int:
    nbytes = getattr(x, "nbytes", None)
    return int(nbytes) if nbytes is not None else _numel(x) * x.element_size()


__all__ = ["Adam8bitState", "THRESHOLD", "adam8bit_plan", "adam8bit_state", "adam8bit_step"]
