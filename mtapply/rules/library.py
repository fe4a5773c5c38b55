"""Optimizers shipped as rules: each a few lines of `mtapply.rule`, the same for the GPU, the
CPU, `mtapply.torch` and `mtapply.optax`.

    mtapply.rules.library.lion().step(params, grads, exp_avgs, lr=1e-4)

Slot names are the state names of the optimizers they follow (torch.optim's `sum`,
`square_avg`, `grad_avg`, `momentum_buffer`; lion-pytorch's `exp_avg`), so checkpoints move
between them and mtapply's torch classes.
"""
from __future__ import annotations

import functools

from . import Rule, rule
from .chain import Link

# the ranges the shipped rules declare for their hyperparameters (see mtapply.rule)
LR = ">= 0"
NON_NEGATIVE = ">= 0"
BETA = "[0, 1)"  # a moment's decay rate


@functools.lru_cache(maxsize=None)
def lion() -> Rule:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as
    lion-pytorch and optax.lion: the sign of an interpolation of momentum and gradient, with
    decoupled weight decay."""
    return rule("lion", slots="param:rw grad:r exp_avg:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.99, BETA),
                           weight_decay=(0.0, NON_NEGATIVE)),
                update="""
                    c = beta1 * exp_avg + (1 - beta1) * grad
                    param = param * (1 - lr * weight_decay) - lr * sign(c)
                    exp_avg = beta2 * exp_avg + (1 - beta2) * grad
                """)


@functools.lru_cache(maxsize=None)
def adagrad(maximize: bool = False) -> Rule:
    """Adagrad as torch.optim.Adagrad (eps outside the root; lr decayed by lr_decay per step).
    The sum starts at torch's initial_accumulator_value, which the torch class sets."""
    return rule("adagrad", slots="param:rw grad:r sum:rw",
                hyper=dict(lr=(1e-2, LR), lr_decay=(0.0, NON_NEGATIVE),
                           weight_decay=(0.0, NON_NEGATIVE), eps=(1e-10, NON_NEGATIVE)),
                update=f"""
                    g = {"-grad" if maximize else "grad"} + weight_decay * param
                    sum = sum + g * g
                    clr = lr / (1 + (step - 1) * lr_decay)
                    param = param - clr * (g / (sqrt(sum) + eps))
                """)


@functools.lru_cache(maxsize=None)
def rmsprop(centered: bool = False, momentum: bool = False, maximize: bool = False) -> Rule:
    """RMSprop as torch.optim.RMSprop: eps outside the root; `centered` subtracts the square of
    a running mean of the gradient (blended as torch's lerp); `momentum` (a momentum
    hyperparameter above 0) keeps a buffer of the scaled steps."""
    slots = "param:rw grad:r square_avg:rw"
    lines = [f"g = {'-grad' if maximize else 'grad'} + weight_decay * param",
             "square_avg = square_avg * alpha + (1 - alpha) * (g * g)"]
    if centered:
        slots += " grad_avg:rw"
        lines += ["d = g - grad_avg",  # torch's lerp of weight 1 - alpha, both branches
                  "grad_avg = where(1 - alpha < 0.5, grad_avg + (1 - alpha) * d, g - d * alpha)",
                  "avg = sqrt(square_avg - grad_avg * grad_avg) + eps"]
    else:
        lines += ["avg = sqrt(square_avg) + eps"]
    if momentum:
        slots += " momentum_buffer:rw"
        lines += ["momentum_buffer = momentum_buffer * momentum + g / avg",
                  "param = param - lr * momentum_buffer"]
    else:
        lines += ["param = param - lr * (g / avg)"]
    hyper = dict(lr=(1e-2, LR), alpha=(0.99, NON_NEGATIVE), eps=(1e-8, NON_NEGATIVE),
                 weight_decay=(0.0, NON_NEGATIVE))
    if momentum:
        hyper["momentum"] = (None, NON_NEGATIVE)
    return rule("rmsprop", slots=slots, hyper=hyper, update="\n".join(lines))


