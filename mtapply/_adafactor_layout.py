"""optax.adafactor's layout of its state against the rule's (`library.adafactor_optax`).

optax factors a param over its two largest dimensions; the rule factors over the last two. A
step therefore moves those two dimensions last (keeping their order), a transpose of the param
and grad only where they are not last already (never for matrices). optax's row and column
vectors then hold the values of the rule's (..., rows, 1) and (..., 1, cols) slots in their
order; a moved param's are transposed there and back (small arrays).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class _Layout(NamedTuple):
    """How one param steps: `axes` (the largest dimension and the second largest, optax's
    order) where it is factored, else None; `perm` moves the two last for the rule."""

    axes: tuple | None
    perm: tuple

    @property
    def moved(self) -> bool:
        return self.perm != tuple(range(len(self.perm)))


def _layout(shape: tuple, factored: bool, min_dim_size: int) -> _Layout:
    """optax's choice for a param of `shape`: factored over its two largest dimensions when
    the smaller of the two is at least `min_dim_size`. Ties are ordered by NumPy's default
    argsort, as optax orders them."""
    identity = tuple(range(len(shape)))
    if not factored or len(shape) < 2:
        return _Layout(None, identity)
    order = np.argsort(shape)
    largest, second = int(order[-1]), int(order[-2])
    if shape[second] < min_dim_size:
        return _Layout(None, identity)
    pair = sorted((largest, second))
    return _Layout((largest, second), tuple(i for i in identity if i not in pair) + tuple(pair))


def _to_rule(x, layout: _Layout):
    return jnp.transpose(x, layout.perm) if layout.moved else x


def _from_rule(x, layout: _Layout):
    return jnp.transpose(x, np.argsort(layout.perm)) if layout.moved else x


def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _rule_vectors(v_row, v_col, layout: _Layout) -> tuple:
    """(row_var, col_var) of the rule from optax's v_row (the mean over the largest dimension)
    and v_col (over the second largest): the rule's row_var is the mean over the last
    dimension, the larger index of the two. Where those two dimensions are last already,
    optax's vectors hold the rule's values in the rule's order and go as they are (the
    kernels read their sizes, not their shapes): reshaped, each donated vector would cost
    XLA a copy into the call and one out of it."""
    largest, second = layout.axes
    by_axis = {largest: v_row, second: v_col}
    last, before = max(layout.axes), min(layout.axes)
    if not layout.moved:
        return by_axis[last], by_axis[before]
    return (_to_rule(jnp.expand_dims(by_axis[last], last), layout),
            _to_rule(jnp.expand_dims(by_axis[before], before), layout))


def _optax_vectors(row_var, col_var, layout: _Layout) -> tuple:
    """optax's (v_row, v_col) from the rule's row_var and col_var (`_rule_vectors` reversed)."""
    last, before = max(layout.axes), min(layout.axes)
    if layout.moved:
        row_var = jnp.squeeze(_from_rule(row_var, layout), last)
        col_var = jnp.squeeze(_from_rule(col_var, layout), before)
    by_axis = {last: row_var, before: col_var}
    largest, second = layout.axes
    return by_axis[largest], by_axis[second]


def _rule_slots(layouts: list, v_rows: list, v_cols: list, vs: list) -> list:
    """The leaves of the rule's row_var, col_var and variance from optax's v_row, v_col and
    v: a factored param keeps the vectors, any other the full variance (the other slots
    empty, which tells the step which a param is)."""
    rows, cols, variances = [], [], []
    for layout, v_row, v_col, v in zip(layouts, v_rows, v_cols, vs):
        if layout.axes is None:
            row_var, col_var, variance = _empty(v.dtype), _empty(v.dtype), v
        else:
            row_var, col_var = _rule_vectors(v_row, v_col, layout)
            variance = _empty(v.dtype)
        rows.append(row_var)
        cols.append(col_var)
        variances.append(variance)
    return [rows, cols, variances]
