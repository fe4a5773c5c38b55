"""The learning rates of merged param groups, kept on the device.

A plan over many param groups reads each tensor's hyperparameters from its row. Where the
groups' lrs are numbers, which a scheduler sets every step, the torch optimizers keep them in
one float32 device array, a slot per group, and give the plan each group's slot as its lr (a
device value, known by its identity): new lrs are checked on the host and written by one async
copy, and the plan sees the very same values again, its rows and launches unchanged. For
float32 math only: float64 params keep their lrs in double, in the rows.
"""
from __future__ import annotations

import numpy as np

from ._tables import DeviceFloats
from .ops._spec import LR


class GroupLrs:
    """A float32 slot on one GPU per param group, holding the group's lr."""

    def __init__(self, n_groups: int, device_id: int):
        self.values = DeviceFloats(n_groups, device_id)
        self.slots = [self.values.scalar(g) for g in range(n_groups)]

    def write(self, lrs: np.ndarray, stream: int) -> None:
        """Checks the groups' lrs (one per group), raising before anything is written, and
        copies them on `stream`, the launch stream of the step that reads them, where they
        changed."""
        if not (lrs.min() >= 0.0 and lrs.max() < np.inf):  # NaN fails too
            k = int(np.flatnonzero(~((lrs >= 0.0) & (lrs < np.inf)))[0])
            LR.check(f"lr of param group {k}", float(lrs[k]))
        self.values.write(lrs, stream)
        self.values.table.launched_on(stream)  # the step's launches read it next, there
