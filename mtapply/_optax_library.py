"""mtapply.optax's transformations of the rule library (`mtapply.rules.library`): optax's
constructors and arguments (lion, adan, adamax, radam, adadelta, adagrad, rmsprop, schedule-free
AdamW), each a rule of the library with optax's semantics."""
from __future__ import annotations

import jax
import optax

from ._optax_eight_bit import with_storage
from ._optax_make import FusedOptimizer, _fused, _refuse, _state_dtype, _transformation
from ._optax_ops import DAdaptRule, ScheduleFreeRule, UserRule, is_number
from ._optax_state import tree_state
from .ops._spec import check_number
from .rules import library


# slots that are never negative: the unsigned 8-bit map keeps them with state_bits=8
_UNSIGNED = {"lion": (), "adan": ("n",), "adamax": ("nu",), "radam": ("nu",),
             "adadelta": ("e_g", "e_x"), "adagrad": ("sum_of_squares",), "rmsprop": ("nu",)}


def _bits(made: UserRule, state_bits, min_8bit_size) -> UserRule:
    """`made` with state_bits=8 or 16 (mtapply.optax's docstring: State layout)."""
    return with_storage(made, state_bits, min_8bit_size, _UNSIGNED[made.name])


def _lion_rule(b1, b2, mu_dtype, weight_decay, mask) -> UserRule:
    _refuse("lion", mask=(mask, None))
    if callable(weight_decay):
        raise TypeError("mtapply.optax.lion: weight_decay must be a number, not a schedule")
    rule = UserRule(library.lion(), dict(beta1=b1, beta2=b2, weight_decay=weight_decay),
                    name="lion")
    dtype = _state_dtype("lion", "mu_dtype", mu_dtype)
    rule.slot_dtypes = {"exp_avg": dtype} if dtype is not None else {}
    return rule


def lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3, mask=None, *,
         flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.lion on the rule `mtapply.rules.library.lion`: p -= lr * (sign(b1 * m + (1 - b1)
    * g) + weight_decay * p); m = b2 * m + (1 - b2) * g. mu_dtype is the moment's dtype; mask
    only takes its default; the state is `LionState(count, exp_avg)`."""
    rule = _lion_rule(b1, b2, mu_dtype, weight_decay, mask)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3,
               mask=None, *, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`lion` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _lion_rule(b1, b2, mu_dtype, weight_decay, mask)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def _adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask) -> UserRule:
    _refuse("adan", mask=(mask, None))
    if callable(weight_decay):
        raise TypeError("mtapply.optax.adan: weight_decay must be a number, not a schedule")
    return UserRule(library.adan(), dict(beta1=b1, beta2=b2, beta3=b3, eps=eps,
                                          eps_root=eps_root, weight_decay=weight_decay),
                     name="adan")


def adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, weight_decay=0.0,
         mask=None, *, flat_state=True,
         state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adan on the rule `mtapply.rules.library.adan` (optax's arguments; mask only takes
    its default). The state is `AdanState(count, m, v, n, prev_grad)`."""
    rule = _adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8,
               weight_decay=0.0, mask=None, *, state_bits=None,
               min_8bit_size=None) -> FusedOptimizer:
    """`adan` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8, *,
           flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adamax on the rule `mtapply.rules.library.adamax_optax`: m = b1 m + (1 - b1) g;
    u = max(b2 u, |g| + eps); p -= lr * m / (1 - b1^t) / u. State `AdamaxOptaxState(count, mu,
    nu)`."""
    rule = _adamax_rule(b1, b2, eps)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                 *, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`adamax` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adamax_rule(b1, b2, eps)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def _adamax_rule(b1, b2, eps) -> UserRule:
    return UserRule(library.adamax_optax(), dict(beta1=b1, beta2=b2, eps=eps), name="adamax")


