"""optax transformations run by mtapply's fused kernels, and a fused in-place train step.

    import mtapply.optax as mtx

    tx = optax.chain(optax.clip_by_global_norm(1.0), mtx.adamw(1e-3, weight_decay=0.01))
    updates, state = tx.update(grads, state, params)          # an optax.GradientTransformation

    opt = mtx.fused_adamw(1e-3, weight_decay=0.01)             # the fast path
    state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def train_step(params, batch, state):
        grads = jax.grad(loss)(params, batch)
        return opt.step(params, grads, state)                  # -> (params, state), in place

A rule written with `mtapply.rule` becomes one too: `transformation(rule, learning_rate,
**hyper)` and `fused(rule, learning_rate, **hyper)` (`alias(rule)` is its factory, for
`optax.inject_hyperparams`); `lion`, `adan`, `adagrad`, `rmsprop`, `adamax`, `adadelta` and
`radam` (and their fused forms) are the shipped rules of `mtapply.rules.library` with optax's
arguments and semantics; `nadam` and `nadamw` are `adam` and `adamw` with nesterov=True, as
optax's; `prodigy` and `dadapt_adamw` (and fused forms) are optax.contrib's. `adafactor` is
optax.adafactor (its arguments and its state, the chain's tuple) on the rule
`library.adafactor_optax`, factored over each param's two largest dimensions as optax's (on
GPUs in the XLA FFI call, as every mtapply.optax step);
its fused form `fused_adafactor` keeps the rule's state flat (`tree_state` gives optax's).

Scalar state. A rule's numbers kept between steps (`mtapply.rule(..., scalars=)`: Prodigy's d,
d_max and numerator) are fields of the state after its slots, zero-dimensional, float32
(float64 where every param is float64, with jax_enable_x64; the sums are then float64 too):
each update passes them to its one call (whole-list sums make it one) as an array of three equal
copies and takes the latest values back. A slot the rule only reads (Prodigy's p0) is state
passed on as it is. On GPUs the FFI custom call steps that array in place in its result (an
aliased output), as it does the state slots: no host round trip.

Hyperparameters. Each number may be an array, as `optax.inject_hyperparams` passes them (traced
under jit): it is then a one-element operand of the step, read by the kernel from device memory
as the learning rate is, so a new value in the state takes effect without recompiling. The
built-in ops read only lr and the step so; with an array b1 (or eps_root, nesterov, lamb's mask)
adam, sgd, lars and lamb run as their rules (`mtapply._optax_rules`), with optax's semantics.
Choices that shape the step (masks, the momentum trace, centered RMSprop) are made when the step
is traced, from Python values only: an array momentum keeps sgd's trace. Arrays are not range
checked (optax checks none).

`adam`, `adamw`, `sgd`, `lars` and `lamb` take optax's arguments and return
`optax.GradientTransformation`s whose `update` returns updates (new params - params, computed by
the kernel, which only reads the params), as optax's contract requires, so they compose with
`optax.chain` and `optax.apply_updates`. The fused forms (`fused_adam`, ...) return
`FusedOptimizer`: `step(params, grads, state) -> (params, state)` writes the new params and state
into the buffers of the old ones when the enclosing `jax.jit` donates them (`donated_step` is
`step` jitted with params and state donated), so a step moves each tensor through memory once and
nothing more.

State layout. Both forms keep each state slot (mu, nu, ...) in one flat buffer per dtype, every
leaf at a 16-byte aligned offset, so a jitted step passes a few state arrays instead of one per
param and slot: JAX's dispatch costs a few microseconds per array, more than the kernel on many
models. `tree_state(state, params)` gives any such state (or a chain's) with its slots as pytrees
like params, as optax keeps them; `flat_state` goes back. A state over a single array keeps
optax's layout: one buffer either way. The transformations take
`flat_state=False` to keep optax's layout throughout (for states sharded like the params).
A slot may keep its own dtype (mu_dtype, accumulator_dtype, state_dtype): one buffer of that
dtype. `optax.tree_map_params` maps a function over each flat buffer (the slot holds optax's
params placeholder after `init` of one); a map that pairs the slots with other trees like the
params (building sharding specs from the params' ones) needs flat_state=False.
`state_bits=8` (adam, adamw, nadam, nadamw, sgd with momentum, lars, lamb, the library's transformations,
`transformation` and their fused forms; adafactor's momentum: see `EightBitEmaState`) keeps every slot the update writes as uint8 codes of
256-element blocks with a float32 scale each (`<slot>_absmax`), second moments on the map of
values >= 0, as bitsandbytes' 8-bit optimizers; leaves under `min_8bit_size` elements (4096)
keep float32. The state is then the rule's, named as its slots (`exp_avg`, `exp_avg_sq`, ...;
8-bit fields are trees like the params). `state_bits=16` keeps those slots in bfloat16. Either refuses mu_dtype
(both choose the state's dtype) and adamw's mask. Their defaults are None (32 bits, 4096), which
optax.inject_hyperparams leaves alone; a number given through it needs
`static_args=("state_bits",)`, as it would become an array.

JAX's transformations. `update` takes optax's extra arguments (GradientTransformationExtraArgs)
and ignores them; jax.vmap runs the step once per element (an ensemble); jax.grad through an
update raises a TypeError (the kernels have no derivative). Integer and complex params are
refused when the step is traced, naming the leaf. With jax_enable_x64, float64 params take a
float64 lr and step on the CPU (float32 on GPUs, where the kernels read float32 scalars).

Several devices. Under jax.pmap and jax.shard_map each device steps its own buffers (its shard
of each param, and a state made per shard or sharded like the params). Under jax.jit with
sharded params the step, which has no partitioning rule, runs on each device over whole copies
of its operands that XLA gathers: equal results, no saving of memory or work.

How it runs. On GPUs each update is one XLA FFI custom call, `mtapply_step` (`mtapply._xla`,
`csrc/xla_ffi.cpp`), prepared when the step is traced: the kernels are compiled and the tables
allocated on every local GPU, and at run time compiled code reads the buffers' addresses, uploads
the table records of those that moved on XLA's stream and launches the whole tree (one launch per
dtype group; two for LARS and LAMB), with lr and the step count read by the kernel from device
memory. A tree of more than about a thousand leaves is stepped by one call per thousand leaves,
the flat state passing through them in turn: XLA's compile time grows with the square of one
instruction's operands (97 s for one call over 10,000 leaves, 21 s in calls of 1,000). No
Python runs per step and the host never waits. The outputs that are updated in place alias
their inputs (`input_output_aliases`), so XLA hands the call buffers that already hold the old
values: the inputs themselves when they are donated and used nowhere else, otherwise fresh
copies; an array the caller still holds is therefore never written. Where the FFI handler cannot
be built, and on the CPU, the same step is one `jax.experimental.buffer_callback` (jax >= 0.6.1)
into mtapply (the NumPy backend on the CPU), with the same semantics; its plans are cached by
buffer addresses. MTAPPLY_OPTAX_CALLBACK (read at trace time) picks `buffer` (the callback on GPUs
too) or `host` (a `jax.pure_callback` into the NumPy backend that copies through the host, no
bfloat16) instead of the default `ffi`.

Semantics (the count in the state is the number of steps taken; the kernel's step is count + 1;
a schedule is evaluated at count, as optax does):
- adam: optax.adam. u = m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - b1**t) and likewise
  v_hat, as torch.optim.Adam (eps outside the root).
- adamw: optax.adamw's update -lr * (u + wd * p) equals torch.optim.AdamW's p *= 1 - lr * wd,
  p -= lr * u, which mtapply runs (decoupled_weight_decay=True).
- sgd: optax.sgd. The trace t = g + momentum * t (optax.trace) equals torch's momentum buffer
  with dampening 0, whose first-step buf = g is the same as a zero trace; nesterov alike.
- lars: mtapply's LARS (Paddle, You et al.), which differs from optax.lars when weight_decay > 0:
  the trust ratio divides by ||g|| + wd * ||p|| (optax: ||g + wd * p||). The state holds
  mtapply's velocity v (p -= v), minus optax.lars's trace. Equal to optax.lars when wd = 0.
- lamb: optax.lamb (the trust ratio always, use_nvlamb=True), with Apex FusedLAMB's options
  (see `mtapply.LAMBSpec`): use_nvlamb=False applies the trust ratio only where weight_decay != 0.
- Bias corrections (1 - b**t) are computed in float64 (optax: in float32, relative 7e-6 off for
  b2 = 0.999); moments of a 16-bit mu_dtype are computed in float32 and rounded once (optax
  rounds b1 * mu to mu_dtype first).
"""
from __future__ import annotations

