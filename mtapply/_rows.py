"""Per-tensor hyperparameters.

Any number a step takes may be a sequence of one value per tensor (as param groups make them):
numbers, or device values the kernel reads (one-element float32 arrays, e.g. each group's lr
tensor), known by identity.
A plan steps the distinct combinations, its *rows*: the kernel reads `args_rows[row_of[tensor]]`
from two small device tables. What a step costs on the host:

- the sequences of the previous step again (equal, or the same tuples): nothing is packed;
- only scheduled values (lr) changed, one value still per row: one column is checked at its
  extremes and patched: on a GPU, into the slots the rows read it from (one small async copy);
- anything else: the rows are found and checked again.
"""
from __future__ import annotations

import operator

import numpy as np


class Rows:
    """Checked per-tensor hyperparameters: the args of each row and each tensor's row.

    Rows found and checked anew are their own `origin`. Rows that differ from their origin only
    in scheduled columns hold those columns in `patched` (name -> one float64 per row), so the
    device rows of the origin can be patched in place.
    """

    __slots__ = ("hyper", "columns", "row_of", "firsts", "origin", "patched", "_checked",
                 "_numbers", "_checked_range")

    def __init__(self, hyper: dict, columns: dict, row_of: np.ndarray, firsts: np.ndarray,
                 checked=None, origin=None, patched=None):
        self.hyper = hyper  # the step's hyperparameters as given
        self.columns = columns  # name -> float64 array of one value per tensor
        self.row_of = row_of  # int32: each tensor's row
        self.firsts = firsts  # the first tensor of each row
        self.origin = self if origin is None else origin
        self.patched = patched or {}
        self._checked = checked
        self._numbers = {}  # name -> one float64 per row, of the origin's checked numbers
        self._checked_range = {}  # scheduled name -> (low, high): values checked in patches

    @property
    def checked(self) -> list:
        """The checked args of each row."""
        if self._checked is None:
            self._checked = [self._patch_row(args, r) for r, args in enumerate(self.origin.checked)]
        return self._checked

    @property
    def first(self) -> dict:
        """The checked args of row 0 (the launch's own args, which rows replace)."""
        if self._checked is not None:
            return self._checked[0]
        return self._patch_row(self.origin.checked[0], 0)

    def holds_numbers(self, name: str) -> bool:
        """Whether every row holds `name` as a number (not a device value)."""
        return name in self.hyper and all(type(row[name]) is float for row in self.origin.checked)

    def per_row(self, name: str) -> np.ndarray:
        """The value of `name` in each row (float64), for a name that every row holds as a
        number."""
        if name in self.patched:
            return self.patched[name]
        numbers = self.origin._numbers
        if name not in numbers:
            numbers[name] = np.array([row[name] for row in self.origin.checked], np.float64)
        return numbers[name]

    def _patch_row(self, args: dict, r: int) -> dict:
        return dict(args, **{name: float(values[r]) for name, values in self.patched.items()})

    def subset(self, indices: np.ndarray) -> Rows:
        """Origin rows for the tensors at `indices` (every row kept, with its number)."""
        return Rows(self.hyper, self.columns, self.row_of[indices], self.firsts, self.checked)

    def on(self, origin: Rows) -> Rows:
        """These rows' patches over `origin` (a subset of this one's origin)."""
        if self.origin is self:
            return origin
        return Rows(self.hyper, self.columns, origin.row_of, self.firsts, origin=origin,
                    patched=self.patched)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype hold the same values, bit for bit (a tenth of
    `np.array_equal`'s cost on small arrays; the values compared here are checked numbers, so
    never NaN)."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def per_tensor(hyper: dict, outputs=()) -> list:
    """The names of the values given per tensor: lists, tuples, 1-D NumPy arrays of more than
    one element (a one-element array is one value for all); not the `outputs` arrays."""
    return [name for name, value in hyper.items() if name not in outputs and (
        isinstance(value, (list, tuple))
        or (isinstance(value, np.ndarray) and value.ndim == 1 and value.size != 1))]


def rows_for(spec, hyper: dict, n_tensors: int, scalar, previous: Rows | None = None):
    """The checked rows of `hyper`, or None where every value is one for all tensors.

    `scalar(name, value)` resolves a device value for `spec.arguments`; `previous` (the
    latest step's rows, on a GPU) is returned again, or patched, where the values allow it.
    """
    names = per_tensor(hyper, spec.outputs)
    if not names:
        return None
    if previous is not None and previous.hyper.keys() == hyper.keys():
        changed = _changed(hyper, previous, names)
        if changed is None:
            return previous
        if changed is not False and changed.keys() <= set(spec.scheduled) & set(spec.arg_fields):
            patched = _patch(spec, hyper, previous, changed, scalar)
            if patched is not None:
                return patched
    columns = {name: _column(name, hyper[name], n_tensors) for name in names}
    return _new_rows(spec, hyper, columns, scalar)