def radam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
          nesterov=False, flat_state=True,
          state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.radam on the rule `mtapply.rules.library.radam_optax`: Adam's moments; where
    rho_t >= threshold the bias-corrected step is rectified, before it the bias-corrected
    momentum alone. State `RadamOptaxState(count, mu, nu)`."""
    rule = _radam_rule(b1, b2, eps, eps_root, threshold, nesterov)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_radam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
                nesterov=False, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`radam` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _radam_rule(b1, b2, eps, eps_root, threshold, nesterov)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def _radam_rule(b1, b2, eps, eps_root, threshold, nesterov) -> UserRule:
    return UserRule(library.radam_optax(bool(nesterov)),
                    dict(beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, threshold=threshold),
                    name="radam")


def adadelta(learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0, weight_decay_mask=None,
             *, flat_state=True, state_bits=None,
             min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adadelta on the rule `mtapply.rules.library.adadelta_optax`: g += wd p;
    e_g = rho e_g + (1 - rho) g^2; u = sqrt(e_x + eps) / sqrt(e_g + eps) g;
    e_x = rho e_x + (1 - rho) u^2; p -= lr u (learning_rate None: p += u, as optax's chain
    without a learning rate). weight_decay_mask only takes its default. State
    `AdadeltaOptaxState(count, e_g, e_x)`."""
    rule = _adadelta_rule(rho, eps, weight_decay, weight_decay_mask, learning_rate is None)
    return _transformation(_bits(rule, state_bits, min_8bit_size),
                           1.0 if learning_rate is None else learning_rate, flat_state)


def fused_adadelta(learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0,
                   weight_decay_mask=None, *, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`adadelta` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adadelta_rule(rho, eps, weight_decay, weight_decay_mask, learning_rate is None)
    return _fused(_bits(rule, state_bits, min_8bit_size),
                  1.0 if learning_rate is None else learning_rate)


def _adadelta_rule(rho, eps, weight_decay, weight_decay_mask, unscaled: bool) -> UserRule:
    _refuse("adadelta", weight_decay_mask=(weight_decay_mask, None))
    if callable(weight_decay):
        raise TypeError("mtapply.optax.adadelta: weight_decay must be a number, not a schedule")
    return UserRule(library.adadelta_optax(unscaled),
                    dict(rho=rho, eps=eps, weight_decay=weight_decay), name="adadelta")


def _adagrad_rule(initial_accumulator_value, eps) -> UserRule:
    if is_number(initial_accumulator_value):
        check_number("initial_accumulator_value", initial_accumulator_value, low=0.0)
    return UserRule(library.adagrad_optax(), dict(eps=eps), name="adagrad",
                     initial={"sum_of_squares": initial_accumulator_value})


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7, *,
            flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adagrad on the rule `mtapply.rules.library.adagrad_optax`: s += g^2;
    p -= lr * g / sqrt(s + eps) (no step where s is 0). State `AdagradOptaxState(count,
    sum_of_squares)`."""
    rule = _adagrad_rule(initial_accumulator_value, eps)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7,
                  *, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`adagrad` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adagrad_rule(initial_accumulator_value, eps)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def _rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered, momentum, nesterov,
                  bias_correction) -> UserRule:
    _refuse("rmsprop", bias_correction=(bias_correction, False))
    if nesterov and momentum is None:
        raise ValueError("mtapply.optax.rmsprop: nesterov=True needs a momentum")
    rule = library.rmsprop_optax(bool(centered), momentum is not None, bool(nesterov),
                                 bool(eps_in_sqrt))
    hyper = dict(decay=decay, eps=eps) | ({} if momentum is None else dict(momentum=momentum))
    if is_number(initial_scale):
        check_number("initial_scale", initial_scale)
    return UserRule(rule, hyper, initial={"nu": initial_scale}, name="rmsprop")


def rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
            centered=False, momentum=None, nesterov=False, bias_correction=False, *,
            flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.rmsprop on the rule `mtapply.rules.library.rmsprop_optax`, with optax's arguments
    (bias_correction only takes its default)."""
    rule = _rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered,
                         momentum, nesterov, bias_correction)
    return _transformation(_bits(rule, state_bits, min_8bit_size), learning_rate, flat_state)


