"""Factored slots: state kept as a matrix's row and column vectors instead of one value per
element (Adafactor's second moment: rows + cols numbers, not rows x cols).

A rule declares a state slot's form after its access, `NAME:rw@FORM`:
- `@row`: one value per row of the param's last two dimensions, shaped (..., rows, 1);
- `@col`: one value per column, shaped (..., 1, cols);
- `@unfactored`: one value per element, kept only for params that are not factored.
A param is *factored* where it has two or more dimensions whose last two are each at least a
minimum size (1 in torch.optim.Adafactor; optax's `min_dim_size_to_factor`): its `@row` and
`@col` slots hold vectors and its `@unfactored` slots are empty (no elements); any other param
has empty `@row` and `@col` slots and full `@unfactored` ones. The state given decides which
a param is (`mode_of`), so the adapters choose the minimum size when they make it.

The CPU backend steps a factored param as a stack of matrices, (batch, rows, cols), with its
`@row` slots shaped (batch, rows, 1) and its `@col` slots (batch, 1, cols): the rule's
row_mean and col_mean reduce over the last and the second-to-last axis, and NumPy's
broadcasting gives an element each row's and column's value.
"""
from __future__ import annotations

import math

FULL, ROW, COL, UNFACTORED = "full", "row", "col", "unfactored"
FORMS = (ROW, COL, UNFACTORED)  # the forms a declaration may name (`full` is the default)
FACTORED_ONLY = "factored"  # a value (or line) that exists for factored params only
UNFACTORED_ONLY = "unfactored"
# the matrix axes along which a value of each slot form varies (element values: both)
AXES = {FULL: frozenset("rc"), UNFACTORED: frozenset("rc"), ROW: frozenset("r"),
        COL: frozenset("c")}


def is_factored(shape: tuple, min_dim_size: int = 1) -> bool:
    """Whether a param of `shape` keeps factored state: two or more dimensions, the last two
    each at least `min_dim_size`."""
    return len(shape) >= 2 and min(shape[-2], shape[-1]) >= min_dim_size


def slot_shape(form: str, shape: tuple, factored: bool) -> tuple:
    """The shape of a slot of `form` beside a param of `shape` (factored or not); (0,) where
    the param keeps none of it."""
    shape = tuple(int(n) for n in shape)
    if form == FULL or (form == UNFACTORED and not factored):
        return shape
    if not factored or form == UNFACTORED:
        return (0,)
    return shape[:-1] + (1,) if form == ROW else shape[:-2] + (1, shape[-1])


def mode_of(param_shape: tuple, sizes: dict) -> bool | None:
    """Whether a param of `param_shape` is stepped as factored, from the element counts of its
    slots (form -> the counts of that form's slots); None where they fit neither mode."""
    for factored in (True, False):
        if factored and len(param_shape) < 2:
            continue
        if all(n == math.prod(slot_shape(form, param_shape, factored))
               for form, counts in sizes.items() for n in counts):
            return factored
    return None


def stacked(param_shape: tuple) -> tuple:
    """(batch, rows, cols) of a factored param: its leading dimensions stacked."""
    return (math.prod(param_shape[:-2]), param_shape[-2], param_shape[-1])


def canonical_shape(form: str, param_shape: tuple) -> tuple:
    """The shape the CPU backend gives a slot of `form` of a factored param."""
    batch, rows, cols = stacked(param_shape)
    return {ROW: (batch, rows, 1), COL: (batch, 1, cols)}.get(form, (batch, rows, cols))
