"""The public LAMB entry points."""
from __future__ import annotations

from . import _calls
from .plan import Plan
from .ops.lamb import LAMBSpec


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
        tensors. lr, step and global_grad_norm may be one-element float32 device arrays.
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
