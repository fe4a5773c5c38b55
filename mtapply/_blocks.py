"""The planner: pure Python and NumPy, testable without a GPU.

Tensors of one call are grouped by (device, dtype of each slot); each group becomes one kernel
launch. A group's table is one buffer:

    blocks  : int32 pairs (tensor index, chunk index), one per CUDA block
    records : per tensor, N_SLOTS + 1 64-bit words: numel, then the address of each slot

Element counts and chunk offsets are 64-bit, so a tensor of more than 2**31 elements is planned
like any other. Empty tensors get no block. There is no cap on tensors per launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

RECORD_ALIGN = 16


def chunk_map(numels: np.ndarray, chunk: int) -> np.ndarray:
    """(n_blocks, 2) int32 array of (tensor index, chunk index) covering every element once."""
    numels = np.asarray(numels, dtype=np.int64)
    counts = (numels + (chunk - 1)) // chunk
    total = int(counts.sum())
    if total >= 2**31:
        raise ValueError(f"a launch of {total} chunks exceeds the CUDA grid limit of 2**31 - 1 blocks")
    blocks = np.empty((total, 2), dtype=np.int32)
    blocks[:, 0] = np.repeat(np.arange(len(numels), dtype=np.int32), counts)
    starts = np.cumsum(counts) - counts
    blocks[:, 1] = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    return blocks


def chunk_bounds(blocks: np.ndarray, numels: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) element range of each block, as the walker computes it."""
    begin = blocks[:, 1].astype(np.int64) * chunk
    end = np.minimum(begin + chunk, np.asarray(numels, dtype=np.int64)[blocks[:, 0]])
    return begin, end


@dataclass
class Group:
    """One launch: tensors of one device and one dtype per slot."""

    device: tuple
    dtypes: tuple  # storage dtype of each slot
    indices: np.ndarray  # positions of the group's tensors in the caller's lists
    numels: np.ndarray  # int64
    pointers: np.ndarray  # (n_tensors, n_slots) uint64 addresses
    chunk: int
    _table: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_blocks(self) -> int:
        return int(((self.numels + self.chunk - 1) // self.chunk).sum())

    def table(self) -> np.ndarray:
        """The group's table as bytes (uint8), ready to copy to the device as is. The block map
        depends only on the sizes, so rebinding pointers rewrites just the records."""
        if self._table is None:
            blocks = chunk_map(self.numels, self.chunk)
            head = _round_up(blocks.nbytes, RECORD_ALIGN)
            self._table = np.zeros(head + len(self.numels) * (self.pointers.shape[1] + 1) * 8, np.uint8)
            self._table[:blocks.nbytes] = blocks.reshape(-1).view(np.uint8)
        records = self._table[self.records_offset:].view(np.int64).reshape(
            len(self.numels), self.pointers.shape[1] + 1)
        records[:, 0] = self.numels
        records[:, 1:] = self.pointers.view(np.int64)
        return self._table.copy()

    @property
    def records_offset(self) -> int:
        return _round_up(self.n_blocks * 8, RECORD_ALIGN)


def group_tensors(devices: list, dtypes: list, numels, pointers, chunk) -> list[Group]:
    """Groups tensor i (device devices[i], slot dtypes dtypes[i]) into launches, in first-seen order.

    `pointers` is an (n_tensors, n_slots) array of addresses; `chunk` is the elements per
    block, or a function of a group's slot dtypes giving them.
    """
    chunk_for = chunk if callable(chunk) else lambda _: chunk
    numels = np.asarray(numels, dtype=np.int64)
    pointers = np.asarray(pointers, dtype=np.uint64).reshape(len(numels), -1 if len(numels) else 0)
    members: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(devices, dtypes)):
        members.setdefault(key, []).append(i)
    groups = []
    for (device, slot_dtypes), idx in members.items():
        idx = np.asarray(idx, dtype=np.int64)
        groups.append(Group(device=device, dtypes=tuple(slot_dtypes), indices=idx,
                            numels=numels[idx], pointers=pointers[idx],
                            chunk=chunk_for(tuple(slot_dtypes))))
    return groups


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