import inspect
from typing import Callable

import jax.numpy as jnp
import optax

from ._optax_adafactor import EightBitEmaState, adafactor, fused_adafactor
from ._optax_library import (adadelta, adagrad, adamax, adan, dadapt_adamw, fused_adadelta,
                             fused_adagrad, fused_adamax, fused_adan, fused_dadapt_adamw,
                             fused_lion, fused_prodigy, fused_radam, fused_rmsprop,
                             fused_schedule_free_adamw, lion, prodigy, radam, rmsprop,
                             schedule_free_adamw, schedule_free_eval_params)
from ._optax_make import FusedOptimizer, _fused, _refuse, _state_dtype, _transformation
from ._optax_muon import muon, scale_by_muon
from . import _optax_rules
from ._optax_eight_bit import storage, user_rule, with_storage
from ._optax_ops import (AdamRule, LabeledAdamRule, LambRule, LarsRule, SgdRule, UserRule,
                         _rule_state, is_array, is_number)
from ._optax_state import AdamState, LambState, LarsState, SgdState, flat_state, tree_state


def _adam_rule(name, b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay=0.0, mask=None,
               state_bits=None, min_8bit_size=None):
    if callable(weight_decay):
        raise TypeError(f"mtapply.optax.{name}: weight_decay must be a number, not a schedule")
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if state_bits == 32:
        return AdamRule(b1, b2, eps, weight_decay, mask, eps_root=eps_root, nesterov=nesterov,
                        mu_dtype=_state_dtype(name, "mu_dtype", mu_dtype), name=name)
    _refuse(name, mask=(mask, None), mu_dtype=(mu_dtype, None))
    made = UserRule(_optax_rules.adam(bool(nesterov)),
                    dict(beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay),
                    name=name)
    return with_storage(made, state_bits, min_8bit_size, unsigned=("exp_avg_sq",))


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
         nesterov=False, flat_state=True, state_bits=None,
         min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adam on mtapply's fused kernel (update: -lr * m_hat / (sqrt(v_hat) + eps)).

    Args:
        learning_rate: a number, a scalar array, or an optax schedule of the step count.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as optax.adam. Each number may be an array
            (optax.inject_hyperparams passes them so), read by the kernel from device memory;
            mu_dtype is a floating dtype (float16, bfloat16, float32, float64).
        flat_state: keep mu and nu each in one flat buffer per dtype (see `tree_state`), so
            that a jitted step passes a few state arrays instead of one per param and slot;
            False keeps them as pytrees like params, as optax does (for states sharded like
            the params), at JAX's dispatch cost of a few microseconds per array and step.

    Returns:
        An optax.GradientTransformation with state `AdamState(count, mu, nu)`.

    Example:
        >>> tx = optax.chain(optax.clip_by_global_norm(1.0), mtapply.optax.adam(1e-3))
    """
    return _transformation(_adam_rule("adam", b1, b2, eps, eps_root, mu_dtype, nesterov,
                                      state_bits=state_bits, min_8bit_size=min_8bit_size),
                           learning_rate, flat_state)


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
          weight_decay=1e-4, mask=None, *, nesterov=False, flat_state=True, state_bits=None,
          min_8bit_size=None) -> optax.GradientTransformation:
    """optax.adamw on mtapply's fused kernel: p -= lr * (u + weight_decay * p), u as in `adam`.

    Args as optax.adamw (numbers or arrays, as in `adam`); weight_decay is not a schedule;
    mask, as optax's (a pytree of bools like params, or a callable of params giving one:
    weight decay only where True), is fixed per tree when the step is traced and read by the
    kernel per tensor, so the whole tree stays one call; flat_state as in `adam`. Params are
    required by update.
    """
    rule = _adam_rule("adamw", b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay, mask,
                      state_bits, min_8bit_size)
    return _transformation(rule, learning_rate, flat_state)


def multi_transform(transforms: dict, param_labels) -> optax.GradientTransformation:
    """optax.multi_transform, in one call where the labels' transformations allow it.

    Where every transformation is this module's `adam` or `adamw` (any learning rate or
    schedule, weight decay and mask per label) with the same b1, b2, eps and flat_state, the
    whole tree is one op: each leaf reads its label's lr, from one array of the labels' lrs
    per step, and its label's weight decay (a mask, as each label's adamw gives it, is taken
    over the whole tree). The state is then one `AdamState` over the whole tree (not optax's
    per-label states). Otherwise this is optax.multi_transform itself, each label its own call.

    Args:
        transforms: label -> GradientTransformation.
        param_labels: a pytree of labels like params (or a prefix of it), or a callable of
            params giving one.
    """
    labeled = _labeled(transforms, param_labels)
    if labeled is None:
        return optax.multi_transform(transforms, param_labels)
    return _transformation(*labeled)


def fused_multi_transform(optimizers: dict, param_labels) -> FusedOptimizer:
    """`multi_transform` as a fused step, of this module's `fused_adam`/`fused_adamw`
    optimizers of the same b1, b2 and eps: `opt.step(params, grads, state) -> (params, state)`
    over the whole tree in one call, each leaf with its label's learning rate, weight decay and
    mask."""
    labeled = _labeled(optimizers, param_labels)
    if labeled is None:
        raise ValueError("fused_multi_transform takes mtapply.optax.fused_adam or fused_adamw "
                         "optimizers of the same b1, b2 and eps: use multi_transform (with "
                         "optax.multi_transform's semantics) for other transformations")
    rule, learning_rates, _ = labeled
    return _fused(rule, learning_rates)


def _labeled(transforms: dict, param_labels):
    """(rule, learning rates, flat_state) of `transforms` as one op over the labels, or None
    where they cannot be one (see `multi_transform`)."""
    found = [getattr(t, "mtapply", None) for t in transforms.values()]
    if not found or any(f is None or type(f[0]) is not AdamRule or f[0].as_rule or f[0].slot_dtypes
                        for f in found) or len(
            {(rule.hyper["beta1"], rule.hyper["beta2"], rule.hyper["eps"], flat)
             for rule, _, flat in found}) != 1:
        return None
    rule = LabeledAdamRule({label: rule for label, (rule, _, _) in zip(transforms, found)},
                        param_labels)
    rates = [lr for _, lr, _ in found]

    def learning_rates(count):
        return jnp.stack([jnp.asarray(lr(count) if callable(lr) else lr, jnp.float32).reshape(())
                          for lr in rates])

    return rule, learning_rates, found[0][2]


def sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None, *,
        flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """optax.sgd on mtapply's fused kernel: t = g + momentum * t; p -= lr * t (Nesterov:
    p -= lr * (g + momentum * t)). momentum None or 0 keeps no trace. flat_state as in `adam`.

    momentum may be an array (then the trace is kept); accumulator_dtype is the trace's
    dtype, as optax's.

    Returns:
        An optax.GradientTransformation with state `SgdState(count, trace)`.
    """
    return _transformation(_sgd_rule(momentum, nesterov, accumulator_dtype, state_bits,
                                     min_8bit_size), learning_rate, flat_state)


def _sgd_rule(momentum, nesterov, accumulator_dtype, state_bits=None, min_8bit_size=None):
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if state_bits == 32:
        return SgdRule(momentum, nesterov,
                       _state_dtype("sgd", "accumulator_dtype", accumulator_dtype))
    if momentum is None or (is_number(momentum) and momentum == 0):
        raise ValueError(f"mtapply.optax.sgd without momentum keeps no state: state_bits="
                         f"{state_bits} has nothing to store (leave it at 32)")
    _refuse("sgd", accumulator_dtype=(accumulator_dtype, None))
    made = UserRule(_optax_rules.sgd(bool(nesterov)), dict(momentum=momentum), name="sgd")
    return with_storage(made, state_bits, min_8bit_size)


def lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
         eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False, *,
         flat_state=True, state_bits=None, min_8bit_size=None) -> optax.GradientTransformation:
    """mtapply's LARS (Paddle's lars_momentum, You et al. 2017) with optax.lars's arguments.

    Per tensor: local_lr = lr * trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps) (lr when a
    norm is 0); v = momentum * v + local_lr * (g + wd * p); p -= v. A leaf whose
    trust_ratio_mask is False takes a plain momentum step with lr and no weight decay, so
    weight_decay_mask must equal trust_ratio_mask when weight_decay > 0. Differs from optax.lars
    when weight_decay > 0 (see the module docstring); nesterov is not supported. flat_state,
    state_bits and min_8bit_size as in `adam`.

    Returns:
        An optax.GradientTransformation with state `LarsState(count, momentum)` (with
        state_bits 8 or 16, the rule's: `momentum_buffer`, and its scales at 8 bits).
    """
    return _transformation(_lars_rule(weight_decay, weight_decay_mask, trust_coefficient, eps,
                                      trust_ratio_mask, momentum, nesterov, state_bits,
                                      min_8bit_size), learning_rate, flat_state)


def _lars_rule(weight_decay, weight_decay_mask, trust_coefficient, eps, trust_ratio_mask,
               momentum, nesterov, state_bits=None, min_8bit_size=None):
    _refuse("lars", nesterov=(nesterov, False))
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if state_bits == 32:
        return LarsRule(weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                        weight_decay_mask)
    made = UserRule(_optax_rules.lars(), dict(momentum=momentum, weight_decay=weight_decay,
                                              trust_coefficient=trust_coefficient, eps=eps),
                    name="lars")
    # a leaf out of a mask steps in a call of its own, with adapt or decay_on 0
    made.masks = {"adapt": trust_ratio_mask, "decay_on": weight_decay_mask}
    return with_storage(made, state_bits, min_8bit_size)


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None,
         *, adam_w_mode=True, use_nvlamb=True, grad_averaging=True, bias_correction=True,
         max_grad_norm=0.0, flat_state=True, state_bits=None,
         min_8bit_size=None) -> optax.GradientTransformation:
    """optax.lamb, with Apex FusedLAMB's options (`mtapply.LAMBSpec`) besides optax's arguments.

    u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p;  p -= lr * ||p|| / ||u|| * u (1 where
    a norm is 0). use_nvlamb=False takes Apex's default instead: the trust ratio only where
    weight_decay != 0. mask (optax's) puts weight decay only on the leaves where it is True.
    max_grad_norm > 0 divides the grads by global_norm / max_grad_norm when that exceeds 1
    (norm computed in the step). Numbers may be arrays, as in `adam`; flat_state, state_bits
    and min_8bit_size as in `adam`.

    Returns:
        An optax.GradientTransformation with state `LambState(count, mu, nu)` (with state_bits
        8 or 16, the rule's: `exp_avg`, `exp_avg_sq`, and their scales at 8 bits).
    """
    return _transformation(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode,
                                      use_nvlamb, grad_averaging, bias_correction, max_grad_norm,
                                      state_bits, min_8bit_size),
                           learning_rate, flat_state)


def _lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
               grad_averaging, bias_correction, max_grad_norm, state_bits=None,
               min_8bit_size=None):
    if callable(weight_decay):
        raise TypeError("mtapply.optax.lamb: weight_decay must be a number, not a schedule")
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if state_bits == 32:
        return LambRule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                        grad_averaging, bias_correction, max_grad_norm)
    made = UserRule(_optax_rules.lamb(bool(adam_w_mode), bool(use_nvlamb)),
                    dict(beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                         grad_averaging=float(bool(grad_averaging)),
                         bias_correction=float(bool(bias_correction)), max_grad_norm=max_grad_norm),
                    name="lamb")
    if mask is not None:  # a leaf out of it steps in a call of its own, without weight decay
        made.masks = {"weight_decay": mask}
    if is_array(max_grad_norm) or max_grad_norm > 0:
        made.take_global_norm("global_grad_norm")
    return with_storage(made, state_bits, min_8bit_size, unsigned=("exp_avg_sq",))


def fused_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
               nesterov=False, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`adam` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_adam_rule("adam", b1, b2, eps, eps_root, mu_dtype, nesterov,
                             state_bits=state_bits, min_8bit_size=min_8bit_size), learning_rate)


def fused_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
                weight_decay=1e-4, mask=None, *, nesterov=False, state_bits=None,
                min_8bit_size=None) -> FusedOptimizer:
    """`adamw` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adam_rule("adamw", b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay, mask,
                      state_bits, min_8bit_size)
    return _fused(rule, learning_rate)


def nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
          nesterov=True, flat_state=True, state_bits=None,
          min_8bit_size=None) -> optax.GradientTransformation:
    """optax.nadam: `adam` with nesterov=True (the same state, `AdamState`)."""
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                flat_state=flat_state, state_bits=state_bits, min_8bit_size=min_8bit_size)


def nadamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
           weight_decay=1e-4, mask=None, *, nesterov=True, flat_state=True, state_bits=None,
           min_8bit_size=None) -> optax.GradientTransformation:
    """optax.nadamw: `adamw` with nesterov=True."""
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov=nesterov, flat_state=flat_state, state_bits=state_bits,
                 min_8bit_size=min_8bit_size)


