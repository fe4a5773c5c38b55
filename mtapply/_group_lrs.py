"""Param groups' learning rates (and other hyperparameters) kept on the params' device.

A plan over many param groups reads each tensor's hyperparameters from its row. Where the
groups' lrs are numbers, which a scheduler sets every step, the torch optimizers keep them in
one float32 device array, a slot per group, and give the plan each group's slot as its lr (a
device value, known by its identity): new lrs are checked on the host and written by one async
copy, and the plan sees the very same values again, its rows and launches unchanged. For
float32 math only: float64 params keep their lrs in double, in the rows (`GroupLrs`).

A hyperparameter given as a tensor that a plan cannot read where it is (a CPU tensor lr with
CUDA params, as torch.optim takes it; a tensor on another GPU; a dtype other than float32) is
copied into a float32 slot on the params' device before every step's launches, and the plan
reads the slot (`TensorCopies`): a CPU tensor's value is read on the host (which waits for no
device work), checked, and written by an async copy where it changed; a GPU tensor is copied
device to device on torch's current stream. Neither synchronises the host with a device. A
CPU tensor that a CPU plan reads itself is checked there too, before any group launches.
"""
from __future__ import annotations

import numpy as np

from ._launch import stream_pointer
from ._tables import DeviceFloats
from ._ranges import LR, Range


class GroupLrs:
    """A float32 slot on one GPU per param group, holding the group's lr."""

    def __init__(self, n_groups: int, device_id: int):
        self.values = DeviceFloats(n_groups, device_id)
        self.slots = [self.values.scalar(g) for g in range(n_groups)]

    def write(self, lrs: np.ndarray, stream: int) -> None:
        """Checks the groups' lrs (one per group) as the kernels read them, in float32, raising
        before anything is written, and copies them on `stream`, the launch stream of the step
        that reads them, where they changed."""
        with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused below
            rounded = np.asarray(lrs, np.float32)
        k = LR.first_outside(rounded)
        if k is not None:
            LR.check(f"lr of param group {k}", float(rounded[k]))
        self.values.write(rounded, stream)
        self.values.table.launched_on(stream)  # the step's launches read it next, there


class TensorCopies:
    """The slots of one optimizer's tensor hyperparameters that its plans read elsewhere than
    where the tensors are, refreshed from their tensors by `refresh()` at every step."""

    def __init__(self):
        self._copies: dict = {}  # (id(tensor), device) -> _Copy

    def __bool__(self) -> bool:
        return bool(self._copies)

    def slot(self, tensor, device, name: str, allowed: Range):
        """The slot on `device` (a torch device) that holds `tensor`'s value (made and filled
        at first use; on the CPU, the CPU tensor itself); a CPU tensor's value is checked
        against `allowed` whenever it is read, so that a step refuses it before any group
        launches."""
        key = (id(tensor), device)
        copy = self._copies.get(key)
        if copy is None or copy.source is not tensor:
            copy = _Copy(tensor, device, name, allowed)
            copy.write(copy.read())
            self._copies[key] = copy
        return copy.slot

    def refresh(self) -> None:
        """Every slot from its tensor, each checked before any is written."""
        copies = self._copies.values()
        values = [copy.read() for copy in copies]
        for copy, value in zip(copies, values):
            copy.write(value)

    def keep_only(self, tensors) -> None:
        """Drops the slots of tensors that are not among `tensors` (no group holds them)."""
        alive = set(map(id, tensors))
        self._copies = {key: copy for key, copy in self._copies.items() if key[0] in alive}


class _Copy:
    """One tensor hyperparameter's float32 slot on one device (see `TensorCopies`)."""

    def __init__(self, tensor, device, name: str, allowed: Range):
        import torch

        self.source, self.device, self.name, self.allowed = tensor, device, name, allowed
        self.on_host = tensor.device.type == "cpu"
        if device.type == "cpu" and tensor.dtype == torch.float32:
            self.slot = tensor.reshape(1)  # a CPU plan reads it itself: only checked here
        elif device.type == "cpu":
            self.slot = torch.empty(1, dtype=torch.float32)
        elif self.on_host:
            self._floats = DeviceFloats(1, device.index)
            self.slot = self._floats.scalar(0)
        else:
            self.slot = torch.empty(1, dtype=torch.float32, device=device)

    def read(self):
        """The host value of a CPU tensor, checked (None for a GPU tensor)."""
        if not self.on_host:
            return None
        return self.allowed.check(self.name, float(np.float32(float(self.source))))  # as read

    def write(self, value) -> None:
        if self.device.type == "cpu":
            if self.slot.data_ptr() != self.source.data_ptr():
                self.slot.fill_(value)
        elif self.on_host:
            stream = stream_pointer(None, "torch", self.device.index)
            self._floats.write(np.array([value], np.float64), stream)
            self._floats.table.launched_on(stream)
        else:
            self.slot.copy_(self.source.reshape(1), non_blocking=True)
