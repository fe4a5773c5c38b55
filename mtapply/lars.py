"""LARS: its op, the `lars` rule of mtapply.rules.library with an `exclude` list, and the
public entry points."""
from __future__ import annotations

from . import _calls
from .ops._spec import check_number
from .plan import Plan
from .rules import library
from .rules._spec import RuleSpec


class LARSSpec(RuleSpec):
    """LARS as Paddle's lars_momentum and You et al. define it: the rule
    `mtapply.rules.library.lars`, per tensor:
        local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
                   (lr when a norm is zero)
        v = momentum * v + local_lr * (g + weight_decay * p);   p = p - v
    Tensors listed in `exclude` (biases, norm layers) take plain momentum steps with lr and no
    weight decay: the rule's `adapt` and `decay_on`, 0 for them, are fixed with the plan. One
    launch per step whatever the number of tensors: its blocks sum ||p||^2 and ||g||^2 of each
    tensor on the device, then update it (kernels/walker.cuh, walk_fused). The sums are float32 (float64 params included), on
    the CPU as on the GPU.
    """

    def __init__(self, *, exclude=None, master_weights: bool = False):
        self.exclude = None if exclude is None else [bool(e) for e in exclude]
        values = None
        if self.exclude is not None:
            kept = [0.0 if e else 1.0 for e in self.exclude]
            values = {"adapt": kept, "decay_on": kept}
        super().__init__("lars", library.lars().program, master_weights=master_weights,
                         tensor_values=values)
        self.name = "lars"
        self.device_scalars = ("lr",)  # the others are numbers, as the peers take them

    def tensor_arrays(self, n_tensors: int) -> dict:
        if self.exclude is not None and len(self.exclude) != n_tensors:
            raise ValueError(f"exclude has {len(self.exclude)} entries but params has "
                             f"{n_tensors}: pass one flag per param")
        return super().tensor_arrays(n_tensors)

    def scheduled_word(self, name: str) -> str | None:
        return super().scheduled_word(name) if name == "lr" else None  # the step is unused

    def arguments(self, *, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                  eps=0.0, step=None) -> dict:
        """Checked hyperparameters. `step` is accepted for a uniform interface and unused."""
        numbers = {name: check_number(name, value, low=0.0) for name, value in (
            ("momentum", momentum), ("weight_decay", weight_decay),
            ("trust_coefficient", trust_coefficient), ("eps", eps))}
        if self.exclude is None:  # the rule's own: every tensor adapted and decayed
            numbers.update(adapt=1.0, decay_on=1.0)
        return super().arguments(lr=lr, **numbers)


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
        eps=0.0, grad_scale=None, found_inf=None, stream=None)`: one launch whatever the number
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


__all__ = ["LARSSpec", "lars_plan", "lars_step"]
