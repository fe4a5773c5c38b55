"""A plan's latest launching step, issued again where the next step is the same."""
from __future__ import annotations

import operator

import numpy as np

from ._rows import Rows


class Repeat:
    """A plan's latest launching step on one GPU, with what it was given. A step given the same
    (numbers equal; device arrays, tuples and streams the same objects; per-tensor lists and
    arrays of equal values) on the same stream and device issues the same launches again,
    their argument words, rows and tables unchanged, without the checks and packing of a first
    step. One that differs only in plain numbers (a scheduled lr, a step count given as a
    number) has them checked and then packed into the launches' words, or where the step has
    per-tensor rows, written into the rows' slots (see RowTables); it launches the same.
    Whatever changes the tables drops it."""

    def __init__(self, plan, stream, grad_scale, found_inf, hyper: dict, packed: tuple,
                 rows: Rows | None):
        self.stream, self.grad_scale, self.found_inf = stream, grad_scale, found_inf
        self.hyper = dict(hyper)
        self.packed = packed  # grad_scale and found_inf as the launches take them
        self.rows = rows  # per-tensor rows (their columns hold the per-tensor values), or None
        self.device_id = plan._cuda.device_id
        self.raw_stream = plan._stream_for(self.device_id,
                                           plan._stream if stream is None else stream)
        self.launches = plan._cuda.launch_order()
        # the numbers that may change: all of them without rows; with rows, the slotted ones
        self.slotted = plan._cuda.slotted_names(rows) if rows is not None else None

    def changes(self, plan, stream, grad_scale, found_inf, hyper: dict) -> dict | None:
        """The numbers in which `hyper` differs ({} for none), or None where this step is not
        the latest one again."""
        if not (_same(stream, self.stream) and _same(grad_scale, self.grad_scale)
                and _same(found_inf, self.found_inf) and hyper.keys() == self.hyper.keys()):
            return None
        changed, held = {}, self.hyper
        columns = self.rows.columns if self.rows is not None else {}
        for name, value in hyper.items():
            old = held[name]
            if name in columns:  # values given per tensor: a list or array may change in place
                if value is old and type(value) is tuple:
                    continue
                if name not in self.slotted:
                    if _equal_column(value, columns[name]):
                        continue
                    return None
                # slotted: `renumber` compares the values (its rows are the latest again)
            elif _same(value, old):
                continue
            elif not (type(value) in _NUMBERS and type(old) in _NUMBERS) or (
                    self.slotted is not None and name not in self.slotted):
                return None
            changed[name] = value
        return changed if self.current(plan, stream) else None

    def current(self, plan, stream=None) -> bool:
        """Whether a step given `stream` would launch on this one's stream and device."""
        return (plan._stream_for(self.device_id, plan._stream if stream is None else stream)
                == self.raw_stream and _current_device() == self.device_id)

    def renumber(self, plan, hyper: dict, changed: dict) -> bool:
        """Checks `hyper` (raising before any change) and makes the launches take it; False
        where its rows no longer fit the launches (tensors of one row now differ). `changed`:
        the numbers that differ from the latest step's."""
        if self.rows is None:
            words = _scheduled_words(plan.spec, changed)
            if words is not None:  # only lr or the step: each into its own word
                for launch in self.launches:
                    for field, value in words:
                        launch.set_number(field, value)
            else:
                args = plan.spec.arguments(**{k: plan._scalar(k, v) for k, v in hyper.items()})
                for launch in self.launches:
                    launch.set_args(args, *self.packed)
        else:
            rows = plan._rows(hyper)
            if rows is not self.rows:
                if rows.origin is not self.rows.origin or not set(rows.patched) <= set(
                        self.slotted):
                    return False
                plan._cuda.write_slots(rows, self.raw_stream)
                self.rows = rows
        self.hyper = dict(hyper)
        return True

    def launch(self) -> None:
        for launch in self.launches:
            launch.launch(self.raw_stream)


_NUMBERS = (float, int)


def _scheduled_words(spec, changed: dict) -> list | None:
    """(word, checked number) of each changed number, where each is a scheduled value the
    spec packs as given (`OpSpec.scheduled_word`): the words a repeated step with a new lr or
    step count rewrites, without `arguments` and the packing of every word; else None."""
    words = []
    for name, value in changed.items():
        field = spec.scheduled_word(name)
        if field is None:
            return None
        words.append((field, spec.scalar_range(name).check(name, value)))
    return words


def _current_device() -> int:
    """The current CUDA device; replaces itself by the runtime's own call at first use."""
    global _current_device
    from cupy_backends.cuda.api import runtime

    _current_device = runtime.getDevice
    return runtime.getDevice()


def repeatable(hyper: dict, rows: Rows | None) -> bool:
    """Whether a step can be known again: each value a number, a device value (by identity:
    the kernel reads it), or given per tensor (compared by value); not a list or NumPy array
    of one value for all, which could change in place unseen."""
    columns = rows.columns if rows is not None else {}
    return not any(isinstance(value, (list, np.ndarray)) for name, value in hyper.items()
                   if name not in columns)


def _equal_column(value, column: np.ndarray) -> bool:
    """Whether per-tensor `value` equals the held column (device values: the same objects)."""
    if column.dtype == object:
        return len(value) == len(column) and all(map(operator.is_, value, column))
    try:
        return np.array_equal(np.asarray(value, np.float64), column)
    except (TypeError, ValueError):
        return False


def _same(value, held) -> bool:
    """The same object, or an equal Python number of the same type."""
    return value is held or (type(value) is type(held) and type(value) in _NUMBERS
                             and value == held)