def _changed(hyper: dict, previous: Rows, names: list):
    """None where `hyper` holds the previous step's values; else {name: new value} of the
    numbers that changed (a column of one per tensor, or one number for all), or False where
    anything else changed."""
    changed = {}
    for name, value in hyper.items():
        old = previous.hyper[name]
        if name in previous.columns:
            if name not in names:
                return False
            if value is old and type(value) is tuple:
                continue
            column = _column(name, value, len(previous.row_of))
            held = previous.columns[name]
            if column.dtype == object or held.dtype == object:  # device values: by identity
                if column.dtype != held.dtype or any(map(operator.is_not, column, held)):
                    return False
            elif not same_values(column, held):
                changed[name] = column
        elif value is not old:
            if type(value) not in (int, float) or type(old) not in (int, float):
                return False  # a device value counts by its identity: the kernel reads it
            if value != old:
                changed[name] = float(value)
    return changed or None


def _patch(spec, hyper: dict, previous: Rows, changed: dict, scalar):
    """Rows that differ from `previous` only in the `changed` values, one value still per
    row; None where tensors of one row now differ."""
    patched = dict(previous.patched)
    for name, value in changed.items():
        if isinstance(value, float):
            per_row = np.full(len(previous.firsts), value)
        else:
            per_row = value[previous.firsts]
            if not same_values(per_row[previous.row_of], value):
                return None
        _check_extremes(spec, hyper, previous, name, per_row, scalar)
        patched[name] = per_row
    columns = dict(previous.columns, **{k: v for k, v in changed.items() if k in previous.columns})
    return Rows(hyper, columns, previous.row_of, previous.firsts, origin=previous.origin,
                patched=patched)


def _check_extremes(spec, hyper: dict, previous: Rows, name: str, column: np.ndarray,
                    scalar) -> None:
    """A scheduled value is checked against an interval of its own, whatever the others: the
    extremes of its rows' values stand for every value between (NaN fails as an extreme too),
    and so does the range of the values already checked since the origin (a decaying lr
    checks only its new minimum). A refused value is looked up again tensor by tensor, to name
    the first such tensor."""
    low, high = float(column.min()), float(column.max())
    checked = previous.origin._checked_range
    known_low, known_high = checked.get(name, (np.inf, -np.inf))
    if known_low <= low and high <= known_high:
        return
    row = {k: _value(previous.columns[k][0]) if k in previous.columns else v
           for k, v in hyper.items()}

    def check(value) -> None:
        spec.arguments(**{k: scalar(k, v) for k, v in dict(row, **{name: value}).items()})

    try:
        for extreme in (low, high):
            if not known_low <= extreme <= known_high:
                check(extreme)
    except (TypeError, ValueError):
        for i, value in enumerate(column[previous.row_of].tolist()):
            _name_tensor(i, check, value)
        raise
    checked[name] = (min(low, known_low), max(high, known_high))


def _new_rows(spec, hyper: dict, columns: dict, scalar) -> Rows:
    """The distinct combinations of the per-tensor values, numbered as they first appear."""
    index: dict = {}
    n_tensors = len(next(iter(columns.values())))
    keys = [[(_DEVICE, id(v)) if _is_device(v) else float(v) for v in c.tolist()]
            for c in columns.values()]  # a device value by its identity
    row_of = np.fromiter((index.setdefault(combo, len(index)) for combo in zip(*keys)),
                         np.int32, n_tensors)
    firsts = np.unique(row_of, return_index=True)[1]

    def check(row: dict) -> dict:
        return spec.arguments(**{k: scalar(k, _value(v) if k in columns else v)
                                 for k, v in row.items()})

    checked = [_name_tensor(first, check, dict(hyper, **{name: column[first]
                                                         for name, column in columns.items()}))
               for first in firsts.tolist()]
    return Rows(hyper, columns, row_of, firsts, checked)


def _name_tensor(index: int, check, *args):
    """check(*args), its error naming the tensor whose values it refused."""
    try:
        return check(*args)
    except (TypeError, ValueError) as error:
        raise type(error)(f"tensor {index}: {error}") from None


_DEVICE = "device value"


def _value(v):
    """A column's element as a step takes it: a float, or the device value itself."""
    return v if _is_device(v) else float(v)


def _is_device(v) -> bool:
    return hasattr(v, "__dlpack__") or hasattr(v, "ptr")  # an array, or a DeviceScalar


def _column(name: str, values, n_tensors: int) -> np.ndarray:
    """The values as float64 (a copy: the caller may change its array in place before the
    next step), or as objects where some are device values."""
    if len(values) != n_tensors:
        raise ValueError(f"{name} has {len(values)} values for {n_tensors} tensors: give one "
                         f"per tensor, or one for all")
    if not isinstance(values, np.ndarray) and any(map(_is_device, values)):
        column = np.empty(n_tensors, object)
        for i, v in enumerate(values):  # one by one: numpy would read an array-like
            if not _is_device(v) and type(v) not in (int, float):
                raise TypeError(f"{name}[{i}] is a {type(v).__name__}: give numbers or "
                                f"one-element device arrays")
            column[i] = v
        return column
    try:
        return np.array(values, dtype=np.float64).reshape(n_tensors)
    except (TypeError, ValueError):
        raise TypeError(f"{name} given per tensor must hold numbers or one-element device "
                        f"arrays") from None
