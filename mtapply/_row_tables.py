"""The device half of per-tensor hyperparameters: the rows' tables and their slots."""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _tables
from ._rows import Rows
from .ops._spec import DeviceScalar


class RowTables:
    """The device tables of per-tensor hyperparameters, per launch group: the args rows (packed
    as each group's launches read them: their array addresses differ) and each tensor's row.
    Rewritten, by async copies on the launch stream, only when their bytes change.

    Scheduled values that every row holds as a number (lr, a step count) are not packed into
    the rows of groups of float32 math: those rows read them as device scalars, from slots
    that all groups share, so that new values cost one small copy and the rows stay as they
    are. Groups of float64 math keep them in their rows, in double, patched in place."""

    def __init__(self, spec, device_id: int):
        self.device_id = device_id
        self.scheduled = tuple(name for name in spec.scheduled if name in spec.device_scalars)
        self.slots = _Slots(device_id)
        self._tables: dict = {}  # group -> HeldRows

    def prepare(self, rows: Rows | None, stream: int) -> None:
        """Writes the slots of `rows`, once per step before the groups are placed."""
        if rows is not None:
            self.slots.hold(rows, self.scheduled, stream)

    def place(self, k: int, launches: list, indices: np.ndarray, rows: Rows | None,
              stream: int, slotted: bool) -> None:
        """Points group k's launches at its tables for `rows` (None: at the launch's args);
        `slotted`: the group reads scheduled values from the slots."""
        if rows is None:
            for launch in launches:
                launch.set_rows(0, 0)
            return
        slots = self.slots if slotted else None
        held = self._tables.get(k)
        if held is None or held.rows.origin is not rows.origin or held.slot_table is not (
                slots and slots.table):
            held = self._tables[k] = HeldRows.packed(held, launches[0], indices, rows, stream,
                                                      self.device_id, slots)
        elif held.rows is not rows:
            in_words = [name for name in rows.patched if name not in held.slot_names]
            for name in in_words:
                held.words.view(np.float64)[:, launches[0].row_word(name)] = rows.patched[name]
            if in_words:
                held.rows_table.write(held.words.reshape(-1).view(np.uint8), stream)
            held.rows = rows
        for table in (held.rows_table, held.row_of_table):
            table.before_launch(stream)
        for launch in launches:
            launch.set_rows(held.rows_table.ptr, held.row_of_table.ptr, held.checked_rows)

    def launched_on(self, k: int, stream: int) -> None:
        held = self._tables.get(k)
        if held is not None:
            for table in (held.rows_table, held.row_of_table, held.slot_table):
                if table is not None:
                    table.launched_on(stream)


class _Slots:
    """Scheduled values of the rows, as float32 device scalars: slot (name, row) at
    `ptr(name, row)`. Written when the values change, by one async copy."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.names: tuple = ()  # the slotted names, for the rows of `origin`
        self.table = None
        self._values = None  # a DeviceFloats of (names, rows), whose table is `table`
        self._n_rows = 0
        self._origin = None
        self._rows = None

    def hold(self, rows: Rows, scheduled: tuple, stream: int) -> None:
        """The slots hold `rows`' values (written where they differ)."""
        if rows is not self._rows:
            if rows.origin is not self._origin:
                self.names = tuple(name for name in scheduled if rows.holds_numbers(name))
                self._origin = rows.origin
            values = np.array([rows.per_row(name) for name in self.names], np.float32)
            if not np.isfinite(values).all():  # checked in double: too large for float32
                name = self.names[int(np.argwhere(~np.isfinite(values))[0][0])]
                raise ValueError(f"{name} overflows float32, in which the kernels read it: give "
                                 f"a value below 3.4e38")
            if not self.names:
                self._values = self.table = None
            elif self.table is None or self.table.nbytes != values.nbytes:
                self._values = _tables.DeviceFloats(values.size, self.device_id)
                self.table = self._values.table
            if self._values is not None:
                self._values.write(values, stream)
            self._n_rows, self._rows = values.shape[1] if self.names else 0, rows
        if self.table is not None:
            self.table.before_launch(stream)

    def scalar(self, name: str, row: int) -> DeviceScalar:
        return self._values.scalar(self.names.index(name) * self._n_rows + row)


@dataclasses.dataclass
class HeldRows:
    """One launch group's device rows: the tables, the packed words they hold, the rows."""

    rows_table: object
    row_of_table: object
    words: np.ndarray  # uint64, one line of argument words per row
    row_of: np.ndarray  # int32, the row of each of the group's tensors
    rows: Rows
    slot_table: object  # the slots' table its rows point into, or None
    slot_names: tuple  # the names its rows read from the slots
    checked_rows: int  # the rows the kernel checks: all where some hold a caller's device value

    @classmethod
    def packed(cls, held, launch, indices: np.ndarray, rows: Rows, stream: int,
               device_id: int, slots) -> HeldRows:
        """`rows` packed for `launch` (reading `slots`, or None), uploaded where the bytes
        differ from `held`'s."""
        names = slots.names if slots is not None and slots.table is not None else ()
        checked = [dict(args, **{name: slots.scalar(name, r) for name in names})
                   for r, args in enumerate(rows.checked)] if names else rows.checked
        words = np.frombuffer(b"".join(map(launch.row_words, checked)), np.uint64)
        words = words.reshape(len(checked), -1).copy()
        row_of = np.ascontiguousarray(rows.row_of[indices], np.int32)
        rows_table = _table_for(held and held.rows_table, words.nbytes, device_id)
        row_of_table = _table_for(held and held.row_of_table, row_of.nbytes, device_id)
        if held is None or rows_table is not held.rows_table or not np.array_equal(
                words, held.words):
            rows_table.write(words.reshape(-1).view(np.uint8), stream)
        if held is None or row_of_table is not held.row_of_table or not np.array_equal(
                row_of, held.row_of):
            row_of_table.write(row_of.view(np.uint8), stream)
        unchecked = any(isinstance(value, DeviceScalar) and not value.checked
                        for row in checked for value in row.values())
        return cls(rows_table, row_of_table, words, row_of, rows,
                   slots.table if names else None, names, len(checked) if unchecked else 0)


def _table_for(table, nbytes: int, device_id: int):
    """`table` where it holds nbytes, else a new device table of that size."""
    if table is not None and table.nbytes == nbytes:
        return table
    return _tables.MemcpyTable(nbytes, device_id)
