"""mtapply.optax.adafactor: optax.adafactor run by the rule `mtapply.rules.library.adafactor_optax`.

The state is optax's own (the chain's tuple: `FactoredState(count, v_row, v_col, v)`, the
schedule's count, `EmaState` with momentum), so the two transformations' states are
interchangeable; each update moves a param's two largest dimensions last for the rule
(`_adafactor_layout`), and optax's row and column vectors go to the one call as they are. The
fused form keeps the rule's state flat instead (`_optax_adafactor_flat`).

With `state_bits=8` the momentum is kept in 8 bits: optax's `EmaState` becomes an
`EightBitEmaState` whose `ema` holds uint8 codes (float32 for params under `min_8bit_size`
elements) and `ema_absmax` their block scales, laid out as the rule steps them (a param's two
largest dimensions last): blocks of 256 elements are runs of that order, so they are never
transposed.
"""
from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._adafactor_layout import _from_rule, _layout, _optax_vectors, _rule_slots, _to_rule
from ._optax_adafactor_flat import _FlatSteps
from ._optax_eight_bit import EightBitUserRule, storage
from ._optax_engine import Engine
from ._optax_make import FusedOptimizer, _state_dtype
from ._optax_ops import UserRule, _mask_leaves
from .rules import library
from .rules._factored import COL, FULL, ROW, UNFACTORED, slot_shape

# optax's own, bound when mtapply.optax is imported: a program that then swaps this module's
# adafactor in for optax's (as a drop-in) would otherwise have its init call itself
_OPTAX_ADAFACTOR = optax.adafactor


class EightBitEmaState(NamedTuple):
    """optax's EmaState with its ema in 8 bits (`adafactor(state_bits=8)`): per param, uint8
    codes in the rule's layout (float32 under min_8bit_size elements) and their block scales
    (empty for float32)."""

    count: jax.Array
    ema: object
    ema_absmax: object


def _static_int(option: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"mtapply.optax.adafactor: {option} must be a Python int (it shapes the "
                        f"state), got {value!r}; with optax.inject_hyperparams name it in "
                        f"static_args")
    return int(value)


def _static_bool(option: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"mtapply.optax.adafactor: {option} must be a bool (it chooses the "
                        f"update's lines), got {value!r}; with optax.inject_hyperparams name it "
                        f"in static_args")
    return bool(value)


def _number(option: str, value):
    if callable(value):
        raise TypeError(f"mtapply.optax.adafactor: {option} must be a number, not a schedule")
    return value


def adafactor(learning_rate=None, min_dim_size_to_factor=128, decay_rate=0.8, decay_offset=0,
              multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None,
              dtype_momentum=jnp.float32, weight_decay_rate=None, eps=1e-30, factored=True,
              weight_decay_mask=None, *, state_bits=None, min_8bit_size=None,
              flat_state=False) -> optax.GradientTransformation:
    """optax.adafactor on the rule `mtapply.rules.library.adafactor_optax`: optax's arguments,
    defaults and state (its chain's tuple, `FactoredState` first), one call per update.

    learning_rate is a number, an array or a schedule (None: no scaling, as optax's);
    min_dim_size_to_factor, factored, multiply_by_parameter_scale and whether clipping_threshold
    and momentum are None shape the step and are Python values; decay_rate, decay_offset,
    clipping_threshold, momentum, weight_decay_rate and eps may be arrays. weight_decay_mask
    (optax's: a pytree of bools like the params, or a callable of the params giving one)
    keeps the weight decay to the leaves where it is True; the leaves it leaves out are
    stepped by a call of their own. On GPUs the factored rule's kernels run in the XLA FFI
    call, as every mtapply.optax step, each param's shape passed to them when it is traced.

    state_bits=8 keeps the momentum (which needs `momentum`) in 8 bits, params under
    min_8bit_size elements (4096) in float32: the state's EmaState becomes an
    EightBitEmaState (see the module docstring); the factored moments stay optax's.

    flat_state=True keeps the state as `fused_adafactor` does (the rule's slots, one buffer
    per dtype; not with state_bits=8, whose state stays optax's): a jitted update then passes
    a few arrays of state rather than three per param, which JAX dispatches a few
    microseconds apiece. `fused_adafactor(...).tree_state(state, params)` with the same
    options gives optax's state of the same values, and its `flat_state` the reverse."""
    if not isinstance(flat_state, (bool, np.bool_)):
        raise TypeError(f"mtapply.optax.adafactor: flat_state must be a bool, got {flat_state!r}")
    init, run, _, _ = _adafactor_step(learning_rate, min_dim_size_to_factor, decay_rate,
                                      decay_offset, multiply_by_parameter_scale,
                                      clipping_threshold, momentum, dtype_momentum,
                                      weight_decay_rate, eps, factored, weight_decay_mask,
                                      state_bits, min_8bit_size, flat=bool(flat_state))

    def step(grads, state, params):
        if params is None:
            raise ValueError("mtapply.optax.adafactor reads the params: call "
                             "update(grads, state, params)")
        return run(params, grads, state, "delta")

    jitted = jax.jit(step)

    def update(updates, state, params=None, **extra_args):
        del extra_args  # arguments for other transformations of a chain (loss, ...)
        return jitted(updates, state, params)

    return optax.GradientTransformationExtraArgs(init, update)


