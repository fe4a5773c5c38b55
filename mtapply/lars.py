"""The public LARS entry points."""
from __future__ import annotations

from . import _calls
from .plan import Plan
from .ops.lars import LARSSpec


def lars_plan(params, grads, momentum_buffers, *, exclude=None, master_params=None,
              table_mode=None, stream=None) -> Plan:
    """Binds LARS's tensor lists once; `plan.step(lr=..., ...)` then updates them.

    Args:
        params, grads, momentum_buffers: lists of tensors, one of each per parameter.
        exclude: optional list of one bool per param; True takes a plain momentum step with lr
            and no weight decay (biases and norm layers, as LARS training recipes do).
        master_params: optional fp32 copies of 16-bit (fp16/bf16) params, one per param. The
            kernel then updates the master (read in place of the param) and writes the param
            as the master rounded to nearest.
        table_mode, stream: as for `mtapply.adam_plan`.

    Returns:
        A `Plan`. `plan.step(lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
        eps=0.0, grad_scale=None, found_inf=None, stream=None)`: two launches whatever the number
        of tensors (per-tensor norms on the device, then the update), no host synchronisation.
    """
    tensors = {"params": params, "grads": grads, "momentum_buffers": momentum_buffers,
               "master_params": master_params}
    spec = LARSSpec(exclude=exclude, master_weights=master_params is not None)
    return Plan(spec, tensors, table_mode=table_mode, stream=stream)


def lars_step(params, grads, momentum_buffers, *, lr, momentum=0.9, weight_decay=0.0,
              trust_coefficient=0.001, eps=0.0, exclude=None, master_params=None, grad_scale=None,
              found_inf=None, step=None, stream=None, table_mode=None) -> None:
    """One LARS step over whole lists, in place (You et al. 2017; Paddle's lars_momentum).

    Per tensor: local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps),
    or lr when a norm is zero or the tensor is excluded;
    v = momentum * v + local_lr * (g + weight_decay * p);  p = p - v.
    Norms are taken of the master weights when `master_params` are given (see `lars_plan`).
    `step` is accepted for a uniform interface with the other ops and not used. Any number may
    instead be a sequence of one value per tensor (as param groups make them).
    """
    spec = LARSSpec(exclude=exclude, master_weights=master_params is not None)
    hyper = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                 trust_coefficient=trust_coefficient, eps=eps)
    spec.check_arguments(len(params), **hyper)
    tensors = {"params": params, "grads": grads, "momentum_buffers": momentum_buffers,
               "master_params": master_params}
    _calls.step(spec, tensors, table_mode=table_mode, stream=stream, grad_scale=grad_scale,
                found_inf=found_inf, **hyper)
