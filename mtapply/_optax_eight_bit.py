"""8-bit state in mtapply.optax: a rule made with `with_state_bits(8)` as a transformation.

Each 8-bit slot is a state field of uint8 codes shaped as its param (float32 values for params
under the rule's threshold), beside a field `<slot>_absmax` of its block scales (one float32
per 256 elements; none for float32 state), the layout the functional rule's `state(params)`
makes. The state stays a tree like params, one buffer per leaf (`flat_state` does not apply:
its buffers' shapes are their own)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import quantization
from ._optax_ops import UserRule, is_number
from ._optax_state import leaf_struct
from .rules._quantized import scale_name


class EightBitUserRule(UserRule):
    """A user rule whose slots `rule.eight_bit` are kept in 8 bits (see the module docstring)."""

    tree_state = True

    def __init__(self, rule, hyper: dict, initial: dict | None = None, name: str | None = None):
        starts = {**rule.initial, **(initial or {})}
        for slot in rule.eight_bit:  # (before the hyperparameters are checked)
            value = starts.get(slot, 0.0)
            if isinstance(value, str) or not is_number(value):
                raise NotImplementedError(
                    f"mtapply.optax.{name or rule.name}: the 8-bit slot {slot!r} starts as "
                    f"{'a copy of the params' if isinstance(value, str) else 'an array'}, which "
                    f"mtapply.optax does not quantize: start it at a number, or keep it in "
                    f"float32 (with_state_bits(8, slots=...) without it)")
        super().__init__(rule, hyper, initial, name)
        self.scales = {scale_name(slot): slot for slot in rule.eight_bit}
        # fields of shapes of their own: tree_state and flat_state leave them as they are
        self.state_type = _eight_bit_state_type(self.state_type)

    def init_slot(self, field: str, params, layout):
        rule = self.user
        if field in rule.eight_bit:
            value = float(self.initial.get(field, 0.0))
            code, _ = self._constant(field, value)
            return jax.tree.map(lambda p: jnp.full(np.shape(p), code, jnp.uint8) if self._eight(p)
                                else jnp.full(np.shape(p), value, jnp.float32), params)
        if field in self.scales:
            slot = self.scales[field]
            _, scale = self._constant(slot, float(self.initial.get(slot, 0.0)))
            return jax.tree.map(
                lambda p: jnp.full(quantization.n_blocks(_size(p)) if self._eight(p) else 0,
                                   scale, jnp.float32), params)
        return super().init_slot(field, params, layout)

    def _eight(self, param) -> bool:
        return _size(param) >= self.user.threshold

    def _constant(self, slot: str, value: float) -> tuple:
        """(code, scale) of a block whose every element is `value`."""
        codes, scales = quantization.quantize_blockwise(
            np.full(quantization.BLOCK, value, np.float32), signed=slot not in self.user.unsigned)
        return int(codes[0]), float(scales[0])


def user_rule(rule, hyper: dict, state_bits=None, min_8bit_size=None, unsigned=(),
              slots=None) -> UserRule:
    """The adapter of a user-written rule: 8-bit state where the rule keeps some, or as
    `with_storage` gives it."""
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if (unsigned or slots is not None) and state_bits != 8:
        raise ValueError("unsigned and slots name slots kept in 8 bits: they take state_bits=8")
    if getattr(rule, "eight_bit", ()):
        if state_bits != 32:
            raise ValueError(f"rule {rule.name!r} already keeps 8-bit state (with_state_bits): "
                             f"leave state_bits at 32")
        return EightBitUserRule(rule, hyper)
    return with_storage(UserRule(rule, hyper), state_bits, min_8bit_size, unsigned, slots)


def with_storage(made: UserRule, state_bits, min_8bit_size, unsigned=(),
                 slots=None) -> UserRule:
    """`made` (a rule's adapter, user-written or a library transformation's) with the state
    slots its update writes (or those in `slots`) kept in 8 bits (those in `unsigned`, never
    negative, on the map of values >= 0; params under `min_8bit_size` elements in float32) or
    in bfloat16 (16)."""
    state_bits, min_8bit_size = storage(state_bits, min_8bit_size)
    if state_bits == 32:
        return made
    rule = made.user
    if getattr(made, "slot_dtypes", None):
        raise ValueError(f"mtapply.optax.{made.name}: state_bits and mu_dtype both choose the "
                         f"state's dtype: pass one of them")
    if not rule.written_state:
        raise ValueError(f"mtapply.optax.{made.name} keeps no state with these options: "
                         f"state_bits has nothing to store (leave it at 32)")
    if state_bits == 16:
        made.slot_dtypes = dict.fromkeys(rule.written_state, jnp.bfloat16)
        return made
    rule = rule.with_state_bits(8, slots=slots, unsigned=unsigned, threshold=min_8bit_size)
    eight = EightBitUserRule(rule, {**made.hyper, **made.dynamic}, made.initial, made.name)
    eight.masks = made.masks  # (an adapter's own, as lars's and lamb's)
    if made.norm_hyper is not None:
        eight.take_global_norm(made.norm_hyper)
    return eight


def storage(state_bits, min_8bit_size) -> tuple:
    """(state_bits, min_8bit_size), checked; None takes the defaults, 32 and 4096 (None,
    which optax.inject_hyperparams leaves alone: it would make numbers arrays)."""
    state_bits = 32 if state_bits is None else state_bits
    min_8bit_size = 4096 if min_8bit_size is None else min_8bit_size
    for name, value in (("state_bits", state_bits), ("min_8bit_size", min_8bit_size)):
        if hasattr(value, "shape"):
            raise TypeError(f"{name} chooses the state's layout and cannot be an array: with "
                            f"optax.inject_hyperparams, name it in static_args=('{name}',)")
    if state_bits not in (8, 16, 32) or isinstance(state_bits, bool):
        raise ValueError(f"state_bits must be 8, 16 (bfloat16) or 32, got {state_bits!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 1:
        raise ValueError(f"Invalid min_8bit_size: {min_8bit_size!r} (a whole number >= 1)")
    return state_bits, min_8bit_size


def _eight_bit_state_type(state_type) -> type:
    """The rule's state class, made for 8-bit fields: conversions to and from the flat layout
    (`mtapply.optax.tree_state`, `flat_state`) pass them as they are."""
    state_type.slot_fields = ()
    return state_type


def _size(param) -> int:
    return int(np.prod(leaf_struct(param).shape, dtype=np.int64))
