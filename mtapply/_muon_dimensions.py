"""Which axes of a JAX leaf make Muon's matrices: optax.contrib.MuonDimensionNumbers resolved
leaf by leaf.

A leaf's dimension numbers name its reduction axes (the matrix's rows, fan_in) and its output
axes (the columns, fan_out); its other axes are a batch of independent matrices. A spec is None
(every leaf a matrix of rows then columns), one MuonDimensionNumbers for every leaf, a tree of
them (None for a leaf's default, or for a leaf that is not Muon's where the spec labels the
params), a prefix of the params' tree, or a callable that makes one from a tree. `leaf_axes`
resolves a spec to each leaf's `Axes`; `as_matrices` and `from_matrices` move a leaf to and from
its (batch, fan_in, fan_out) stack.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import numpy as np
import optax

DimensionNumbers = getattr(optax.contrib, "MuonDimensionNumbers", None)  # optax 0.2.6+


class Axes(NamedTuple):
    """A leaf's matrix axes, non-negative: batch, reduction (rows) and output (columns)."""
    batch: tuple
    reduction: tuple
    output: tuple


MATRIX = Axes((), (0,), (1,))  # a 2-D leaf's default: rows, then columns


class _Held:
    """A leaf's dimension numbers (or None) held as one pytree leaf."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def is_dimension_numbers(x) -> bool:
    return DimensionNumbers is not None and isinstance(x, DimensionNumbers)


def leaf_specs(spec, tree) -> list:
    """Each leaf of `tree`'s dimension numbers, or None, in `jax.tree.leaves` order: `spec`
    (a tree whose leaves are dimension numbers or None, a prefix of `tree`'s; or a callable
    making one from `tree`) broadcast over each of its subtrees."""
    if spec is None:
        return [None] * len(jax.tree.leaves(tree))
    if callable(spec) and not is_dimension_numbers(spec):
        spec = spec(tree)
    held = jax.tree.map(lambda value, subtree: jax.tree.map(lambda _: _Held(value), subtree),
                        spec, tree, is_leaf=lambda x: x is None or is_dimension_numbers(x))
    return [h.value for h in jax.tree.leaves(held, is_leaf=lambda x: isinstance(x, _Held))]


def leaf_axes(spec, tree, name: str) -> list:
    """Each leaf's `Axes` (`leaf_specs`; None: a 2-D leaf's rows and columns), checked: a
    ValueError names the leaf (by its path) and what is wrong, for `name`'s caller."""
    with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [_axes(leaf, dims, f"{name}: {jax.tree_util.keystr(path)}")
            for (path, leaf), dims in zip(with_paths, leaf_specs(spec, tree), strict=True)]


def _axes(leaf, dims, where: str) -> Axes:
    ndim = np.ndim(leaf)
    if dims is None:
        if ndim != 2:
            raise ValueError(f"{where} has shape {np.shape(leaf)}: without dimension numbers "
                             f"Muon takes matrices only (give it MuonDimensionNumbers, or leave "
                             f"it to AdamW)")
        return MATRIX
    if ndim < 2:
        raise ValueError(f"{where} has shape {np.shape(leaf)}: Muon's leaves have 2 or more "
                         f"axes")
    reduction, output = (_normalized(axes, ndim) for axes in (dims.reduction_axis,
                                                              dims.output_axis))
    named = reduction + output
    if len(set(named)) != len(named):
        raise ValueError(f"{where}: its dimension numbers {dims} name an axis twice (of "
                         f"{ndim}); reduction and output axes are disjoint")
    batch = tuple(k for k in range(ndim) if k not in named)
    return Axes(batch, reduction, output)


def _normalized(axes, ndim: int) -> tuple:
    """Axes as non-negative ints, counted from the end where negative (as optax counts them:
    modulo the rank)."""
    return tuple(int(a) % ndim for a in ((axes,) if isinstance(axes, int) else axes))


def fans(shape, axes: Axes) -> tuple:
    """(fan_in, fan_out): the sizes of a matrix's rows and columns."""
    return (math.prod(shape[k] for k in axes.reduction),
            math.prod(shape[k] for k in axes.output))


def as_matrices(x, axes: Axes):
    """The leaf as a (batch, fan_in, fan_out) stack of matrices."""
    batch = math.prod(x.shape[k] for k in axes.batch)
    return x.transpose(axes.batch + axes.reduction + axes.output).reshape(
        (batch, *fans(x.shape, axes)))


def from_matrices(stack, shape, axes: Axes):
    """A (batch, fan_in, fan_out) stack back in its leaf's `shape` and axes."""
    order = axes.batch + axes.reduction + axes.output
    return stack.reshape(tuple(shape[k] for k in order)).transpose(
        tuple(int(k) for k in np.argsort(order)))
