"""The public Adam/AdamW entry points."""
from __future__ import annotations

from . import _calls
from .plan import Plan
from .ops.adam import AdamSpec


def adam_plan(params, grads, exp_avgs, exp_avg_sqs, *, max_exp_avg_sqs=None, master_params=None,
              amsgrad=False, decoupled_weight_decay=False, maximize=False,
              stochastic_rounding=False, table_mode=None, stream=None) -> Plan:
    """Binds Adam's tensor lists once; `plan.step(lr=..., step=..., ...)` then updates them.

    Args:
        params, grads, exp_avgs, exp_avg_sqs: lists of tensors (torch, CuPy, NumPy, any DLPack
            producer), one of each per parameter, all on one device. grads are only read.
        max_exp_avg_sqs: the amsgrad state list, required when amsgrad is True.
        master_params: optional fp32 copies of 16-bit (fp16/bf16) params, one per param. The
            kernel then updates the master (read in place of the param) and writes the param
            as the master rounded to nearest.
        amsgrad, decoupled_weight_decay, maximize: compile-time variants, as in torch.optim.Adam
            (decoupled_weight_decay=True is AdamW).
        stochastic_rounding: bfloat16 params without master weights are stored rounded
            stochastically (mtapply.stochastic: unbiased, so small updates are not lost), with
            random bits from the step's `seed` argument (default 0), the step and each tensor's
            index in the list: the same seed and steps give the same params.
        table_mode: "memcpy" (default) or "unified": where the device pointer tables live.
        stream: default launch stream; None uses the tensors' framework's current stream.

    Returns:
        A `Plan`. `plan.step(lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        seed=0, grad_scale=None, found_inf=None, stream=None)` takes the per-step hyperparameters; lr,
        step, grad_scale and found_inf may be one-element float32 device arrays, read by the
        kernel (no host synchronisation; CUDA-graph safe). `plan.count_steps(counter)` keeps
        the count in a one-element float32 device array instead: each step reads it plus one
        and advances it in its own launches, and `step=` is left out.

    Example:
        >>> plan = mtapply.adam_plan(params, grads, exp_avgs, exp_avg_sqs)
        >>> for t in range(1, 11):
        ...     plan.step(lr=1e-3, step=t)
    """
    spec = AdamSpec(amsgrad=amsgrad, decoupled_weight_decay=decoupled_weight_decay,
                    maximize=maximize, master_weights=master_params is not None,
                    stochastic_rounding=stochastic_rounding)
    tensors = {"params": params, "grads": grads, "exp_avgs": exp_avgs,
               "exp_avg_sqs": exp_avg_sqs, "max_exp_avg_sqs": max_exp_avg_sqs,
               "master_params": master_params}
    return Plan(spec, tensors, table_mode=table_mode, stream=stream)


def adam_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, decoupled_weight_decay=False, amsgrad=False, max_exp_avg_sqs=None,
              maximize=False, master_params=None, stochastic_rounding=False, seed=0,
              grad_scale=None, found_inf=None, stream=None, table_mode=None) -> None:
    """One Adam/AdamW step over whole lists, in place, matching torch.optim.Adam / AdamW.

    `step` is the 1-based step count after increment (used for bias correction). Everything is
    validated before anything is written. Each call ingests the lists again (O(n) host work) but
    reuses device tables when the tensors are the same; to step repeatedly at O(1) host cost,
    build an `adam_plan` once. AMP: grads are divided by `grad_scale`, and a non-zero
    `found_inf` skips the step (each a number or a one-element float32 device array).
    `master_params`: fp32 copies of 16-bit params, updated in their place (see `adam_plan`).
    `stochastic_rounding`: bfloat16 params rounded stochastically, the random bits keyed by
    `seed`, the step and the tensor's index (see `adam_plan`).

    Update rule (g the grad, t = step):
        g = -g if maximize;  g += weight_decay * p (L2) or p *= 1 - lr * weight_decay (AdamW)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g**2
        p -= lr / (1 - beta1**t) * m / (sqrt(max(v) if amsgrad else v) / sqrt(1 - beta2**t) + eps)
    """
    spec = AdamSpec(amsgrad=amsgrad, decoupled_weight_decay=decoupled_weight_decay,
                    maximize=maximize, master_weights=master_params is not None,
                    stochastic_rounding=stochastic_rounding)
    spec.check_arguments(len(params), lr=lr, step=step, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, seed=seed)
    tensors = {"params": params, "grads": grads, "exp_avgs": exp_avgs,
               "exp_avg_sqs": exp_avg_sqs, "max_exp_avg_sqs": max_exp_avg_sqs,
               "master_params": master_params}
    _calls.step(spec, tensors, table_mode=table_mode, stream=stream, lr=lr, step=step,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, seed=seed,
                grad_scale=grad_scale, found_inf=found_inf)
