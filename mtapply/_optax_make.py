"""How mtapply.optax makes its two forms from an op: the optax transformation (an update that
returns updates) and the fused step (`FusedOptimizer`), and the checks every constructor shares."""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._optax_engine import Engine
from ._optax_ops import OptaxRule
from ._optax_state import FLOATS, flat_state, tree_state


class FusedOptimizer(NamedTuple):
    """The fused form: `step(params, grads, state) -> (params, state)`.

    `step` is pure; inside a `jax.jit` that donates params and state it updates them in place.
    `donated_step` is `step` jitted with params and state donated (they are invalid afterwards).
    The state keeps each moment of every param in one flat buffer per dtype (so a step passes
    a few arrays, not one per param); `tree_state(state, params)` gives it as pytrees like
    params, as optax keeps it (for inspection and checkpoints), and
    `flat_state(tree_state, params)` makes such a state flat again (the module's functions of
    the same names).
    """

    init: Callable
    step: Callable
    donated_step: Callable
    tree_state: Callable
    flat_state: Callable


def _transformation(rule: OptaxRule, learning_rate, flat_state: bool) -> optax.GradientTransformation:
    """An optax.GradientTransformation whose update returns updates (new params - params),
    written by the kernel itself: params are only read, and not at all by rules that do not
    depend on them."""
    engine = Engine(rule, learning_rate, flat=flat_state)

    def step(updates, state, params):
        if not rule.reads_params:  # the step from zero params is the update itself
            return engine.apply(params, updates, state, mode="zero")
        if params is None:
            raise ValueError(f"mtapply.optax.{rule.name} with these options reads the params: "
                             f"call update(grads, state, params)")
        return engine.apply(params, updates, state, mode="delta")

    jitted = jax.jit(step)

    def update(updates, state, params=None, **extra_args):
        del extra_args  # arguments for other transformations of a chain (loss, ...)
        return jitted(updates, state, params)

    transformation = _Transformation(engine.init, update)
    transformation.mtapply = (rule, learning_rate, flat_state)
    return transformation


class _Transformation(optax.GradientTransformationExtraArgs):
    """An optax transformation (its update takes optax's extra arguments, and ignores them)
    that knows its rule (`mtapply`: rule, learning rate, flat_state), so that
    `multi_transform` can run several as one."""


def _fused(rule: OptaxRule, learning_rate) -> FusedOptimizer:
    engine = Engine(rule, learning_rate, flat=True)
    optimizer = _Fused(engine.init, jax.jit(engine.apply),
                       jax.jit(engine.apply, donate_argnums=(0, 2)), tree_state, flat_state)
    optimizer.mtapply = (rule, learning_rate, True)
    return optimizer


class _Fused(FusedOptimizer):
    """A FusedOptimizer that knows its rule (as `_Transformation`), for
    `fused_multi_transform`."""


def _refuse(name: str, peer: str | None = None, **options) -> None:
    """NotImplementedError for optax options mtapply's kernels do not have (structural ones:
    None, bools, masks); `peer`: optax's function, where not optax.<name>."""
    for option, (value, default) in options.items():
        if value is not default and value != default:
            raise NotImplementedError(f"mtapply.optax.{name}: {option}={value!r} is not supported "
                                      f"(only {option}={default!r}); use {peer or 'optax.' + name} "
                                      f"for it")


def _state_dtype(name: str, option: str, dtype):
    """optax's mu_dtype (and the like) as the dtype a state slot keeps: None (the params'),
    or a floating dtype the kernels store (canonical: float32 for float64 without x64)."""
    if dtype is None:
        return None
    dtype = jax.dtypes.canonicalize_dtype(jnp.dtype(dtype))
    if dtype.name not in FLOATS:
        raise NotImplementedError(f"mtapply.optax.{name}: {option}={dtype.name} is not "
                                  f"supported: mtapply keeps states in float16, bfloat16, "
                                  f"float32 or float64; use optax.{name} for {dtype.name} states")
    return dtype
