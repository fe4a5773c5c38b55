"""LAMB: its op, the `lamb` rule of mtapply.rules.library with Apex FusedLAMB's checks, and
the public entry points."""
from __future__ import annotations

from . import _calls
from .ops._spec import check_number
from .plan import Plan
from .rules import library
from .rules._spec import RuleSpec


class LAMBSpec(RuleSpec):
    """LAMB as Apex's FusedLAMB defines it: the rule `mtapply.rules.library.lamb`, per tensor
    (t the 1-based step):
        g = grad / clip   (clip = global_grad_norm / max_grad_norm when that exceeds 1)
        g += weight_decay * p                         (L2 mode, adam_w_mode=False)
        m = beta1 * m + (1 - beta1) * g  (or + g without grad_averaging)
        v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)  (+ weight_decay * p, AdamW mode)
        p -= lr * ratio * u,  ratio = ||p|| / ||u|| if weight_decay != 0 or use_nvlamb, else 1
             (1 when either norm is zero)
    Two launches whatever the number of tensors where the moments are float32: the moments
    (stored) and both norms, then the update; with moments of another type (bfloat16, float16)
    one, whose blocks sum the norms and then update (kernels/walker.cuh, walk_fused).
    Differences from Apex: the global gradient norm is an input (a number or a device scalar)
    rather than computed inside the step; grads are left as they are (Apex overwrites them
    with the update). The norms are float32 sums.
    """

    def __init__(self, *, adam_w_mode: bool = True, use_nvlamb: bool = False,
                 master_weights: bool = False):
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        rule = library.lamb(self.adam_w_mode, self.use_nvlamb)
        super().__init__("lamb", rule.program, master_weights=master_weights)
        self.name = "lamb"
        self.device_scalars = ("lr", "step", "global_grad_norm")

    @property
    def options(self) -> tuple:
        variants = (("adamw", self.adam_w_mode), ("nvlamb", self.use_nvlamb))
        return tuple(name for name, on in variants if on) + super().options

    def arguments(self, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                  grad_averaging=True, bias_correction=True, max_grad_norm=0.0,
                  global_grad_norm=None) -> dict:
        """Checked hyperparameters; clipping (max_grad_norm > 0) needs global_grad_norm."""
        numbers = {"beta1": check_number("beta1", beta1, low=0.0, high=1.0, high_open=True),
                   "beta2": check_number("beta2", beta2, low=0.0, high=1.0, high_open=True),
                   "eps": check_number("eps", eps, low=0.0),
                   "weight_decay": check_number("weight_decay", weight_decay, low=0.0),
                   "max_grad_norm": check_number("max_grad_norm", max_grad_norm, low=0.0)}
        if numbers["max_grad_norm"] > 0 and global_grad_norm is None:
            raise TypeError("max_grad_norm > 0 clips by the global gradient norm: pass "
                            "global_grad_norm (a number or a one-element device array)")
        return super().arguments(lr=lr, step=step, **numbers,
                                 grad_averaging=1.0 if grad_averaging else 0.0,
                                 bias_correction=1.0 if bias_correction else 0.0,
                                 global_grad_norm=0.0 if global_grad_norm is None
                                 else global_grad_norm)


def lamb_plan(params, grads, exp_avgs, exp_avg_sqs, *, master_params=None, adam_w_mode=True,
              use_nvlamb=False, table_mode=None, stream=None) -> Plan:
    """Binds LAMB's tensor lists once; `plan.step(lr=..., step=..., ...)` then updates them.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: lists of tensors, one of each per parameter.
        master_params: optional fp32 copies of 16-bit (fp16/bf16) params, one per param. The
            kernel then updates the master (read in place of the param) and writes the param
            as the master rounded to nearest.
        adam_w_mode: decoupled weight decay (True, Apex's default) or L2 added to the gradient.
        use_nvlamb: apply the trust ratio even when weight_decay is 0.
        table_mode, stream: as for `mtapply.adam_plan`.

    Returns:
        A `Plan`. `plan.step(lr, step, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
        grad_averaging=True, bias_correction=True, max_grad_norm=0.0, global_grad_norm=None,
        grad_scale=None, found_inf=None, stream=None)`: two launches whatever the number of
        tensors (one where the moments are not float32). lr, step and global_grad_norm may be
        one-element float32 device arrays.
    """
    spec = LAMBSpec(adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
                    master_weights=master_params is not None)
    tensors = {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "grads": grads,
               "master_params": master_params}
    return Plan(spec, tensors, table_mode=table_mode, stream=stream)


def lamb_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-6,
              weight_decay=0.01, adam_w_mode=True, grad_averaging=True, bias_correction=True,
              max_grad_norm=0.0, global_grad_norm=None, use_nvlamb=False, master_params=None,
              grad_scale=None, found_inf=None, stream=None, table_mode=None) -> None:
    """One LAMB step over whole lists, in place, with Apex FusedLAMB's semantics.

    See `mtapply.LAMBSpec` for the update rule. Global gradient-norm clipping divides the grads
    by global_grad_norm / max_grad_norm when that exceeds 1; the norm is an input (for example
    `mtapply.l2_norms(grads)[1]`). `master_params`: fp32 copies of 16-bit params (see `lamb_plan`).
    Any number but global_grad_norm may instead be a sequence of one value per tensor.
    """
    spec = LAMBSpec(adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
                    master_weights=master_params is not None)
    hyper = dict(lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 grad_averaging=grad_averaging, bias_correction=bias_correction,
                 max_grad_norm=max_grad_norm, global_grad_norm=global_grad_norm)
    spec.check_arguments(len(params), **hyper)
    tensors = {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "grads": grads,
               "master_params": master_params}
    _calls.step(spec, tensors, table_mode=table_mode, stream=stream, grad_scale=grad_scale,
                found_inf=found_inf, **hyper)


__all__ = ["LAMBSpec", "lamb_plan", "lamb_step"]
