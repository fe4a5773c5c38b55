"""SGD: its op, the `sgd` rule of mtapply.rules.library with torch.optim.SGD's checks, and the
public entry points."""
from __future__ import annotations

from . import _calls
from .ops._spec import check_number
from .plan import Plan
from .rules import library
from .rules._spec import RuleSpec


class SGDSpec(RuleSpec):
    """SGD as torch.optim.SGD defines it: the rule `mtapply.rules.library.sgd`.

    Update rule, for each element, with t the 1-based step:
        g = -grad if maximize else grad;  g += weight_decay * param
        if momentum != 0:
            b = g if t == 1 else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        param -= lr * g
    """

    device_scalars = ("lr", "step")

    def __init__(self, *, momentum_buffers: bool = True, nesterov: bool = False,
                 maximize: bool = False, master_weights: bool = False,
                 stochastic_rounding: bool = False):
        self.has_buffers = bool(momentum_buffers)
        self.nesterov = bool(nesterov)
        self.maximize = bool(maximize)
        if self.nesterov and not self.has_buffers:
            raise ValueError("nesterov=True needs momentum_buffers: pass one buffer per param")
        rule = library.sgd(self.has_buffers, self.nesterov, self.maximize)
        super().__init__("sgd", rule.program, master_weights=master_weights,
                         stochastic_rounding=stochastic_rounding)
        self.name = "sgd"
        self.device_scalars = ("lr", "step")  # momentum and the rest are numbers, as torch's

    @property
    def options(self) -> tuple:
        variants = (("momentum", self.has_buffers), ("nesterov", self.nesterov),
                    ("maximize", self.maximize))
        return tuple(name for name, on in variants if on) + super().options

    def arguments(self, *, lr, step=None, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  seed=0) -> dict:
        """Checked hyperparameters; `step` is needed only with momentum (1 sets the buffers)."""
        momentum = check_number("momentum", momentum, low=0.0)
        dampening = check_number("dampening", dampening, low=0.0, high=1.0)
        weight_decay = check_number("weight_decay", weight_decay, low=0.0)
        if momentum != 0 and not self.has_buffers:
            raise ValueError(f"momentum={momentum} needs momentum_buffers: pass one buffer per "
                             f"param (torch.zeros_like), or momentum=0")
        if self.nesterov and (momentum == 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening == 0, as in "
                             "torch.optim.SGD")
        if step is None and self.stochastic_rounding:
            raise TypeError("step is required with stochastic_rounding: its random bits differ "
                            "from step to step (pass the 1-based step count)")
        if step is None and momentum != 0:
            raise TypeError("step is required with momentum: pass the 1-based step count (step=1 "
                            "sets the buffers to the gradient, as torch.optim.SGD does)")
        hyper = dict(lr=lr, weight_decay=weight_decay, step=2.0 if step is None else step)
        if self.has_buffers:
            hyper.update(momentum=momentum, dampening=dampening)
        if self.stochastic_rounding:
            hyper["seed"] = seed
        return super().arguments(**hyper)


def sgd_plan(params, grads, momentum_buffers=None, *, master_params=None, nesterov=False,
             maximize=False, stochastic_rounding=False, table_mode=None, stream=None) -> Plan:
    """Binds SGD's tensor lists once; `plan.step(lr=..., step=..., momentum=...)` then updates them.

    Args:
        params, grads: lists of tensors, one of each per parameter, all on one device.
        momentum_buffers: one buffer per param, needed for momentum != 0 (any values: step 1
            overwrites them with the gradient, as torch.optim.SGD does when it creates them).
        master_params: optional fp32 copies of 16-bit (fp16/bf16) params, one per param. The
            kernel then updates the master (read in place of the param) and writes the param
            as the master rounded to nearest.
        nesterov, maximize: compile-time variants, as in torch.optim.SGD.
        stochastic_rounding: bfloat16 params without master weights are stored rounded
            stochastically (mtapply.stochastic: unbiased, so small updates are not lost), with
            random bits from the step's `seed` argument (default 0), the step and each tensor's
            index in the list: the same seed and steps give the same params.
        table_mode, stream: as for `mtapply.adam_plan`.

    Returns:
        A `Plan`. `plan.step(lr, step=None, momentum=0.0, dampening=0.0, weight_decay=0.0,
        seed=0, grad_scale=None, found_inf=None, stream=None)`; lr, step, grad_scale and
        found_inf may be one-element float32 device arrays.
    """
    spec = SGDSpec(momentum_buffers=momentum_buffers is not None, nesterov=nesterov,
                   maximize=maximize, master_weights=master_params is not None,
                   stochastic_rounding=stochastic_rounding)
    tensors = {"params": params, "grads": grads, "momentum_buffers": momentum_buffers,
               "master_params": master_params}
    return Plan(spec, tensors, table_mode=table_mode, stream=stream)


def sgd_step(params, grads, momentum_buffers=None, *, lr, step=None, momentum=0.0, dampening=0.0,
             nesterov=False, weight_decay=0.0, maximize=False, master_params=None,
             stochastic_rounding=False, seed=0, grad_scale=None, found_inf=None, stream=None,
             table_mode=None) -> None:
    """One SGD step over whole lists, in place, matching torch.optim.SGD.

    `step` is the 1-based step count, required with momentum: on step 1 the buffers are set to
    the gradient (torch's first-step semantics), later steps blend into them. With momentum 0
    no buffers are needed. Everything is validated before anything is written. AMP: grads are
    divided by `grad_scale`, and a non-zero `found_inf` skips the step. `master_params`: fp32
    copies of 16-bit params, updated in their place (see `sgd_plan`). `stochastic_rounding`:
    bfloat16 params rounded stochastically, the bits keyed by `seed`, step and tensor (step is
    then required).

    Update rule (g the grad, b the buffer, t = step):
        g = -g if maximize;  g += weight_decay * p
        b = g if t == 1 else momentum * b + (1 - dampening) * g;  g = g + momentum * b if nesterov else b
        p -= lr * g
    """
    spec = SGDSpec(momentum_buffers=momentum_buffers is not None, nesterov=nesterov,
                   maximize=maximize, master_weights=master_params is not None,
                   stochastic_rounding=stochastic_rounding)
    hyper = dict(lr=lr, step=step, momentum=momentum, dampening=dampening,
                 weight_decay=weight_decay, seed=seed)
    spec.check_arguments(len(params), **hyper)
    tensors = {"params": params, "grads": grads, "momentum_buffers": momentum_buffers,
               "master_params": master_params}
    _calls.step(spec, tensors, table_mode=table_mode, stream=stream, grad_scale=grad_scale,
                found_inf=found_inf, **hyper)


__all__ = ["SGDSpec", "sgd_plan", "sgd_step"]