def fused_adafactor(learning_rate=None, min_dim_size_to_factor=128, decay_rate=0.8,
                    decay_offset=0, multiply_by_parameter_scale=True, clipping_threshold=1.0,
                    momentum=None, dtype_momentum=jnp.float32, weight_decay_rate=None, eps=1e-30,
                    factored=True, weight_decay_mask=None, *, state_bits=None,
                    min_8bit_size=None) -> FusedOptimizer:
    """`adafactor` as a fused step: `opt.step(params, grads, state) -> (params, state)`, the
    step writing the new params (in place under a jit that donates params and state, except
    for params whose two largest dimensions it moves last, which go through moved copies).

    The state is the rule's, flat: `count`, then `row_var`, `col_var` and `variance` (and
    `ema` with a momentum), each one buffer per dtype holding every param's vectors (its two
    largest dimensions last) or full variance, so that a jitted step passes three or four
    arrays of state rather than three per param (JAX's dispatch takes a few microseconds per
    array). `tree_state(state, params)` gives optax.adafactor's state of the same values, and
    `flat_state(optax_state, params)` the reverse. With state_bits=8 the state is optax's (its
    EmaState made 8-bit, as `adafactor` keeps it), and those two return it as it is."""
    init, run, tree_state, flat_state = _adafactor_step(
        learning_rate, min_dim_size_to_factor, decay_rate, decay_offset,
        multiply_by_parameter_scale, clipping_threshold, momentum, dtype_momentum,
        weight_decay_rate, eps, factored, weight_decay_mask, state_bits, min_8bit_size,
        flat=True)

    def step(params, grads, state):
        return run(params, grads, state, "inplace")

    return FusedOptimizer(init, jax.jit(step), jax.jit(step, donate_argnums=(0, 2)),
                          tree_state, flat_state)


def _as_it_is(state, params):
    del params
    return state


