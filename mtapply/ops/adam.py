"""Adam and AdamW (decoupled weight decay), with amsgrad and maximize."""
from __future__ import annotations

import numpy as np

from .. import reference
from .._ranges import LR, STEP
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

    `decay_mask` gives each tensor a factor of weight_decay (flags: 1 or 0). With `lr_labels`
    (a label index per tensor) a device lr is an array of one lr per label, each tensor reading
    its label's (mtapply.optax.multi_transform's learning rates in one call).
    """

    name = "adam"
    kernel_file = "adam.cuh"
    functor = "mta::Adam"
    written = frozenset({"params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"})
    arg_fields = ("lr", "lr_ptr", "step", "step_ptr", "beta1", "beta2", "eps", "weight_decay")
    device_scalars = ("lr", "step")

    def __init__(self, *, amsgrad: bool = False, decoupled_weight_decay: bool = False,
                 maximize: bool = False, master_weights: bool = False,
                 stochastic_rounding: bool = False, decay_mask=None, lr_labels=None):
        self.amsgrad = bool(amsgrad)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self.maximize = bool(maximize)
        self.slots = ("params", "grads", "exp_avgs", "exp_avg_sqs") + (
            ("max_exp_avg_sqs",) if self.amsgrad else ())
        self.decay_mask = None if decay_mask is None else _factors(decay_mask)
        self.lr_labels = None if lr_labels is None else _labels(lr_labels)
        self.flags = (("AMSGRAD", self.amsgrad), ("DECOUPLED", self.decoupled_weight_decay),
                      ("MAXIMIZE", self.maximize), ("DECAY_MASK", self.decay_mask is not None),
                      ("LR_LABELS", self.lr_labels is not None))
        if self.decay_mask is not None:
            self.arg_fields = self.arg_fields + ("decay_array",)
        if self.lr_labels is not None:
            self.arg_fields = self.arg_fields + ("lr_label_array",)
        self._use_master_weights(master_weights)
        self._use_stochastic_rounding(stochastic_rounding)

    def tensor_arrays(self, n_tensors: int) -> dict:
        arrays = super().tensor_arrays(n_tensors)
        if self.decay_mask is not None:
            if len(self.decay_mask) != n_tensors:
                raise ValueError(f"decay_mask has {len(self.decay_mask)} flags but params has "
                                 f"{n_tensors} tensors: pass one flag per param")
            arrays["decay_array"] = np.asarray(self.decay_mask, np.float32)
        if self.lr_labels is not None:
            if len(self.lr_labels) != n_tensors:
                raise ValueError(f"lr_labels has {len(self.lr_labels)} labels but params has "
                                 f"{n_tensors} tensors: pass one label per param")
            arrays["lr_label_array"] = np.asarray(self.lr_labels, np.int32)
        return arrays

    def scalar_count(self, name: str) -> int:
        """With lr_labels, a device lr holds one lr per label."""
        if name == "lr" and self.lr_labels is not None:
            return max(self.lr_labels, default=0) + 1
        return 1

    def scheduled_word(self, name: str) -> str | None:
        return name if name in ("lr", "step") else None  # packed as given (see `arguments`)

    def arguments(self, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  seed=0) -> dict:
        """Checked hyperparameters. lr and step are numbers or DeviceScalars (checked earlier)."""
        args = {"beta1": check_number("beta1", beta1, low=0.0, high=1.0, high_open=True),
                "beta2": check_number("beta2", beta2, low=0.0, high=1.0, high_open=True),
                "eps": check_number("eps", eps, low=0.0),
                "weight_decay": check_number("weight_decay", weight_decay, low=0.0)}
        args["lr"] = number_or_device_scalar("lr", lr, LR)
        args["step"] = number_or_device_scalar("step", step, STEP)
        args.update(seed_words(seed))
        return args

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        """New values of the written slots of one tensor, computed in `dtype`."""
        p, m, v, vmax = reference.adam(
            arrays["params"], arrays["grads"], arrays["exp_avgs"], arrays["exp_avg_sqs"],
            arrays.get("max_exp_avg_sqs"), lr=args["lr"], step=args["step"], beta1=args["beta1"],
            beta2=args["beta2"], eps=args["eps"],
            weight_decay=args["weight_decay"] * self._decay_factor(index),
            decoupled_weight_decay=self.decoupled_weight_decay, amsgrad=self.amsgrad,
            maximize=self.maximize, dtype=dtype)
        out = {"params": p, "exp_avgs": m, "exp_avg_sqs": v}
        if self.amsgrad:
            out["max_exp_avg_sqs"] = vmax
        return out

    def cpu_batchable(self) -> bool:
        return self.decay_mask is None and self.lr_labels is None

    def cpu_in_place(self, args: dict, dtype):
        """`cpu_update`'s step in place (`reference.adam_into`, the same operations); None
        with amsgrad."""
        if self.amsgrad or not self.cpu_batchable():
            return None
        options = dict(lr=args["lr"], step=args["step"], beta1=args["beta1"],
                       beta2=args["beta2"], eps=args["eps"], weight_decay=args["weight_decay"],
                       decoupled_weight_decay=self.decoupled_weight_decay,
                       maximize=self.maximize, dtype=dtype)

        def update(arrays: tuple, dests: tuple, scratch: list) -> None:
            reference.adam_into(*arrays, dests, scratch, **options)

        update.n_buffers = 3
        if dtype is np.float32:
            update.adam = options  # what the native step (mtapply._cpu_adam) takes instead
        return update

    def _decay_factor(self, index: int) -> float:
        return 1.0 if self.decay_mask is None else self.decay_mask[index]


def _factors(mask) -> list:
    """decay_mask as one factor per tensor (True/False as 1/0), each finite and >= 0."""
    factors = [float(f) for f in mask]
    for i, factor in enumerate(factors):
        if not 0 <= factor < np.inf:
            raise ValueError(f"decay_mask[{i}] is {factor!r}: give each tensor a flag, or a "
                             f"finite factor >= 0 of weight_decay")
    return factors


def _labels(labels) -> list:
    """lr_labels as one int >= 0 per tensor."""
    out = []
    for i, label in enumerate(labels):
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or label < 0:
            raise ValueError(f"lr_labels[{i}] is {label!r}: give each tensor the index (>= 0) "
                             f"of its learning rate")
        out.append(int(label))
    return out


__all__ = ["AdamSpec"]
