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
def sgd(momentum_buffers: bool = False, nesterov: bool = False, maximize: bool = False) -> Rule:
    """SGD as torch.optim.SGD (mtapply.sgd_step runs it): weight decay added to the gradient;
    with `momentum_buffers`, a momentum other than 0 blends the gradient into the buffer, which
    step 1 sets to the gradient itself; `nesterov` steps along the gradient plus the momentum
    times the buffer. A zero weight decay or momentum leaves the gradient as it is (an infinite
    param times 0 would be NaN)."""
    lines = [f"g = {'-grad' if maximize else 'grad'}",
             "g = where(weight_decay != 0, g + weight_decay * param, g)"]
    slots, hyper = "param:rw grad:r", dict(lr=(None, LR), weight_decay=(0.0, NON_NEGATIVE))
    if momentum_buffers:
        slots += " momentum_buffer:rw"
        hyper.update(momentum=(0.0, NON_NEGATIVE), dampening=(0.0, "[0, 1]"))
        blended = "momentum_buffer * momentum + (1 - dampening) * g"
        lines += [f"momentum_buffer = where(momentum == 0, momentum_buffer, "
                  f"where(step == 1, g, {blended}))",
                  f"g = where(momentum == 0, g, "
                  f"{'g + momentum * momentum_buffer' if nesterov else 'momentum_buffer'})"]
    return rule("sgd", slots=slots, hyper=hyper, update="\n".join(lines + ["param = param - lr * g"]))


@functools.lru_cache(maxsize=None)
def lars() -> Rule:
    """LARS (You et al. 2017, as Paddle's lars_momentum; mtapply.lars_step runs it), per tensor:
    local_lr = lr * trust_coefficient * ||p|| / (||g|| + wd ||p|| + eps), lr where a norm is 0
    or where `adapt` is 0; v = momentum v + local_lr (g + wd p); p -= v, with wd 0 where
    `decay_on` is 0. The norms are sums of a first pass over the list."""
    return rule("lars", slots="param:rw grad:r momentum_buffer:rw",
                hyper=dict(lr=(None, LR), momentum=(0.9, NON_NEGATIVE),
                           weight_decay=(0.0, NON_NEGATIVE), trust_coefficient=(0.001, NON_NEGATIVE),
                           eps=(0.0, NON_NEGATIVE), adapt=(1.0, "[0, 1]"), decay_on=(1.0, "[0, 1]")),
                sums={"p2": "param * param", "g2": "grad * grad"},
                finish="""
                    decay = where(decay_on > 0, weight_decay, 0)
                    p_norm = sqrt(p2)
                    g_norm = sqrt(g2)
                    ratio = trust_coefficient * p_norm / (g_norm + decay * p_norm + eps)
                    trusted = where(p_norm > 0, where(g_norm > 0, lr * ratio, lr), lr)
                    local_lr = where(adapt > 0, trusted, lr)
                """,
                update="""
                    momentum_buffer = momentum * momentum_buffer + local_lr * (grad + decay * param)
                    param = param - momentum_buffer
                """)