def _adafactor_step(learning_rate, min_dim_size_to_factor, decay_rate, decay_offset,
                    multiply_by_parameter_scale, clipping_threshold, momentum, dtype_momentum,
                    weight_decay_rate, eps, factored, weight_decay_mask, state_bits=None,
                    min_8bit_size=None, flat: bool = False) -> tuple:
    """(init, run, tree_state, flat_state): optax's own init (the same state, so that either
    transformation takes the other's; with 8-bit momentum its EmaState made 8-bit) and
    run(params, grads, state, mode), one step in the engine's mode ("delta": the updates;
    "inplace": the new params); the two conversions return the state as it is. With `flat`
    (the fused form) the state is the rule's, flat (`_FlatSteps`), but with 8-bit momentum."""
    factored = _static_bool("factored", factored)
    min_dim = _static_int("min_dim_size_to_factor", min_dim_size_to_factor)
    bits, min_8bit = _momentum_storage(state_bits, min_8bit_size, momentum, dtype_momentum)
    rule = _adafactor_rule(decay_rate, decay_offset, multiply_by_parameter_scale,
                           clipping_threshold, momentum, dtype_momentum, weight_decay_rate, eps,
                           min_8bit if bits == 8 else None)
    rule.factoring = _Factoring(factored, min_dim,
                                _state_dtype("adafactor", "dtype_momentum", dtype_momentum))
    # without a weight decay optax has no add_decayed_weights link, and so no mask
    mask = None if weight_decay_rate is None else weight_decay_mask
    engine = Engine(rule, 1.0 if learning_rate is None else learning_rate, flat=flat)
    optax_init = _OPTAX_ADAFACTOR(learning_rate, min_dim, decay_rate, decay_offset,
                                  multiply_by_parameter_scale, clipping_threshold, momentum,
                                  dtype_momentum, weight_decay_rate, eps, factored,
                                  weight_decay_mask).init
    if engine.flat:  # (8-bit momentum keeps a tree)
        steps = _FlatSteps(engine, rule, mask, optax_init)
        return steps.init, steps.run, steps.tree_state, steps.flat_state

    def init(params):
        state = optax_init(params)
        if bits != 8:
            return state
        layouts = [_layout(np.shape(x), factored, min_dim) for x in jax.tree.leaves(params)]
        return tuple(_eight_bit_ema(rule, link, params, layouts)
                     if isinstance(link, optax.EmaState) else link for link in state)

    def run(params, grads, state, mode: str):
        return _update(engine, rule, factored, min_dim, mask, grads, state, params, mode)

    return init, run, _as_it_is, _as_it_is


def _momentum_storage(state_bits, min_8bit_size, momentum, dtype_momentum) -> tuple:
    """(state_bits, min_8bit_size) of the momentum, checked: 8 needs a momentum to keep and
    chooses its dtype itself."""
    bits, min_8bit = storage(state_bits, min_8bit_size)
    if bits == 16:
        raise ValueError("mtapply.optax.adafactor: state_bits=16 is dtype_momentum=jnp.bfloat16; "
                         "state_bits takes 8 (or 32)")
    if bits == 8 and momentum is None:
        raise ValueError("mtapply.optax.adafactor keeps no momentum without momentum=...: "
                         "state_bits=8 has nothing to store (leave it at 32)")
    if bits == 8 and dtype_momentum not in (None, jnp.float32):
        raise ValueError(f"mtapply.optax.adafactor: state_bits and dtype_momentum both choose "
                         f"the momentum's dtype (got dtype_momentum={dtype_momentum}): pass one "
                         f"of them")
    return bits, min_8bit


def _eight_bit_ema(rule, link, params, layouts: list) -> EightBitEmaState:
    """optax's zero EmaState as the 8-bit rule's `ema` and `ema_absmax` (float32 under its
    threshold), made by the rule for params of the rule's layout."""
    moved = jax.tree.structure(params).unflatten(
        [jax.ShapeDtypeStruct(tuple(np.shape(x)[i] for i in layout.perm), jnp.float32)
         for x, layout in zip(jax.tree.leaves(params), layouts)])
    return EightBitEmaState(link.count, rule.init_slot("ema", moved, None),
                            rule.init_slot("ema_absmax", moved, None))


def _adafactor_rule(decay_rate, decay_offset, multiply_by_parameter_scale, clipping_threshold,
                    momentum, dtype_momentum, weight_decay_rate, eps,
                    min_8bit=None) -> UserRule:
    """The rule of these options: None (clipping, momentum) and False leave a link's line
    out; the numbers are its hyperparameters. min_8bit: the momentum in 8 bits for params of
    that many elements or more."""
    param_scale = _static_bool("multiply_by_parameter_scale", multiply_by_parameter_scale)
    _state_dtype("adafactor", "dtype_momentum", dtype_momentum)
    weight_decay = 0.0 if weight_decay_rate is None else weight_decay_rate
    hyper = dict(eps=_number("eps", eps), weight_decay=_number("weight_decay_rate", weight_decay))
    if clipping_threshold is not None:
        hyper["clipping_threshold"] = _number("clipping_threshold", clipping_threshold)
    if momentum is not None:
        hyper["momentum"] = _number("momentum", momentum)
    lines = library.adafactor_optax(clipping_threshold is not None, param_scale,
                                    momentum is not None)
    if min_8bit is not None:
        lines = lines.with_state_bits(8, slots=("ema",), threshold=min_8bit)
        return _EightBitAdafactorRule(lines, hyper, _number("decay_rate", decay_rate),
                                      _number("decay_offset", decay_offset))
    return _AdafactorRule(lines, hyper, _number("decay_rate", decay_rate),
                          _number("decay_offset", decay_offset))