def fused_rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
                  centered=False, momentum=None, nesterov=False,
                  bias_correction=False, *, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`rmsprop` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered, momentum,
                         nesterov, bias_correction)
    return _fused(_bits(rule, state_bits, min_8bit_size), learning_rate)


def _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps, weight_decay,
                        weight_lr_power, state_dtype):
    if warmup_steps is not None:
        learning_rate = optax.warmup_constant_schedule(0.0, learning_rate, warmup_steps)
    dtype = _state_dtype("schedule_free_adamw", "state_dtype", state_dtype)
    return ScheduleFreeRule(b1, b2, eps, weight_decay, weight_lr_power, dtype), learning_rate


def schedule_free_adamw(learning_rate=0.0025, warmup_steps=None, b1=0.9, b2=0.999, eps=1e-8,
                        weight_decay=0.0, weight_lr_power=2.0, state_dtype=None, *,
                        flat_state=True) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw on the rule `mtapply.rules.library.schedule_free_adamw`
    (optax's arguments; state_dtype is z's dtype). The params are schedule-free's y;
    evaluate with `schedule_free_eval_params(state, params)`. State
    `ScheduleFreeAdamwState(count, z, nu, weight_sum, max_lr, b1)`."""
    rule, learning_rate = _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps,
                                              weight_decay, weight_lr_power, state_dtype)
    return _transformation(rule, learning_rate, flat_state)


def fused_schedule_free_adamw(learning_rate=0.0025, warmup_steps=None, b1=0.9, b2=0.999,
                              eps=1e-8, weight_decay=0.0, weight_lr_power=2.0,
                              state_dtype=None) -> FusedOptimizer:
    """`schedule_free_adamw` as a fused step: `opt.step(params, grads, state)`."""
    rule, learning_rate = _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps,
                                              weight_decay, weight_lr_power, state_dtype)
    return _fused(rule, learning_rate)


def schedule_free_eval_params(state, params):
    """The params to evaluate with (schedule-free's x) from a `schedule_free_adamw` state (or a
    chain's holding one) and the trained params y: (y - (1 - b1) z) / b1."""
    found = [node for node in jax.tree.leaves(state, is_leaf=lambda n: hasattr(n, "max_lr"))
             if hasattr(node, "max_lr")]
    if not found:
        raise ValueError("schedule_free_eval_params needs the state of schedule_free_adamw")
    z, b1 = tree_state(found[0], params).z, found[0].b1
    return jax.tree.map(lambda y, zi: (y - (1.0 - b1) * zi) / b1, params, z)


def _betas(name: str, betas) -> tuple:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"mtapply.optax.{name}: betas must be a pair (b1, b2), got "
                        f"{betas!r}") from None
    return b1, b2


def _number(name: str, option: str, value):
    if callable(value):
        raise TypeError(f"mtapply.optax.{name}: {option} must be a number, not a schedule")
    return value


def _prodigy_rule(betas, beta3, eps, estim_lr0, estim_lr_coef, weight_decay,
                  safeguard_warmup) -> UserRule:
    b1, b2 = _betas("prodigy", betas)
    if beta3 is None:  # optax's default, sqrt(b2)
        beta3 = float(b2) ** 0.5 if is_number(b2) else b2 ** 0.5
    hyper = dict(beta1=b1, beta2=b2, beta3=beta3, eps=eps, d0=estim_lr0, d_coef=estim_lr_coef,
                 weight_decay=_number("prodigy", "weight_decay", weight_decay), growth_rate=0.0)
    # optax.contrib.prodigy: decoupled weight decay, Adam's bias correction in the step size
    # (computed as optax does), unbounded growth; the state starts with d = d_max = estim_lr0
    # (which step 1 reads anyway)
    rule = library.prodigy(decouple=True, safeguard_warmup=bool(safeguard_warmup),
                           given_correction=True)
    start = estim_lr0 if is_number(estim_lr0) else 0.0
    return DAdaptRule(rule, hyper, name="prodigy", scalars={"d": start, "d_max": start})


