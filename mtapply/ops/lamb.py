"""LAMB: layer-wise adaptive moments (You et al. 2019), with Apex FusedLAMB's semantics."""
from __future__ import annotations

from .. import reference
from .._ranges import LR, NORM, STEP
from ._spec import OpSpec, check_number, number_or_device_scalar


class LAMBSpec(OpSpec):
    """LAMB as Apex's FusedLAMB defines it, per tensor (t the 1-based step):

        g = grad / clip   (clip = global_grad_norm / max_grad_norm when that exceeds 1)
        g += weight_decay * p                         (L2 mode, adam_w_mode=False)
        m = beta1 * m + (1 - beta1) * g  (or + g without grad_averaging)
        v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)  (+ weight_decay * p, AdamW mode)
        p -= lr * ratio * u,  ratio = ||p|| / ||u|| if weight_decay != 0 or use_nvlamb, else 1
             (1 when either norm is zero)

    Two launches whatever the number of tensors: moments and both norms, then the update.
    Differences from Apex: the global gradient norm is an input (a number or a device scalar)
    rather than computed inside the step; grads are left as they are (Apex overwrites them with
    the update); and the update pass recomputes the update from the moments as stored, so with
    16-bit moments it uses their rounded values (keep moments in fp32 for mixed precision).
    """

    name = "lamb"
    kernel_file = "lamb.cuh"
    functor = "mta::Lamb"
    functors = ("mta::LambMoments", "mta::Lamb")
    n_sums = 2
    # grads last: the update pass reads only params and moments
    slots = ("params", "exp_avgs", "exp_avg_sqs", "grads")
    written = frozenset({"params", "exp_avgs", "exp_avg_sqs"})
    arg_fields = ("lr", "lr_ptr", "step", "step_ptr", "beta1", "beta2", "eps", "weight_decay",
                  "grad_averaging", "bias_correction", "max_grad_norm", "global_grad_norm",
                  "global_grad_norm_ptr")
    device_scalars = ("lr", "step", "global_grad_norm")
    ranges = {"global_grad_norm": NORM}

    def __init__(self, *, adam_w_mode: bool = True, use_nvlamb: bool = False,
                 master_weights: bool = False):
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        self.flags = (("ADAMW", self.adam_w_mode), ("NVLAMB", self.use_nvlamb))
        self._use_master_weights(master_weights)

    def arguments(self, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                  grad_averaging=True, bias_correction=True, max_grad_norm=0.0,
                  global_grad_norm=None) -> dict:
        """Checked hyperparameters; clipping (max_grad_norm > 0) needs global_grad_norm."""
        args = {"beta1": check_number("beta1", beta1, low=0.0, high=1.0, high_open=True),
                "beta2": check_number("beta2", beta2, low=0.0, high=1.0, high_open=True),
                "eps": check_number("eps", eps, low=0.0),
                "weight_decay": check_number("weight_decay", weight_decay, low=0.0),
                "grad_averaging": 1.0 if grad_averaging else 0.0,
                "bias_correction": 1.0 if bias_correction else 0.0,
                "max_grad_norm": check_number("max_grad_norm", max_grad_norm, low=0.0),
                "lr": number_or_device_scalar("lr", lr, LR),
                "step": number_or_device_scalar("step", step, STEP)}
        if args["max_grad_norm"] > 0 and global_grad_norm is None:
            raise TypeError("max_grad_norm > 0 clips by the global gradient norm: pass "
                            "global_grad_norm (a number or a one-element device array)")
        args["global_grad_norm"] = (0.0 if global_grad_norm is None else
                                    number_or_device_scalar("global_grad_norm", global_grad_norm,
                                                            NORM))
        return args

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        p, m, v = reference.lamb(
            arrays["params"], arrays["grads"], arrays["exp_avgs"], arrays["exp_avg_sqs"],
            lr=args["lr"], step=args["step"], beta1=args["beta1"], beta2=args["beta2"],
            eps=args["eps"], weight_decay=args["weight_decay"], adam_w_mode=self.adam_w_mode,
            grad_averaging=bool(args["grad_averaging"]), bias_correction=bool(args["bias_correction"]),
            max_grad_norm=args["max_grad_norm"], global_grad_norm=args["global_grad_norm"],
            use_nvlamb=self.use_nvlamb, dtype=dtype)
        return {"params": p, "exp_avgs": m, "exp_avg_sqs": v}


__all__ = ["LAMBSpec"]