@functools.lru_cache(maxsize=None)
def adan() -> Rule:
    """Adan (Xie et al. 2022, "Adaptive Nesterov Momentum Algorithm"), as optax.adan (and the
    authors' implementation without the proximal step): moments of the gradient, of its
    difference from the last step's (zero at the first step) and of the squared extrapolation,
    bias-corrected; weight decay decoupled."""
    return rule("adan", slots="param:rw grad:r m:rw v:rw n:rw prev_grad:rw",
                hyper=dict(lr=(None, LR), beta1=(0.98, BETA), beta2=(0.92, BETA),
                           beta3=(0.99, BETA), eps=(1e-8, NON_NEGATIVE),
                           eps_root=(0.0, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE)),
                update="""
                    diff = where(step > 1, grad - prev_grad, 0)
                    m = beta1 * m + (1 - beta1) * grad
                    v = beta2 * v + (1 - beta2) * diff
                    sq = grad + (1 - beta2) * diff
                    n = beta3 * n + (1 - beta3) * (sq * sq)
                    u = m / (1 - beta1 ** step) + (1 - beta2) * (v / (1 - beta2 ** step))
                    denom = sqrt(n / (1 - beta3 ** step) + eps_root) + eps
                    param = param - lr * (u / denom + weight_decay * param)
                    prev_grad = grad
                """)


@functools.lru_cache(maxsize=None)
def adagrad_optax() -> Rule:
    """Adagrad as optax.adagrad (optax.scale_by_rss): eps inside the root, no step where the
    sum is still 0. The sum starts at optax's initial_accumulator_value, which
    mtapply.optax.adagrad sets."""
    return rule("adagrad_optax", slots="param:rw grad:r sum_of_squares:rw",
                hyper=dict(lr=(None, LR), eps=(1e-7, NON_NEGATIVE)),
                update="""
                    sum_of_squares = grad * grad + sum_of_squares
                    scale = where(sum_of_squares > 0, rsqrt(sum_of_squares + eps), 0)
                    param = param - lr * (scale * grad)
                """)


@functools.lru_cache(maxsize=None)
def adamax_optax() -> Rule:
    """Adamax as optax.adamax (optax.scale_by_adamax): the same update as `adamax`, with
    optax's state names (mu, nu) and no weight decay."""
    return rule("adamax_optax", slots="param:rw grad:r mu:rw nu:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE)),
                update="""
                    mu = (1 - beta1) * grad + beta1 * mu
                    nu = max(nu * beta2, abs(grad) + eps)
                    param = param - lr * ((mu / (1 - beta1 ** step)) / nu)
                """)


@functools.lru_cache(maxsize=None)
def adadelta_optax(unscaled: bool = False) -> Rule:
    """Adadelta as optax.adadelta (add_decayed_weights, then optax.scale_by_adadelta): the
    same update as `adadelta`, with optax's state names (e_g, e_x). `unscaled`: optax's
    learning_rate=None, whose chain leaves the step as it is, sign included (param + lr u,
    lr 1)."""
    step = "param = param + lr * u" if unscaled else "param = param - lr * u"
    return rule("adadelta_optax", slots="param:rw grad:r e_g:rw e_x:rw",
                hyper=dict(lr=(None, LR), rho=(0.9, "[0, 1]"), eps=(1e-6, NON_NEGATIVE),
                           weight_decay=(0.0, NON_NEGATIVE)),
                update=f"""
                    g = grad + weight_decay * param
                    e_g = (1 - rho) * (g * g) + rho * e_g
                    u = sqrt(e_x + eps) / sqrt(e_g + eps) * g
                    e_x = (1 - rho) * (u * u) + rho * e_x
                    {step}
                """)


@functools.lru_cache(maxsize=None)
def rmsprop_optax(centered: bool = False, momentum: bool = False, nesterov: bool = False,
                  eps_in_sqrt: bool = True) -> Rule:
    """RMSprop as optax.rmsprop (without bias correction): eps inside the root by default;
    `centered` as optax.scale_by_stddev; `momentum` as optax.trace after the learning rate,
    `nesterov` likewise. nu starts at optax's initial_scale, which mtapply.optax sets."""
    slots = "param:rw grad:r nu:rw"
    lines = ["nu = (1 - decay) * (grad * grad) + decay * nu"]
    variance = "nu"
    if centered:
        slots += " mu:rw"
        lines += ["mu = (1 - decay) * grad + decay * mu"]
        variance = "nu - mu * mu"
    lines += [f"u = grad * rsqrt({variance} + eps)" if eps_in_sqrt
              else f"u = grad * (1 / (sqrt({variance}) + eps))"]
    hyper = dict(lr=(None, LR), decay=(0.9, "[0, 1]"), eps=(1e-8, NON_NEGATIVE))
    if momentum:
        slots += " trace:rw"
        hyper["momentum"] = (None, NON_NEGATIVE)
        lines += ["trace = momentum * trace - lr * u",
                  "param = param + (momentum * trace - lr * u)" if nesterov
                  else "param = param + trace"]
    else:
        lines += ["param = param - lr * u"]
    return rule("rmsprop_optax", slots=slots, hyper=hyper, update="\n".join(lines))