@functools.lru_cache(maxsize=None)
def lamb(adam_w_mode: bool = True, use_nvlamb: bool = False) -> Rule:
    """LAMB (You et al. 2019) as Apex's FusedLAMB (mtapply.lamb_step runs it), per tensor:
    g = grad / clip (clip = global_grad_norm / max_grad_norm where that exceeds 1, and
    max_grad_norm > 0); g += wd p (L2, without adam_w_mode); m = beta1 m + (1 - beta1) g (+ g
    without grad_averaging); v = beta2 v + (1 - beta2) g^2; u = m_hat / (sqrt(v_hat +
    eps_root) + eps) (+ wd p with adam_w_mode), bias corrections where bias_correction is 1;
    p -= lr * ratio * u with ratio = ||p|| / ||u|| (1 where a norm is 0) where the weight decay
    is not 0, or always with `use_nvlamb`. The norms are sums of a first pass, which also
    stores the moments (float32 ones) for the update to read."""
    decay_in_grad = "" if adam_w_mode else "g = g + weight_decay * param"
    decay_in_update = "u = u + weight_decay * param" if adam_w_mode else ""
    applies = "1" if use_nvlamb else "where(weight_decay != 0, 1, 0)"
    return rule("lamb", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-6, NON_NEGATIVE), eps_root=(0.0, NON_NEGATIVE),
                           weight_decay=(0.01, NON_NEGATIVE), grad_averaging=(1.0, "[0, 1]"),
                           bias_correction=(1.0, "[0, 1]"), max_grad_norm=(0.0, NON_NEGATIVE),
                           global_grad_norm=(0.0, NON_NEGATIVE)),
                sums={"p2": "param * param", "u2": "u * u"},
                update=f"""
                    clip = global_grad_norm / max_grad_norm
                    g = grad * (1 / where(max_grad_norm > 0, where(clip > 1, clip, 1), 1))
                    {decay_in_grad}
                    exp_avg = exp_avg * beta1 + where(grad_averaging > 0, 1 - beta1, 1) * g
                    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
                    bc1 = where(bias_correction > 0, 1 - beta1 ** step, 1)
                    bc2 = where(bias_correction > 0, 1 - beta2 ** step, 1)
                    u = (exp_avg / bc1) / (sqrt(exp_avg_sq / bc2 + eps_root) + eps)
                    {decay_in_update}
                    norms = where(p2 > 0, where(u2 > 0, sqrt(p2) / sqrt(u2), 1), 1)
                    ratio = where({applies} > 0, norms, 1)
                    param = param - lr * ratio * u
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
def ademamix() -> Rule:
    """AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older"), as
    bitsandbytes' AdEMAMix: Adam's bias-corrected moment (`exp_avg`, beta1) plus alpha times a
    slow one (`exp_avg_slow`, beta3, not bias-corrected), over the root of Adam's bias-corrected
    second moment (`exp_avg_sq`, beta2) plus eps; weight decay decoupled, p (1 - lr wd).
    t_alpha > 0 raises alpha linearly from 0 over t_alpha steps, t_beta3 > 0 raises beta3 from
    beta1 over t_beta3 steps along the paper's schedule (linear in 1 / log beta), each capped at
    its value; 0 (the default) leaves either as it is."""
    return rule("ademamix", slots="param:rw grad:r exp_avg:rw exp_avg_slow:rw exp_avg_sq:rw",
                hyper=dict(lr=(None, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           beta3=(0.9999, BETA), alpha=(5.0, NON_NEGATIVE),
                           t_alpha=(0.0, NON_NEGATIVE), t_beta3=(0.0, NON_NEGATIVE),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.01, NON_NEGATIVE)),
                update="""
                    ramp = step * alpha / where(t_alpha > 0, t_alpha, 1)
                    alpha_t = where(t_alpha > 0, min(ramp, alpha), alpha)
                    s = step / where(t_beta3 > 0, t_beta3, 1)
                    scheduled = exp(1 / ((1 - s) / log(beta1) + s / log(beta3)))
                    beta3_t = where(t_beta3 > 0, min(scheduled, beta3), beta3)
                    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
                    exp_avg_slow = beta3_t * exp_avg_slow + (1 - beta3_t) * grad
                    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * (grad * grad)
                    denom = sqrt(exp_avg_sq) / sqrt(1 - beta2 ** step) + eps
                    u = (exp_avg / (1 - beta1 ** step) + alpha_t * exp_avg_slow) / denom
                    param = param * (1 - lr * weight_decay) - lr * u
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