def prodigy(learning_rate=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, estim_lr0=1e-6,
            estim_lr_coef=1.0, weight_decay=0.0, safeguard_warmup=False, *,
            flat_state=True) -> optax.GradientTransformation:
    """optax.contrib.prodigy on the rule `mtapply.rules.library.prodigy` (decouple=True,
    use_bias_correction=True, growth_rate 0): optax's arguments and update, the step size d
    estimated from sums over the whole tree, in one call. The state is
    `ProdigyState(count, exp_avg, exp_avg_sq, s, p0, d, d_max, d_numerator)`: optax's
    exp_avg, exp_avg_sq, grad_sum (s), params0 (p0), estim_lr (d) and
    numerator_weighted (d_numerator), with d's running maximum d_max (equal to d); the
    scalars are float32, float64 where every param is float64.
    A step whose sum of |s| is 0 (zero grads from the start) leaves params and d as they are
    (optax's gives NaN). See `mtapply.optax`: scalar state."""
    rule = _prodigy_rule(betas, beta3, eps, estim_lr0, estim_lr_coef, weight_decay,
                         safeguard_warmup)
    return _transformation(rule, learning_rate, flat_state)


def fused_prodigy(learning_rate=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, estim_lr0=1e-6,
                  estim_lr_coef=1.0, weight_decay=0.0,
                  safeguard_warmup=False) -> FusedOptimizer:
    """`prodigy` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _prodigy_rule(betas, beta3, eps, estim_lr0, estim_lr_coef, weight_decay,
                         safeguard_warmup)
    return _fused(rule, learning_rate)


def _dadapt_rule(betas, eps, estim_lr0, weight_decay) -> UserRule:
    b1, b2 = _betas("dadapt_adamw", betas)
    hyper = dict(beta1=b1, beta2=b2, eps=eps, d0=estim_lr0, growth_rate=0.0, layer_scale=1.0,
                 weight_decay=_number("dadapt_adamw", "weight_decay", weight_decay))
    # optax.contrib.dadapt_adamw: decoupled weight decay, Adam's bias correction in the step
    # size (computed as optax does), unbounded growth; the state starts with d = estim_lr0
    # (which step 1 reads anyway)
    rule = library.dadapt_adam(decouple=True, given_correction=True)
    return DAdaptRule(rule, hyper, name="dadapt_adamw",
                      scalars={"d": estim_lr0 if is_number(estim_lr0) else 0.0})


def dadapt_adamw(learning_rate=1.0, betas=(0.9, 0.999), eps=1e-8, estim_lr0=1e-6,
                 weight_decay=0.0, *, flat_state=True) -> optax.GradientTransformation:
    """optax.contrib.dadapt_adamw on the rule `mtapply.rules.library.dadapt_adam`
    (decouple=True, use_bias_correction=True, growth_rate 0, layer_scale 1): optax's
    arguments and update, d estimated from sums over the whole tree, in one call. The state is
    `DadaptAdamState(count, exp_avg, exp_avg_sq, s, d, numerator_weighted)`: optax's
    exp_avg, exp_avg_sq, grad_sum (s), estim_lr (d) and numerator_weighted (d and the
    numerator float32, float64 where every param is float64). A step whose sum of |s| is 0 leaves params and d as they are (optax's gives
    NaN). See `mtapply.optax`: scalar state."""
    return _transformation(_dadapt_rule(betas, eps, estim_lr0, weight_decay), learning_rate,
                           flat_state)


def fused_dadapt_adamw(learning_rate=1.0, betas=(0.9, 0.999), eps=1e-8, estim_lr0=1e-6,
                       weight_decay=0.0) -> FusedOptimizer:
    """`dadapt_adamw` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_dadapt_rule(betas, eps, estim_lr0, weight_decay), learning_rate)