class _Factoring(NamedTuple):
    """Which params optax factors (`factored`, `min_dim_size_to_factor`) and the dtype of the
    momentum (None: each param's)."""

    factored: bool
    min_dim: int
    momentum_dtype: object


_SLOT_FORMS = {"row_var": ROW, "col_var": COL, "variance": UNFACTORED, "ema": FULL}


class _AdafactorRule(UserRule):
    """The rule with optax's second-moment decay at each step, 1 - (count - decay_offset +
    1)^-decay_rate, computed as optax computes it (in float32), a per-step scalar."""

    factoring = _Factoring(True, 128, None)
    optax_names = {"weight_decay": "weight_decay_rate",
                   "decay": "the step's decay 1 - (count - decay_offset + 1)^-decay_rate"}

    def __init__(self, rule, hyper: dict, decay_rate, decay_offset):
        self.decay_rate, self.decay_offset = decay_rate, decay_offset
        super().__init__(rule, dict(hyper, decay=0.0), name="adafactor")
        del self.hyper["decay"]  # a step argument, computed per step
        self._tracing = threading.local()
        # (the fused form's flat state: its vectors are not shaped like the params)
        self.state_type.converted_by = ("mtapply.optax.fused_adafactor (or adafactor with "
                                        "flat_state=True, whose state a fused_adafactor of "
                                        "the same options converts)")

    def slot_structs(self, field: str, structs: list) -> list:
        """Each param's slot `field` in a flat state (`Engine`), the params given with their
        two largest dimensions last (as the rule steps them): a factored param's row and column
        vectors, any other's full variance (`_factored.slot_shape`); the momentum like the
        params."""
        dtype = self.factoring.momentum_dtype if field == "ema" else None
        return [jax.ShapeDtypeStruct(slot_shape(_SLOT_FORMS[field], s.shape, self._factors(s.shape)),
                                     dtype or s.dtype) for s in structs]

    def _factors(self, shape: tuple) -> bool:
        """optax's choice (`_layout`) for a param whose two largest dimensions are last: the
        smaller of those at least min_dim_size_to_factor."""
        return (self.factoring.factored and len(shape) >= 2
                and min(shape[-2:]) >= self.factoring.min_dim)

    def statics(self, params, treedef) -> tuple:
        """Each leaf's weight-decay flag, where the mask leaves some leaf out: resolved by
        `decay_flags` on the caller's params, since the engine sees them moved (a callable
        mask may read their shapes)."""
        flags = getattr(self._tracing, "flags", None)
        if flags is None or all(flags):
            return ()
        return tuple((flag,) for flag in flags)

    def class_args(self, statics) -> dict:
        """No weight decay for a call whose leaves the mask leaves out."""
        return {"weight_decay": 0.0} if statics and not statics[0][0] else {}

    @contextlib.contextmanager
    def decay_flags(self, flags):
        """The step's leaves take these weight-decay flags (None: all decay) within."""
        self._tracing.flags = flags
        try:
            yield
        finally:
            self._tracing.flags = None

    def per_step(self, learning_rate, count, state) -> tuple:
        t = jnp.asarray(count - self.decay_offset + 1, jnp.float32)
        return [1.0 - t ** -jnp.asarray(self.decay_rate, jnp.float32)], []

    def fixed_args(self, statics, lr, step, decay=None, *more) -> dict:
        return dict(lr=lr, step=step, decay=decay, **self.hyper)


class _EightBitAdafactorRule(_AdafactorRule, EightBitUserRule):
    """The rule with its momentum in 8 bits (fields `ema` and `ema_absmax`)."""