@functools.lru_cache(maxsize=None)
def schedule_free_adamw() -> Rule:
    """Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), as
    optax.contrib.schedule_free_adamw: the params hold y, `z` the base sequence (a copy of the
    params at first); x, the average, is recomputed from them. `ck` is the averaging weight of
    this step (from the running sum of max_lr**weight_lr_power), which the adapter computes;
    lr is the base step's learning rate."""
    return rule("schedule_free_adamw", slots="param:rw grad:r z:rw=param nu:rw",
                hyper=dict(lr=(None, LR), b1=(0.9, "(0, 1)"), b2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE),
                           ck=(None, "[0, 1]")),
                update="""
                    nu = (1 - b2) * (grad * grad) + b2 * nu
                    u = grad * (1 / (sqrt(nu / (1 - b2 ** step)) + eps)) + weight_decay * param
                    x = (param - (1 - b1) * z) / b1
                    z = z - lr * u
                    x = (1 - ck) * x + ck * z
                    param = b1 * x + (1 - b1) * z
                """)


@functools.lru_cache(maxsize=None)
def adamax(maximize: bool = False) -> Rule:
    """Adamax as torch.optim.Adamax (Kingma & Ba 2015, sec. 7.1): an exponentially weighted
    infinity norm in place of Adam's second moment, eps inside the max, the lr over the first
    moment's bias correction; weight decay as L2 (added to the grad)."""
    return rule("adamax", slots="param:rw grad:r exp_avg:rw exp_inf:rw",
                hyper=dict(lr=(2e-3, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE)),
                update=f"""
                    g = {"-grad" if maximize else "grad"} + weight_decay * param
                    d = g - exp_avg
                    exp_avg = where(1 - beta1 < 0.5, exp_avg + (1 - beta1) * d, g - d * beta1)
                    exp_inf = max(exp_inf * beta2, abs(g) + eps)
                    param = param + (-lr / (1 - beta1 ** step)) * (exp_avg / exp_inf)
                """)


@functools.lru_cache(maxsize=None)
def adadelta(maximize: bool = False) -> Rule:
    """Adadelta as torch.optim.Adadelta (Zeiler 2012): the step is the ratio of the running
    RMS of past steps to that of the grads, times the grad; weight decay as L2."""
    return rule("adadelta", slots="param:rw grad:r square_avg:rw acc_delta:rw",
                hyper=dict(lr=(1.0, LR), rho=(0.9, "[0, 1]"), eps=(1e-6, NON_NEGATIVE),
                           weight_decay=(0.0, NON_NEGATIVE)),
                update=f"""
                    g = {"-grad" if maximize else "grad"} + weight_decay * param
                    square_avg = square_avg * rho + (1 - rho) * (g * g)
                    delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * g
                    acc_delta = acc_delta * rho + (1 - rho) * (delta * delta)
                    param = param - lr * delta
                """)


def _torch_adam_moments(decoupled_weight_decay: bool, maximize: bool) -> str:
    """The lines torch.optim's Adam family shares: the grad (negated to maximize), weight decay
    as L2 or decoupled, the first moment by torch's two-sided lerp, the second moment; each
    line stands alone (the rule language reads lines, not their indentation)."""
    decay = ("param = param * (1 - lr * weight_decay)" if decoupled_weight_decay
             else "g = g + weight_decay * param")
    return "\n".join([
        f"g = {'-grad' if maximize else 'grad'}", decay, "d = g - exp_avg",
        "exp_avg = where(1 - beta1 < 0.5, exp_avg + (1 - beta1) * d, g - d * beta1)",
        "exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g"])


@functools.lru_cache(maxsize=None)
def nadam(decoupled_weight_decay: bool = False, maximize: bool = False) -> Rule:
    """NAdam as torch.optim.NAdam (Dozat 2016, "Incorporating Nesterov Momentum into Adam"):
    Adam's moments with a momentum factor mu_t that warms up (momentum_decay), the step a blend
    of the grad and the first moment over the running product of the factors, `mu_product`,
    kept as scalar state (steps take `scalars_out=`, see `mtapply.rule`). Weight decay as L2,
    or decoupled."""
    return rule("nadam", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=(2e-3, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE),
                           momentum_decay=(4e-3, NON_NEGATIVE)),
                scalars=dict(mu_product=1.0),
                update=f"""
                    {_torch_adam_moments(decoupled_weight_decay, maximize)}
                    mu = beta1 * (1 - 0.5 * 0.96 ** (step * momentum_decay))
                    mu_next = beta1 * (1 - 0.5 * 0.96 ** ((step + 1) * momentum_decay))
                    mu_product = mu_product * mu
                    denom = sqrt(exp_avg_sq / (1 - beta2 ** step)) + eps
                    param = param + (-lr * (1 - mu) / (1 - mu_product)) * (g / denom)
                    param = param + (-lr * mu_next / (1 - mu_product * mu_next)) * (exp_avg / denom)
                """)


