"""The built-in ops of mtapply.optax written as rules: what a step runs when a hyperparameter is
an array (`optax.inject_hyperparams` passes every number as one) or takes a value the built-in
op has no switch for (optax's eps_root, nesterov Adam, LAMB's mask).

The built-in ops (`AdamSpec`, `SGDSpec`, `LARSSpec`, `LAMBSpec`) read only the learning rate and
the step count from device memory; a rule reads any hyperparameter there, so a traced b1 reaches
the kernel as a device value and nothing is fixed when the step is compiled. Each rule keeps its
op's slot names (the same state) and optax's semantics:

- `adam`: optax.scale_by_adam with decoupled weight decay (optax.adamw), eps_root, nesterov;
- `sgd`: optax.trace (t = g + momentum * t) and the step, nesterov;
- `lars`: mtapply's LARS, `mtapply.rules.library.lars` itself; `adapt` 0 leaves a tensor out
  of the trust ratio, `decay_on` 0 out of weight decay;
- `lamb`: Apex FusedLAMB's LAMB, `mtapply.rules.library.lamb` itself (optax's eps_root among
  its hyperparameters); use_nvlamb applies the trust ratio whatever the weight decay (optax.lamb's
  rule).

Flags that change the update's lines are arguments of the functions; each variant is one rule.
"""
from __future__ import annotations

import functools

from .rules import Rule, rule
from .rules.library import lamb, lars


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


__all__ = ["adam", "lamb", "lars", "sgd"]