def _update(engine: Engine, rule: _AdafactorRule, factored: bool, min_dim: int, mask, grads,
            state, params, mode: str):
    """(updates, state) of one step, or (new params, state) in the "inplace" mode: optax's
    state into the rule's slots, one engine call (per weight-decay class where `mask` splits
    the leaves), and back."""
    leaves, treedef = jax.tree.flatten(params)
    flags = None if mask is None else _mask_leaves(mask, params, treedef, "weight_decay_mask")
    layouts = [_layout(x.shape, factored, min_dim) for x in leaves]
    rms_state = next(s for s in state if isinstance(s, optax.FactoredState))
    ema_state = next((s for s in state if isinstance(s, (optax.EmaState, EightBitEmaState))),
                     None)
    _check_momentum_state(rule, ema_state)
    v_rows, v_cols, vs = (treedef.flatten_up_to(t) for t in
                          (rms_state.v_row, rms_state.v_col, rms_state.v))
    slots = _rule_slots(layouts, v_rows, v_cols, vs)
    if isinstance(ema_state, EightBitEmaState):  # (in the rule's layout already)
        slots += [treedef.flatten_up_to(ema_state.ema), treedef.flatten_up_to(ema_state.ema_absmax)]
    elif ema_state is not None:
        slots.append([_to_rule(x, l) for x, l in
                      zip(treedef.flatten_up_to(ema_state.ema), layouts)])
    inner = rule.state_type(rms_state.count, *(treedef.unflatten(s) for s in slots))
    moved = [treedef.unflatten([_to_rule(x, l) for x, l in zip(xs, layouts)])
             for xs in (leaves, treedef.flatten_up_to(grads))]
    # optax's learning-rate link counts for itself (scale_by_schedule's state)
    schedule = next((s for s in state if isinstance(s, optax.ScaleByScheduleState)), None)
    with rule.decay_flags(flags):
        updates, inner = engine.apply(moved[0], moved[1], inner, mode=mode,
                                      schedule_count=None if schedule is None else schedule.count)
    updates = treedef.unflatten([_from_rule(u, l) for u, l in
                                 zip(treedef.flatten_up_to(updates), layouts)])
    return updates, _new_state(state, inner, treedef, layouts, v_rows, v_cols, vs)


def _check_momentum_state(rule, ema_state) -> None:
    """A float momentum state given to the 8-bit transformation, or the reverse, is refused."""
    eight = isinstance(rule, _EightBitAdafactorRule)
    if ema_state is not None and eight != isinstance(ema_state, EightBitEmaState):
        made, given = ("8-bit", "float") if eight else ("float", "8-bit")
        raise ValueError(f"mtapply.optax.adafactor: a {made} momentum's transformation was "
                         f"given a {given} momentum state: init the state with the same "
                         f"state_bits")


def _new_state(state: tuple, inner, treedef, layouts: list, v_rows: list, v_cols: list,
               vs: list) -> tuple:
    """optax's chain state after the step: the factored moments and the ema from the rule's
    state, every count of the chain's links one more."""
    rows, cols, variances = (treedef.flatten_up_to(getattr(inner, name))
                             for name in ("row_var", "col_var", "variance"))
    v_row, v_col, v = [], [], []
    for i, layout in enumerate(layouts):
        if layout.axes is None:
            v_row.append(v_rows[i])
            v_col.append(v_cols[i])
            v.append(variances[i])
        else:
            new_row, new_col = _optax_vectors(rows[i], cols[i], layout)
            v_row.append(new_row)
            v_col.append(new_col)
            v.append(vs[i])  # optax's placeholder of a factored param
    new = []
    for link in state:
        if isinstance(link, optax.FactoredState):
            link = link._replace(count=inner.count, v_row=treedef.unflatten(v_row),
                                 v_col=treedef.unflatten(v_col), v=treedef.unflatten(v))
        elif isinstance(link, EightBitEmaState):
            link = link._replace(count=optax.safe_increment(link.count), ema=inner.ema,
                                 ema_absmax=inner.ema_absmax)
        elif isinstance(link, optax.EmaState):
            ema = [_from_rule(x, l) for x, l in zip(treedef.flatten_up_to(inner.ema), layouts)]
            link = link._replace(count=optax.safe_increment(link.count),
                                 ema=treedef.unflatten(ema))
        elif "count" in getattr(link, "_fields", ()):  # the learning rate schedule's
            link = link._replace(count=optax.safe_increment(link.count))
        new.append(link)
    return tuple(new)