@functools.lru_cache(maxsize=None)
def prodigy(decouple: bool = True, use_bias_correction: bool = False,
            safeguard_warmup: bool = False, given_correction: bool = False) -> Rule:
    """Prodigy (Mishchenko and Defazio 2023), as prodigyopt.Prodigy: Adam whose step size d is
    estimated from the run, d = d_coef * sum(numerator) / sum(|s|) over the whole list, kept
    between steps as scalar state with its running maximum and numerator (d and d_max start
    at d0 at step 1; they are kept in float32, so "d is still d0" is taken to a millionth).
    growth_rate 0 stands for prodigyopt's unbounded growth (inf); a step whose denominator is
    zero (zero grads) leaves the params and d as they are, as there. `given_correction`: the
    bias correction is the hyperparameter `correction`, given at each step (mtapply.optax
    computes it as optax.contrib does), in place of use_bias_correction's."""
    g = "grad" if decouple else "grad + weight_decay * param"
    correction = _correction(use_bias_correction, given_correction)
    s_rate = "d_now / d0 * d_now" if safeguard_warmup else "d_now / d0 * dlr"
    decay = "param * weight_decay * dlr" if decouple else "0"
    return rule("prodigy", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw s:rw p0:r=param",
                hyper=dict(lr=(1.0, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           beta3=(None, BETA), eps=(1e-8, NON_NEGATIVE),
                           weight_decay=(0.0, NON_NEGATIVE), d0=(1e-6, "> 0"),
                           d_coef=(1.0, NON_NEGATIVE), growth_rate=(0.0, NON_NEGATIVE),
                           **_correction_hyper(given_correction)),
                scalars={"d": 0.0, "d_max": 0.0, "d_numerator": 0.0},
                totals={"numerator": "d_now / d0 * dlr * g * (p0 - param)",
                        "denominator": "abs(s)"},
                update=f"""
                    d_now = where(step == 1, d0, d)
                    d_top = where(step == 1, d0, d_max)
                    dlr = d_now * lr * {correction}
                    g = {g}
                    exp_avg = beta1 * exp_avg + d_now * (1 - beta1) * g
                    exp_avg_sq = beta2 * exp_avg_sq + d_now * d_now * (1 - beta2) * g * g
                    s = beta3 * s + {s_rate} * g
                    total = beta3 * where(step == 1, 0, d_numerator) + numerator
                    d_hat = d_coef * total / where(denominator == 0, 1, denominator)
                    d_raised = where(abs(d_now - d0) <= 1e-6 * d0, max(d_now, d_hat), d_now)
                    d_top_new = max(d_top, d_hat)
                    d_new = where(growth_rate > 0, min(d_top_new, d_raised * growth_rate), d_top_new)
                    d = where(denominator == 0, d_now, d_new)
                    d_max = where(denominator == 0, d_top, d_top_new)
                    d_numerator = where(denominator == 0, where(step == 1, 0, d_numerator), total)
                    denom = sqrt(exp_avg_sq) + d * eps
                    param = where(denominator == 0, param, param - {decay} - dlr * exp_avg / denom)
                """)


@functools.lru_cache(maxsize=None)
def dadapt_adam(decouple: bool = False, use_bias_correction: bool = False,
                given_correction: bool = False) -> Rule:
    """D-Adaptation Adam (Defazio and Mishchenko 2023), as dadaptation.DAdaptAdam: Adam whose
    step size d is estimated from the run, d_hat = numerator / ((1 - sqrt(beta2)) sum(|s|)) over
    the whole list, d = max(d, min(d_hat, d growth_rate)), kept between steps as scalar state
    with its weighted numerator (d starts at d0 at step 1). growth_rate 0 stands for unbounded
    growth (inf); a step whose sum of |s| is zero leaves the params and d as they are.
    `given_correction` as in `prodigy`."""
    g = "grad" if decouple else "grad + weight_decay * param"
    correction = _correction(use_bias_correction, given_correction)
    decay = "param * weight_decay * dlr" if decouple else "0"
    return rule("dadapt_adam", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw s:rw",
                hyper=dict(lr=(1.0, LR), beta1=(0.9, BETA), beta2=(0.999, BETA),
                           eps=(1e-8, NON_NEGATIVE), weight_decay=(0.0, NON_NEGATIVE),
                           d0=(1e-6, "> 0"), growth_rate=(0.0, NON_NEGATIVE),
                           layer_scale=(1.0, NON_NEGATIVE), **_correction_hyper(given_correction)),
                scalars={"d": 0.0, "numerator_weighted": 0.0},
                totals={"numerator": "layer_scale * dlr * term", "s_l1": "layer_scale * abs(s)"},
                update=f"""
                    d_now = where(step == 1, d0, d)
                    dlr = d_now * lr * {correction}
                    root = sqrt(beta2)
                    g = {g}
                    term = g * s / (sqrt(exp_avg_sq) + eps)
                    exp_avg = beta1 * exp_avg + layer_scale * dlr * (1 - beta1) * g
                    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
                    s = root * s + dlr * (1 - root) * g
                    weighted = root * where(step == 1, 0, numerator_weighted) + (1 - root) * numerator
                    d_hat = weighted / ((1 - root) * where(s_l1 == 0, 1, s_l1))
                    d_new = max(d_now, where(growth_rate > 0, min(d_hat, d_now * growth_rate), d_hat))
                    d = where(s_l1 == 0, d_now, d_new)
                    numerator_weighted = where(s_l1 == 0, where(step == 1, 0, numerator_weighted), weighted)
                    param = where(s_l1 == 0, param, param - {decay} - exp_avg / (sqrt(exp_avg_sq) + eps))
                """)


def _correction(use_bias_correction: bool, given: bool) -> str:
    """The factor of the step size d * lr: Adam's bias correction sqrt(1 - beta2**t) / (1 -
    beta1**t), computed, given as the hyperparameter `correction`, or none."""
    if given:
        return "correction"
    return "sqrt(1 - beta2 ** step) / (1 - beta1 ** step)" if use_bias_correction else "1"


def _correction_hyper(given: bool) -> dict:
    return {"correction": (None, NON_NEGATIVE)} if given else {}


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


def add_decayed_weights(weight_decay=0.0, mask=None) -> Link:
    """optax.add_decayed_weights: the update plus weight_decay * param. `mask` as optax's (a
    pytree of bools like the params, or a prefix of it, or a callable of the params giving
    one): no decay where False. mtapply.optax applies the mask (fixed per tree when the step
    is traced); mtapply.torch and the functional step have no pytree: give weight_decay per
    param group (0 for the groups the mask leaves out) or per tensor there. weight_decay may
    be a schedule (a function of the step count from 0), as optax's: see `scale_by_schedule`."""
    scheduled = callable(weight_decay)
    return Link("add_decayed_weights", "",
                dict(weight_decay=(None if scheduled else weight_decay, NON_NEGATIVE)),
                "update = grad + weight_decay * param", masks={"weight_decay": mask},
                schedules={"weight_decay": weight_decay} if scheduled else None)


def scale_by_schedule(step_size_fn) -> Link:
    """optax.scale_by_schedule: the update times step_size_fn(count), count the steps taken
    before this one (0 at the first). mtapply.optax evaluates the schedule at each update
    (under jit too) and passes its value to the kernel as a per-step scalar, as it does the
    learning rate. mtapply.torch and the functional step take `step_size` as given at each
    step (a param group's, which a scheduler may set): they do not call the function."""
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule takes a function of the step count (an optax "
                        f"schedule), got {type(step_size_fn).__name__}: scale(step_size) "
                        f"scales by a constant")
    return Link("scale_by_schedule", "", dict(step_size=None), "update = step_size * grad",
                schedules={"step_size": step_size_fn})


def scale(step_size) -> Link:
    """optax.scale: the update times `step_size`."""
    return Link("scale", "", dict(step_size=step_size), "update = step_size * grad")


def scale_by_learning_rate(learning_rate=None) -> Link:
    """optax.scale_by_learning_rate: the update times -lr (the rule's `lr`, which the torch
    and optax adapters drive; None: given at every step)."""
    return Link("scale_by_learning_rate", "", dict(lr=(learning_rate, LR)),
                "update = -lr * grad")


def clip_by_global_norm(max_norm) -> Link:
    """optax.clip_by_global_norm: the update, scaled by max_norm / ||update|| where the norm over
    every tensor of the list (a whole-list sum of a first pass: deterministic, no host
    synchronisation) is max_norm or more."""
    return Link("clip_by_global_norm", "", dict(max_norm=(max_norm, NON_NEGATIVE)),
                totals={"u2": "grad * grad"},
                update="""
                    norm = sqrt(u2)
                    update = where(norm < max_norm, grad, grad * (max_norm / norm))
                """)


def clip(max_delta) -> Link:
    """optax.clip: each element of the update into [-max_delta, max_delta]."""
    return Link("clip", "", dict(max_delta=(max_delta, NON_NEGATIVE)),
                "update = max(min(grad, max_delta), -max_delta)")


def _lerp(start: str, end: str, weight: str) -> str:
    """torch.lerp's formula (exact at both ends): start + w (end - start) for w < 0.5, else
    end - (end - start) (1 - w)."""
    return (f"where({weight} < 0.5, {start} + {weight} * ({end} - {start}), "
            f"{end} - ({end} - {start}) * (1 - {weight}))")


@functools.lru_cache(maxsize=None)
def adafactor(maximize: bool = False) -> Rule:
    """torch.optim.Adafactor (Shazeer and Stern 2018, with torch's lr and eps1), per tensor at
    step t: g = grad (-grad with maximize); w = t^beta2_decay (1 - beta2_t); a factored param
    (two or more dimensions) lerps its row and column means of g^2 into row_var and col_var by
    w, and estimates V = row_var / max(mean(row_var), eps1) col_var (torch's product
    reassociated, so that the quotient is a row's work, not an element's); an unfactored one lerps
    g^2 into variance, V = variance; u = g / sqrt(max(V, eps1^2)) (both maxima keep a NaN, as
    torch's clamps do: a NaN grad is not hidden); p = p (1 - lr
    weight_decay) - alpha / max(1, RMS(u) / d) u with alpha = max(eps2, RMS(p)) min(lr,
    1 / sqrt(t)), RMS(p) of the param before the step. RMS(p) and RMS(u) come from sums of a
    first pass. On a GPU, the row and column means are reductions run first."""
    g = "-grad" if maximize else "grad"
    return rule("adafactor",
                slots="param:rw grad:r row_var:rw@row col_var:rw@col variance:rw@unfactored",
                hyper=dict(lr=(1e-2, LR), beta2_decay=(-0.8, "<= 0"), eps1=(None, NON_NEGATIVE),
                           eps2=(1e-3, NON_NEGATIVE), d=(1.0, ">= 1"),
                           weight_decay=(0.0, NON_NEGATIVE)),
                sums={"p2": "param * param", "u2": "u * u"},
                update=f"""
                    g = {g}
                    w = step ** beta2_decay
                    g2 = g * g
                    row_var = {_lerp("row_var", "row_mean(g2)", "w")}
                    col_var = {_lerp("col_var", "col_mean(g2)", "w")}
                    variance = {_lerp("variance", "g2", "w")}
                    m = col_mean(row_var) if factored else 1
                    v = row_var / where(m < eps1, eps1, m) * col_var if factored else variance
                    u = g * rsqrt(where(v < eps1 * eps1, eps1 * eps1, v))
                    alpha = max(eps2, sqrt(p2 / numel)) * min(lr, 1 / sqrt(step))
                    scale = alpha / max(1, sqrt(u2 / numel) / d)
                    param = param * (1 - lr * weight_decay) - scale * u
                """)


@functools.lru_cache(maxsize=None)
def adafactor_optax(clipping: bool = True, param_scale: bool = True,
                    momentum: bool = False) -> Rule:
    """optax.adafactor (Shazeer and Stern 2018, optax's chain of links), per tensor: g2 = grad^2
    + eps; a factored param lerps its row and column means of g2 into row_var and col_var by
    1 - decay and scales the grad by 1 / sqrt(row_var / mean(row_var)), then by 1 / sqrt(col_var)
    (optax's order; the row's factor is a row's, not an element's, work), an unfactored one
    keeps variance (g2's average), 1 / sqrt(variance). Then, each where its flag is on:
    the update divided by max(1, RMS(u) / clipping_threshold); times lr; times max(RMS(p),
    1e-3), RMS(p) of the param before the step; an ema of decay `momentum` (not debiased) taken
    as the update; plus weight_decay p. p -= the update. `decay` is the step's (optax: 1 - (t -
    decay_offset)^-decay_rate, in float32; the adapter passes it), and the adapter moves a
    param's two largest dimensions last (optax factors over those)."""
    clipped = "scaled / max(1, sqrt(s2 / numel) / clipping_threshold)" if clipping else "scaled"
    scale = "max(sqrt(p2 / numel), 1e-3)" if param_scale else "1"
    hyper = dict(lr=(1.0, LR), decay=None, eps=(1e-30, NON_NEGATIVE),
                 clipping_threshold=(1.0, "> 0"), weight_decay=(0.0, NON_NEGATIVE))
    slots = "param:rw grad:r row_var:rw@row col_var:rw@col variance:rw@unfactored"
    ema = ""
    if momentum:
        hyper["momentum"] = (0.9, "[0, 1]")
        slots += " ema:rw"
        ema = """
                    ema = (1 - momentum) * u + momentum * ema
                    u = ema"""
    return rule("adafactor_optax", slots=slots, hyper=hyper,
                sums={**({"s2": "scaled * scaled"} if clipping else {}),
                      **({"p2": "param * param"} if param_scale else {})},
                update=f"""
                    g2 = grad * grad + eps
                    row_var = decay * row_var + (1 - decay) * row_mean(g2)
                    col_var = decay * col_var + (1 - decay) * col_mean(g2)
                    variance = decay * variance + (1 - decay) * g2
                    row_scale = rsqrt(row_var / col_mean(row_var)) if factored else 1
                    scaled = grad * row_scale * rsqrt(col_var) if factored else grad * rsqrt(variance)
                    u = (lr * {scale}) * ({clipped}){ema}
                    param = param - (u + weight_decay * param)
                """)


@functools.lru_cache(maxsize=None)
def muon_momentum(nesterov: bool = True) -> Rule:
    """torch.optim.Muon's momentum, the first of its three passes (`mtapply.torch.Muon`): the
    buffer lerps toward the grad, b = lerp(b, g, 1 - momentum), and the matrix to orthogonalize
    goes to `direction` (bfloat16 there): lerp(g, b, momentum) with nesterov, else b. The
    params are not read."""
    new_buffer = _lerp("momentum_buffer", "grad", "(1 - momentum)")
    direction = _lerp("grad", "momentum_buffer", "momentum") if nesterov else "momentum_buffer"
    return rule("muon_momentum", slots="param:r grad:r momentum_buffer:rw direction:rw",
                hyper=dict(momentum=(0.95, NON_NEGATIVE)),
                update=f"""
                    momentum_buffer = {new_buffer}
                    direction = {direction}
                """)


@functools.lru_cache(maxsize=None)
def muon_normalize() -> Rule:
    """Newton-Schulz's start in `mtapply.torch.Muon`: each matrix to orthogonalize (its
    bfloat16 view in a batch) divided by its Frobenius norm, at least eps,
    X = X / max(||X||, eps), with the norm rounded to bfloat16 as torch.optim.Muon's is; one
    launch over every batch. The matrix is passed as the grad and its quotient written to the
    param (another buffer, not read)."""
    return rule("muon_normalize", slots="param:rw grad:r", hyper=dict(eps=(1e-7, NON_NEGATIVE)),
                sums={"x2": "grad * grad"},
                # (a NaN norm stays NaN, as torch's clamp keeps it)
                finish="n = bfloat16(sqrt(x2))\nnorm = bfloat16(where(n < eps, eps, n))",
                update="param = grad / norm")


@functools.lru_cache(maxsize=None)
def muon_apply() -> Rule:
    """torch.optim.Muon's last pass: decoupled weight decay, then the orthogonalized update
    (passed as the grad) times the lr adjusted for the matrix's shape (`scale`, per tensor):
    p = p (1 - lr weight_decay) - lr scale O."""
    return rule("muon_apply", slots="param:rw grad:r",
                hyper=dict(lr=(None, LR), weight_decay=(0.1, NON_NEGATIVE),
                           scale=(1.0, NON_NEGATIVE)),
                update="param = param * (1 - lr * weight_decay) - (lr * scale) * grad")


__all__ = ["adadelta", "adafactor", "adafactor_optax", "adadelta_optax", "adagrad", "adagrad_optax", "adam", "adamax",
           "adamax_optax", "adan", "ademamix", "dadapt_adam", "lamb", "lars", "lion", "muon_apply", "muon_momentum", "muon_normalize", "nadam", "prodigy", "radam", "radam_optax", "rmsprop", "rmsprop_optax",
           "schedule_free_adamw", "sgd",
           # links
           "add_decayed_weights", "clip", "clip_by_global_norm", "scale", "scale_by_adam", "scale_by_belief",
           "scale_by_learning_rate", "scale_by_lion", "scale_by_rms", "scale_by_schedule",
           "scale_by_trust_ratio", "trace"]
