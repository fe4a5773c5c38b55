"""SGD with momentum, dampening, Nesterov momentum and weight decay."""
from __future__ import annotations

from .. import reference
from .._ranges import LR, STEP
from ._spec import OpSpec, check_number, number_or_device_scalar, seed_words


class SGDSpec(OpSpec):
    """SGD as torch.optim.SGD defines it.

    Update rule, for each element, with t the 1-based step:
        g = -grad if maximize else grad;  g += weight_decay * param
        if momentum != 0:
            b = g if t == 1 else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        param -= lr * g
    """

    name = "sgd"
    kernel_file = "sgd.cuh"
    functor = "mta::Sgd"
    written = frozenset({"params", "momentum_buffers"})
    arg_fields = ("lr", "lr_ptr", "step", "step_ptr", "momentum", "dampening", "weight_decay")
    device_scalars = ("lr", "step")

    def __init__(self, *, momentum_buffers: bool = True, nesterov: bool = False,
                 maximize: bool = False, master_weights: bool = False,
                 stochastic_rounding: bool = False):
        self.has_buffers = bool(momentum_buffers)
        self.nesterov = bool(nesterov)
        self.maximize = bool(maximize)
        if self.nesterov and not self.has_buffers:
            raise ValueError("nesterov=True needs momentum_buffers: pass one buffer per param")
        self.slots = ("params", "grads") + (("momentum_buffers",) if self.has_buffers else ())
        self.flags = (("MOMENTUM", self.has_buffers), ("NESTEROV", self.nesterov),
                      ("MAXIMIZE", self.maximize))
        self._use_master_weights(master_weights)
        self._use_stochastic_rounding(stochastic_rounding)

    def arguments(self, *, lr, step=None, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  seed=0) -> dict:
        """Checked hyperparameters; `step` is needed only with momentum (1 sets the buffers)."""
        args = {"momentum": check_number("momentum", momentum, low=0.0),
                "dampening": check_number("dampening", dampening, low=0.0, high=1.0),
                "weight_decay": check_number("weight_decay", weight_decay, low=0.0),
                "lr": number_or_device_scalar("lr", lr, LR)}
        if args["momentum"] != 0 and not self.has_buffers:
            raise ValueError(f"momentum={momentum} needs momentum_buffers: pass one buffer per "
                             f"param (torch.zeros_like), or momentum=0")
        if self.nesterov and (args["momentum"] == 0 or args["dampening"] != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening == 0, as in "
                             "torch.optim.SGD")
        if step is None and self.stochastic_rounding:
            raise TypeError("step is required with stochastic_rounding: its random bits differ "
                            "from step to step (pass the 1-based step count)")
        if step is None and args["momentum"] != 0:
            raise TypeError("step is required with momentum: pass the 1-based step count (step=1 "
                            "sets the buffers to the gradient, as torch.optim.SGD does)")
        args["step"] = 2.0 if step is None else number_or_device_scalar("step", step, STEP)
        args.update(seed_words(seed))
        return args

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        """New values of the written slots of one tensor, computed in `dtype`."""
        p, buf = reference.sgd(
            arrays["params"], arrays["grads"], arrays.get("momentum_buffers"), lr=args["lr"],
            step=args["step"], momentum=args["momentum"], dampening=args["dampening"],
            weight_decay=args["weight_decay"], nesterov=self.nesterov, maximize=self.maximize,
            dtype=dtype)
        out = {"params": p}
        if self.has_buffers:
            out["momentum_buffers"] = arrays["momentum_buffers"] if buf is None else buf
        return out


__all__ = ["SGDSpec"]
