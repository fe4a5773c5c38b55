"""The built-in ops of mtapply.optax written as rules: what a step runs when a hyperparameter is
an array (`optax.inject_hyperparams` passes every number as one) or takes a value the built-in
op has no switch for (optax's eps_root, nesterov Adam, LAMB's mask).

The built-in ops (`AdamSpec`, `SGDSpec`, `LARSSpec`, `LAMBSpec`) read only the learning rate and
the step count from device memory; a rule reads any hyperparameter there, so a traced b1 reaches
the kernel as a device value and nothing is fixed when the step is compiled. Each rule keeps its
op's slot names (the same state) and optax's semantics:

- `adam`: optax.scale_by_adam with decoupled weight decay (optax.adamw), eps_root, nesterov;
- `sgd`: optax.trace (t = g + momentum * t) and the step, nesterov;
- `lars`: mtapply's LARS (`mtapply.LARSSpec`); `adapt` 0 leaves a tensor out of the trust
  ratio, `decay_on` 0 out of weight decay (the built-in op has one flag for both);
- `lamb`: Apex FusedLAMB's LAMB (`mtapply.LAMBSpec`) with optax's eps_root; `trust` 1 applies
  the trust ratio whatever the weight decay (use_nvlamb, optax.lamb's rule).

Flags that change the update's lines are arguments of the functions; each variant is one rule.
"""
from __future__ import annotations

import functools

from .rules import Rule, rule


@functools.lru_cache(maxsize=None)
def adam(nesterov: bool = False) -> Rule:
    """optax.adamw: m = (1 - b1) g + b1 m; v = (1 - b2) g^2 + b2 v;
    p -= lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * p), with optax's
    Nesterov m_hat = b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t) when nesterov."""
    m_hat = ("beta1 * exp_avg / (1 - beta1 ** (step + 1))"
             " + (1 - beta1) * grad / (1 - beta1 ** step)" if nesterov
             else "exp_avg / (1 - beta1 ** step)")
    return rule("optax_adam", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=None, beta1=0.9, beta2=0.999, eps=1e-8, eps_root=0.0,
                           weight_decay=0.0),
                update=f"""
                    exp_avg = (1 - beta1) * grad + beta1 * exp_avg
                    exp_avg_sq = (1 - beta2) * (grad * grad) + beta2 * exp_avg_sq
                    m_hat = {m_hat}
                    u = m_hat / (sqrt(exp_avg_sq / (1 - beta2 ** step) + eps_root) + eps)
                    param = param - lr * (u + weight_decay * param)
                """)


@functools.lru_cache(maxsize=None)
def sgd(nesterov: bool = False) -> Rule:
    """optax.sgd with momentum: t = g + momentum * t; p -= lr * t (nesterov:
    p -= lr * (g + momentum * t))."""
    step = "grad + momentum * momentum_buffer" if nesterov else "momentum_buffer"
    return rule("optax_sgd", slots="param:rw grad:r momentum_buffer:rw",
                hyper=dict(lr=None, momentum=0.0),
                update=f"""
                    momentum_buffer = grad + momentum * momentum_buffer
                    param = param - lr * ({step})
                """)


@functools.lru_cache(maxsize=None)
def lars() -> Rule:
    """mtapply's LARS: local_lr = lr * trust_coefficient * ||p|| / (||g|| + wd ||p|| + eps)
    (lr where a norm is 0, or where adapt is 0); v = momentum v + local_lr (g + wd p); p -= v;
    wd is 0 where decay_on is 0."""
    return rule("optax_lars", slots="param:rw grad:r momentum_buffer:rw",
                hyper=dict(lr=None, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                           eps=0.0, adapt=1.0, decay_on=1.0),
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
def lamb(adam_w_mode: bool = True, grad_averaging: bool = True, bias_correction: bool = True,
         trust: bool = True) -> Rule:
    """LAMB (`mtapply.LAMBSpec`'s update) with eps_root inside the root: g clipped by the
    global norm when max_grad_norm > 0; u = m_hat / (sqrt(v_hat + eps_root) + eps) (+ wd p);
    p -= lr * ratio * u, ratio = ||p|| / ||u|| (1 where a norm is 0) where `trust` or the
    weight decay is not 0, else 1."""
    decay_in_grad = "" if adam_w_mode else "g = g + weight_decay * param"
    decay_in_update = "u = u + weight_decay * param" if adam_w_mode else ""
    averaging = "(1 - beta1)" if grad_averaging else "1"
    bc1, bc2 = (("(1 - beta1 ** step)", "(1 - beta2 ** step)") if bias_correction
                else ("1", "1"))
    applies = "1" if trust else "where(weight_decay != 0, 1, 0)"
    return rule("optax_lamb", slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
                hyper=dict(lr=None, beta1=0.9, beta2=0.999, eps=1e-6, eps_root=0.0,
                           weight_decay=0.0, max_grad_norm=0.0, global_grad_norm=0.0),
                sums={"p2": "param * param", "u2": "u * u"},
                update=f"""
                    clip = global_grad_norm / max_grad_norm
                    g = grad / where(max_grad_norm > 0, where(clip > 1, clip, 1), 1)
                    {decay_in_grad}
                    exp_avg = exp_avg * beta1 + {averaging} * g
                    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * (g * g)
                    u = (exp_avg / {bc1}) / (sqrt(exp_avg_sq / {bc2} + eps_root) + eps)
                    {decay_in_update}
                    norms = where(p2 > 0, where(u2 > 0, sqrt(p2) / sqrt(u2), 1), 1)
                    ratio = where({applies} > 0, norms, 1)
                    param = param - lr * ratio * u
                """)


__all__ = ["adam", "lamb", "lars", "sgd"]
