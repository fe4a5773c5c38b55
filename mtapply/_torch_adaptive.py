"""`mtapply.torch` optimizers that estimate their own step size d from the run (Prodigy,
D-Adaptation Adam): rules whose d is scalar state fed by sums over the whole list, so their
params step together, in one param group."""
from __future__ import annotations

import math

from ._torch_rules import RuleBased
from .rules import library


def _check_adaptive(name, lr, betas, eps, d0, growth_rate, fsdp_in_use) -> None:
    """The argument checks (and messages) of prodigyopt and dadaptation, and mtapply's refusal
    of sharded params."""
    if not 0.0 < d0:
        raise ValueError(f"Invalid d0 value: {d0}")
    if not 0.0 < lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 < eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for k in (0, 1):
        if not 0.0 <= betas[k] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {k}: {betas[k]}")
    if not growth_rate >= 1.0:
        raise ValueError(f"Invalid growth_rate: {growth_rate} (at least 1, or inf)")
    if fsdp_in_use:
        raise ValueError(f"{name}(fsdp_in_use=True): FSDP2's DTensor params have their sums "
                         "all-reduced over their shards without it (leave it False); FSDP1's "
                         "flattened params are not supported")


def _one_param_group(self, param_group) -> None:
    """add_param_group of an optimizer with one d for all its params: one group only."""
    if getattr(self, "param_groups", None):
        raise ValueError(f"{type(self).__name__} keeps one step size d for all its params: it "
                         "takes one param group (give every param to it in one list)")
    RuleBased.add_param_group(self, param_group)


class Prodigy(RuleBased):
    """prodigyopt.Prodigy (same arguments; Adam whose step size d it estimates) from
    `mtapply.rules.library.prodigy`: d, d_max and d_numerator are the rule's scalar state, summed
    over the whole list on the device (no host synchronisation; prodigyopt reads two sums to
    the host per step). One param group (prodigyopt shares one d across groups), whose params
    step together; per-param state `exp_avg`, `exp_avg_sq`, `s` and `p0` shaped as the param
    (prodigyopt keeps `s` and `p0` flat), `step`, and views of `d`, `d_max`, `d_numerator`."""

    _merges_groups = False

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8,
                 weight_decay=0.0, decouple=True, use_bias_correction=False,
                 safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float("inf"),
                 fsdp_in_use=False, slice_p=1, *, flat_grads=False, state_bits=32,
                 min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        _check_adaptive(type(self).__name__, lr, betas, eps, d0, growth_rate, fsdp_in_use)
        if slice_p != 1:
            raise ValueError(f"Prodigy(slice_p={slice_p}): only slice_p=1 (every element) is "
                             "supported")
        defaults = dict(lr=lr, betas=tuple(betas), beta3=beta3, eps=eps,
                        weight_decay=weight_decay, decouple=decouple,
                        use_bias_correction=use_bias_correction,
                        safeguard_warmup=safeguard_warmup, d0=d0, d_coef=d_coef,
                        growth_rate=growth_rate)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    add_param_group = _one_param_group

    def _rule(self, group):
        return library.prodigy(bool(group["decouple"]), bool(group["use_bias_correction"]),
                               bool(group["safeguard_warmup"]))

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        beta3 = group["beta3"] if group["beta3"] is not None else math.sqrt(beta2)
        growth = group["growth_rate"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"],
                    weight_decay=group["weight_decay"], d0=group["d0"], d_coef=group["d_coef"],
                    growth_rate=0.0 if math.isinf(growth) else growth)


class DAdaptAdam(RuleBased):
    """dadaptation.DAdaptAdam (same arguments) from `mtapply.rules.library.dadapt_adam`: d and
    the weighted numerator are the rule's scalar state, fed by whole-list sums on the device
    (dadaptation reads two sums to the host per step). One param group (dadaptation shares one
    d across groups); its `layer_scale`; per-param state `exp_avg`, `exp_avg_sq`, `s`, `step`
    and views of `d` and `numerator_weighted`. Unlike dadaptation, the grads are left as they
    are (its L2 weight decay adds to them in place)."""

    _merges_groups = False

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 log_every=0, decouple=False, use_bias_correction=False, d0=1e-6,
                 growth_rate=float("inf"), fsdp_in_use=False, *, flat_grads=False,
                 state_bits=32, min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        _check_adaptive(type(self).__name__, lr, betas, eps, d0, growth_rate, fsdp_in_use)
        if log_every:
            raise ValueError(f"DAdaptAdam(log_every={log_every}): d is on the device, not logged "
                             "(read optimizer.state[p]['d'] for it)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decouple=decouple, use_bias_correction=use_bias_correction, d0=d0,
                        growth_rate=growth_rate, layer_scale=1.0)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    add_param_group = _one_param_group

    def _rule(self, group):
        return library.dadapt_adam(bool(group["decouple"]), bool(group["use_bias_correction"]))

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        growth = group["growth_rate"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], d0=group["d0"],
                    growth_rate=0.0 if math.isinf(growth) else growth,
                    layer_scale=group["layer_scale"])