@functools.lru_cache(maxsize=None)
def radam(decoupled_weight_decay: bool = False, maximize: bool = False) -> Rule:
    """RAdam as torch.optim.RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning
    Rate and Beyond"): Adam's moments; while the variance of the adaptive step is tractable
    (rho_t > 5) the bias-corrected step is rectified, before it plain momentum SGD. Weight
    decay as L2, or decoupled (AdamW's)."""
    return rule("radam", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=(1e-3, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE)),
                update=f"""
                    {_torch_adam_moments(decoupled_weight_decay, maximize)}
                    bias2 = 1 - beta2 ** step
                    rho_inf = 2 / (1 - beta2) - 1
                    rho = rho_inf - 2 * step * beta2 ** step / bias2
                    rect = sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
                    m = exp_avg / (1 - beta1 ** step) * lr
                    param = param - where(rho > 5, m * (sqrt(bias2) / (sqrt(exp_avg_sq) + eps)) * rect, m)
                """)


@functools.lru_cache(maxsize=None)
def radam_optax(nesterov: bool = False) -> Rule:
    """RAdam as optax.radam (optax.scale_by_radam): the same rectification, with optax's
    state names (mu, nu), eps_root inside the root and its `threshold` on rho_t (>=).
    `nesterov`: the first moment looked one step ahead, as optax's."""
    mu_hat = ("beta1 * (mu / (1 - beta1 ** (step + 1))) + (1 - beta1) * (grad / (1 - beta1 ** step))"
              if nesterov else "mu / (1 - beta1 ** step)")
    return rule("radam_optax", slots="param:rw grad:r mu:rw nu:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), eps_root=(0.0, NON_NEGATIVE),
                           threshold=5.0),
                update=f"""
                    mu = (1 - beta1) * grad + beta1 * mu
                    nu = (1 - beta2) * (grad * grad) + beta2 * nu
                    b2t = beta2 ** step
                    rho_inf = 2 / (1 - beta2) - 1
                    rho = rho_inf - 2 * step * b2t / (1 - b2t)
                    r = sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
                    mu_hat = {mu_hat}
                    nu_hat = nu / (1 - beta2 ** step)
                    param = param - lr * where(rho >= threshold, r * mu_hat / (sqrt(nu_hat + eps_root) + eps), mu_hat)
                """)


@functools.lru_cache(maxsize=None)
def adam(decoupled_weight_decay: bool = False, maximize: bool = False) -> Rule:
    """Adam / AdamW as the built-in `mtapply.AdamSpec` (torch.optim's semantics, its two-sided
    lerp for the first moment), written as a rule: the built-in op's twin, for comparing the
    generated kernel with the hand-written one."""
    return rule("adam", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE)),
                update=f"""
                    {_torch_adam_moments(decoupled_weight_decay, maximize)}
                    denom = sqrt(exp_avg_sq) / sqrt(1 - beta2 ** step) + eps
                    param = param + (-lr / (1 - beta1 ** step)) * (exp_avg / denom)
                """)


# -- links: gradient transformations for `mtapply.chain`, named and behaving as optax's --------
# (each factory's arguments are the link's hyperparameter defaults; a step may pass others)

def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0) -> Link:
    """optax.scale_by_adam: bias-corrected first moment over the root of the second."""
    return Link("scale_by_adam", "mu:rw nu:rw",
                dict(b1=(b1, BETA), b2=(b2, BETA), eps=(eps, NON_NEGATIVE),
                     eps_root=(eps_root, NON_NEGATIVE)),
                """
                    mu = (1 - b1) * grad + b1 * mu
                    nu = (1 - b2) * (grad * grad) + b2 * nu
                    update = mu / (1 - b1 ** step) / (sqrt(nu / (1 - b2 ** step) + eps_root) + eps)
                """)


