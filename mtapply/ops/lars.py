"""LARS: layer-wise adaptive rate scaling with momentum (You et al. 2017)."""
from __future__ import annotations

import numpy as np

from .. import reference
from .._ranges import LR
from ._spec import OpSpec, check_number, number_or_device_scalar


class LARSSpec(OpSpec):
    """LARS as Paddle's lars_momentum and You et al. define it, per tensor:

        local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
                   (lr when a norm is zero)
        v = momentum * v + local_lr * (g + weight_decay * p);   p = p - v

    Tensors listed in `exclude` (biases, norm layers) take plain momentum steps with lr and no
    weight decay. Two launches per step whatever the number of tensors: one sums ||p||^2 and
    ||g||^2 of every tensor on the device, the next updates.
    """

    name = "lars"
    kernel_file = "lars.cuh"
    functor = "mta::Lars"
    functors = ("mta::LarsNorms", "mta::Lars")
    n_sums = 2
    slots = ("params", "grads", "momentum_buffers")
    written = frozenset({"params", "momentum_buffers"})
    flags = ()
    arg_fields = ("lr", "lr_ptr", "momentum", "weight_decay", "trust_coefficient", "eps",
                  "adapt_array")
    device_scalars = ("lr",)

    def __init__(self, *, exclude=None, master_weights: bool = False):
        self.exclude = None if exclude is None else [bool(e) for e in exclude]
        self._use_master_weights(master_weights)

    def tensor_arrays(self, n_tensors: int) -> dict:
        if self.exclude is not None and len(self.exclude) != n_tensors:
            raise ValueError(f"exclude has {len(self.exclude)} entries but params has "
                             f"{n_tensors}: pass one flag per param")
        adapt = np.ones(n_tensors, np.float32)
        if self.exclude is not None:
            adapt[np.asarray(self.exclude, dtype=bool)] = 0.0
        return {"adapt_array": adapt}

    def arguments(self, *, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                  eps=0.0, step=None) -> dict:
        """Checked hyperparameters. `step` is accepted for a uniform interface and unused."""
        return {"lr": number_or_device_scalar("lr", lr, LR),
                "momentum": check_number("momentum", momentum, low=0.0),
                "weight_decay": check_number("weight_decay", weight_decay, low=0.0),
                "trust_coefficient": check_number("trust_coefficient", trust_coefficient, low=0.0),
                "eps": check_number("eps", eps, low=0.0)}

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        adapt = self.exclude is None or not self.exclude[index]
        p, v = reference.lars(arrays["params"], arrays["grads"], arrays["momentum_buffers"],
                              lr=args["lr"], momentum=args["momentum"],
                              weight_decay=args["weight_decay"],
                              trust_coefficient=args["trust_coefficient"], eps=args["eps"],
                              adapt=adapt, dtype=dtype)
        return {"params": p, "momentum_buffers": v}


__all__ = ["LARSSpec"]