def fused_nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
                nesterov=True, state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`nadam` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return fused_adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                      state_bits=state_bits, min_8bit_size=min_8bit_size)


def fused_nadamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
                 weight_decay=1e-4, mask=None, *, nesterov=True, state_bits=None,
                 min_8bit_size=None) -> FusedOptimizer:
    """`nadamw` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return fused_adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                       nesterov=nesterov, state_bits=state_bits, min_8bit_size=min_8bit_size)


def fused_sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None, *,
              state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`sgd` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_sgd_rule(momentum, nesterov, accumulator_dtype, state_bits, min_8bit_size),
                  learning_rate)


def fused_lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
               eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False, *,
               state_bits=None, min_8bit_size=None) -> FusedOptimizer:
    """`lars` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_lars_rule(weight_decay, weight_decay_mask, trust_coefficient, eps,
                             trust_ratio_mask, momentum, nesterov, state_bits, min_8bit_size),
                  learning_rate)


def fused_lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0,
               mask=None, *, adam_w_mode=True, use_nvlamb=True, grad_averaging=True,
               bias_correction=True, max_grad_norm=0.0, state_bits=None,
               min_8bit_size=None) -> FusedOptimizer:
    """`lamb` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                             grad_averaging, bias_correction, max_grad_norm, state_bits,
                             min_8bit_size), learning_rate)


def transformation(rule, learning_rate=None, *, flat_state=True, state_bits=None,
                   min_8bit_size=None, unsigned=(), slots=None,
                   **hyper) -> optax.GradientTransformation:
    """A user-written rule (`mtapply.rule`) as an optax transformation, like `adam`:
    learning_rate (a number, array or schedule) is the rule's `lr` (None for a rule without
    one: a chain that does not end in scale_by_learning_rate); the other hyperparameters
    are numbers (the rule's defaults where not given). A chain's masks and schedules
    (`mtapply.rules.chain`) apply: its masked hyperparameters are 0 on the leaves the masks
    leave out, its scheduled ones are the schedules' values at the step count. The state holds
    `count` and each read-written slot besides param, at its declared first value.
    `state_bits=8` keeps the slots the update writes (or those in `slots`) in 8 bits
    (`rule.with_state_bits(8, slots=slots, unsigned=unsigned, threshold=min_8bit_size)`: name
    second-moment-like slots in `unsigned`), 16 in bfloat16."""
    learning_rate = _rule_learning_rate(rule, learning_rate)
    return _transformation(user_rule(rule, hyper, state_bits, min_8bit_size, unsigned, slots),
                           learning_rate, flat_state)


def _rule_learning_rate(rule, learning_rate):
    """The learning rate a rule's engine is given: `learning_rate`, which a rule with an `lr`
    needs and a rule without one refuses (its calls then pass 0, which no kernel reads)."""
    if "lr" in rule.hyper:
        if learning_rate is None:
            raise TypeError(f"rule {rule.name!r} reads lr: give learning_rate (a number, an "
                            f"array or a schedule)")
        return learning_rate
    if learning_rate is not None:
        raise TypeError(f"rule {rule.name!r} has no lr, so learning_rate would change nothing: "
                        f"pass learning_rate=None, or end the chain in scale_by_learning_rate()")
    return 0.0


def alias(rule) -> Callable:
    """The rule as an optax factory, like `adam`: `alias(rule)(learning_rate, **hyper,
    flat_state=True)` is `transformation(rule, ...)`, and its signature lists the rule's
    hyperparameters with their defaults, so that `optax.inject_hyperparams(alias(rule))` can
    hold each of them in its state (and change them between steps).

    Example:
        >>> tx = optax.inject_hyperparams(mtapply.optax.alias(my_rule))(learning_rate=1e-3)
    """
    kinds = inspect.Parameter
    scheduled = getattr(rule, "schedules", None) or {}
    signature = inspect.Signature(
        [kinds("learning_rate", kinds.POSITIONAL_OR_KEYWORD,
               **({} if "lr" in rule.hyper else {"default": None}))]
        + [kinds(name, kinds.KEYWORD_ONLY, **({} if default is None else {"default": default}))
           for name, default in rule.hyper.items() if name != "lr" and name not in scheduled]
        + [kinds("flat_state", kinds.KEYWORD_ONLY, default=True)])

    def factory(learning_rate=None, *, flat_state=True, **hyper):
        return transformation(rule, learning_rate, flat_state=flat_state, **hyper)

    factory.__signature__ = signature
    factory.__name__ = factory.__qualname__ = rule.name
    return factory


def fused(rule, learning_rate=None, *, state_bits=None, min_8bit_size=None, unsigned=(),
          slots=None, **hyper) -> FusedOptimizer:
    """A user-written rule as a fused step, like `fused_adam` (learning_rate, a chain's masks
    and schedules, and `state_bits` as in `transformation`)."""
    learning_rate = _rule_learning_rate(rule, learning_rate)
    return _fused(user_rule(rule, hyper, state_bits, min_8bit_size, unsigned, slots),
                  learning_rate)


__all__ = ["AdamState", "EightBitEmaState", "FusedOptimizer", "LambState", "LarsState",
           "SgdState", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "adan", "alias", "dadapt_adamw",
           "flat_state",
           "fused", "fused_adadelta", "fused_adafactor", "fused_adagrad", "fused_adam", "fused_adamax",
           "fused_adamw", "fused_adan", "fused_dadapt_adamw", "fused_lamb", "fused_lars", "fused_lion", "fused_multi_transform",
           "fused_nadam", "fused_nadamw", "fused_prodigy", "fused_radam", "fused_rmsprop",
           "fused_schedule_free_adamw", "fused_sgd", "lamb", "lars", "lion", "multi_transform",
           "muon", "nadam", "nadamw", "prodigy", "radam", "rmsprop", "schedule_free_adamw",
           "schedule_free_eval_params", "scale_by_muon", "sgd", "transformation",
           "tree_state"]

# The states are this module's, to users and pickles alike (pickles of rule states call
# `_rule_state`, found here as in earlier versions).
for _public in (AdamState, LambState, LarsState, SgdState, _rule_state, FusedOptimizer):
    _public.__module__ = __name__
