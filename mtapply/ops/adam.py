"""Adam and AdamW (decoupled weight decay), with amsgrad and maximize."""
from __future__ import annotations

import numpy as np

from .. import reference
from ._spec import OpSpec, check_number, number_or_device_scalar, seed_words


class AdamSpec(OpSpec):
    """Adam/AdamW as torch.optim.Adam and AdamW define them.

    Update rule, for each element, with t the 1-based step:
        g = -grad if maximize else grad
        g += weight_decay * param            (L2, when not decoupled)
        param *= 1 - lr * weight_decay       (AdamW, when decoupled)
    (with `decay_mask`, a flag per tensor, weight_decay is 0 where the flag is False)
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        vmax = max(vmax, v)                  (amsgrad; vmax replaces v below)
        param -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    """

    name = "adam"
    kernel_file = "adam.cuh"
    functor = "mta::Adam"
    written = frozenset({"params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"})
    arg_fields = ("lr", "lr_ptr", "step", "step_ptr", "beta1", "beta2", "eps", "weight_decay")
    device_scalars = ("lr", "step")

    def __init__(self, *, amsgrad: bool = False, decoupled_weight_decay: bool = False,
                 maximize: bool = False, master_weights: bool = False,
                 stochastic_rounding: bool = False, decay_mask=None):
        self.amsgrad = bool(amsgrad)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.maximize = bool(maximize)
        self.slots = ("params", "grads", "exp_avgs", "exp_avg_sqs") + (
            ("max_exp_avg_sqs",) if self.amsgrad else ())
        self.decay_mask = None if decay_mask is None else [bool(flag) for flag in decay_mask]
        self.flags = (("AMSGRAD", self.amsgrad), ("DECOUPLED", self.decoupled_weight_decay),
                      ("MAXIMIZE", self.maximize), ("DECAY_MASK", self.decay_mask is not None))
        if self.decay_mask is not None:
            self.arg_fields = self.arg_fields + ("decay_array",)
        self._use_master_weights(master_weights)
        self._use_stochastic_rounding(stochastic_rounding)

    def tensor_arrays(self, n_tensors: int) -> dict:
        arrays = super().tensor_arrays(n_tensors)
        if self.decay_mask is not None:
            if len(self.decay_mask) != n_tensors:
                raise ValueError(f"decay_mask has {len(self.decay_mask)} flags but params has "
                                 f"{n_tensors} tensors: pass one flag per param")
            arrays["decay_array"] = np.asarray(self.decay_mask, np.float32)
        return arrays

    def arguments(self, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  seed=0) -> dict:
        """Checked hyperparameters. lr and step are numbers or DeviceScalars (checked earlier)."""
        args = {"beta1": check_number("beta1", beta1, low=0.0, high=1.0, high_open=True),
                "beta2": check_number("beta2", beta2, low=0.0, high=1.0, high_open=True),
                "eps": check_number("eps", eps, low=0.0),
                "weight_decay": check_number("weight_decay", weight_decay, low=0.0)}
        args["lr"] = number_or_device_scalar("lr", lr, low=0.0)
        args["step"] = number_or_device_scalar("step", step, low=1.0)
        args.update(seed_words(seed))
        return args

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        """New values of the written slots of one tensor, computed in `dtype`."""
        p, m, v, vmax = reference.adam(
            arrays["params"], arrays["grads"], arrays["exp_avgs"], arrays["exp_avg_sqs"],
            arrays.get("max_exp_avg_sqs"), lr=args["lr"], step=args["step"], beta1=args["beta1"],
            beta2=args["beta2"], eps=args["eps"],
            weight_decay=args["weight_decay"] if self._decays(index) else 0.0,
            decoupled_weight_decay=self.decoupled_weight_decay, amsgrad=self.amsgrad,
            maximize=self.maximize, dtype=dtype)
        out = {"params": p, "exp_avgs": m, "exp_avg_sqs": v}
        if self.amsgrad:
            out["max_exp_avg_sqs"] = vmax
        return out

    def _decays(self, index: int) -> bool:
        return self.decay_mask is None or self.decay_mask[index]


__all__ = ["AdamSpec"]