def scale_by_rms(decay=0.9, eps=1e-8, initial_scale=0.0) -> Link:
    """optax.scale_by_rms: the update over the root of a running mean of its squares (eps
    inside the root); the mean starts at `initial_scale`."""
    return Link("scale_by_rms", f"nu:rw={float(initial_scale)!r}",
                dict(decay=(decay, "[0, 1]"), eps=(eps, NON_NEGATIVE)),
                """
                    nu = (1 - decay) * (grad * grad) + decay * nu
                    update = grad * rsqrt(nu + eps)
                """)


def scale_by_lion(b1=0.9, b2=0.99) -> Link:
    """optax.scale_by_lion: the sign of an interpolation of momentum and update."""
    return Link("scale_by_lion", "mu:rw", dict(b1=(b1, BETA), b2=(b2, BETA)),
                """
                    update = sign((1 - b1) * grad + b1 * mu)
                    mu = (1 - b2) * grad + b2 * mu
                """)


def scale_by_belief(b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16) -> Link:
    """optax.scale_by_belief (AdaBelief): the second moment of the update's surprise."""
    return Link("scale_by_belief", "mu:rw nu:rw",
                dict(b1=(b1, BETA), b2=(b2, BETA), eps=(eps, NON_NEGATIVE),
                     eps_root=(eps_root, NON_NEGATIVE)),
                """
                    mu = (1 - b1) * grad + b1 * mu
                    surprise = grad - mu
                    nu = (1 - b2) * (surprise * surprise) + b2 * nu + eps_root
                    update = mu / (1 - b1 ** step) / (sqrt(nu / (1 - b2 ** step)) + eps)
                """)


def trace(decay, nesterov=False) -> Link:
    """optax.trace: momentum (the trace starts at zero); with nesterov, the update plus the
    decayed new trace."""
    return Link("trace", "trace:rw", dict(decay=(decay, "[0, 1]")),
                f"""
                    trace = grad + decay * trace
                    update = {"grad + decay * trace" if nesterov else "trace"}
                """)


def scale_by_trust_ratio(min_norm=0.0, trust_coefficient=1.0, eps=0.0) -> Link:
    """optax.scale_by_trust_ratio (LAMB's, LARS's): each tensor's update times
    trust_coefficient * ||param|| / (||update|| + eps), or 1 where a norm is 0; norms at least
    min_norm. Its norms are sums of a first pass over what the links before it leave."""
    return Link("scale_by_trust_ratio", "",
                dict(min_norm=(min_norm, NON_NEGATIVE), trust_coefficient=trust_coefficient,
                     eps=(eps, NON_NEGATIVE)),
                sums={"p2": "param * param", "u2": "grad * grad"},
                finish="""
                    p_norm = max(sqrt(p2), min_norm)
                    u_norm = max(sqrt(u2), min_norm)
                    ratio = where(p_norm == 0, 1, where(u_norm == 0, 1, trust_coefficient * p_norm / (u_norm + eps)))
                """,
                update="update = grad * ratio")


def add_decayed_weights(weight_decay=0.0) -> Link:
    """optax.add_decayed_weights (without a mask): the update plus weight_decay * param."""
    return Link("add_decayed_weights", "", dict(weight_decay=(weight_decay, NON_NEGATIVE)),
                "update = grad + weight_decay * param")


def scale(step_size) -> Link:
    """optax.scale: the update times `step_size`."""
    return Link("scale", "", dict(step_size=step_size), "update = step_size * grad")


def scale_by_learning_rate(learning_rate=None) -> Link:
    """optax.scale_by_learning_rate: the update times -lr (the rule's `lr`, which the torch
    and optax adapters drive; None: given at every step)."""
    return Link("scale_by_learning_rate", "", dict(lr=(learning_rate, LR)),
                "update = -lr * grad")


def clip(max_delta) -> Link:
    """optax.clip: each element of the update into [-max_delta, max_delta]."""
    return Link("clip", "", dict(max_delta=(max_delta, NON_NEGATIVE)),
                "update = max(min(grad, max_delta), -max_delta)")


__all__ = ["adadelta", "adadelta_optax", "adagrad", "adagrad_optax", "adam", "adamax",
           "adamax_optax", "adan", "lion", "nadam", "radam", "radam_optax", "rmsprop", "rmsprop_optax",
           "schedule_free_adamw",
           # links
           "add_decayed_weights", "clip", "scale", "scale_by_adam", "scale_by_belief",
           "scale_by_learning_rate", "scale_by_lion", "scale_by_rms", "scale_by_trust_ratio",
           "trace"]
