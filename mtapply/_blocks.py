"""The planner: pure Python and NumPy, testable without a GPU.

Tensors of one call are grouped by (device, dtype of each slot); each group becomes one kernel
launch. A group's table is one buffer:

    blocks  : int32 pairs (tensor index, chunk index), one per CUDA block
    records : per tensor, N_SLOTS + 1 64-bit words: numel, then the address of each slot
    jobs    : (a group that runs both passes of a two-pass op in one launch) int32 per block
              of that launch: the sums of block k (k >= 0) or its update (~k), see `fused_jobs`

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


# Blocks of sums taken before the update of a block, at the least. LARS's resnet50 step on an
# H200 (3,100 blocks), ms: lags 0 and 64 wait for the sums (0.187, 0.185), 256 0.180, 512 0.1751,
# 768 0.1753, 1024 0.1771, 2048 0.178, 4096 (every sum first) 0.182; its two launches 0.180.
FUSED_LAG = 768


def fused_jobs(blocks: np.ndarray, lag: int = FUSED_LAG) -> np.ndarray:
    """The jobs of a fused launch (kernels/walker.cuh, walk_fused) over `blocks` (chunk_map's):
    each block's sums, in order, and its update (~k for block k) after the sums of block k +
    `lag` and of its tensor's last block, whichever comes later. So an update waits for no
    sums that a later job takes (no deadlock), and re-reads its chunk while that is still in
    L2 (`lag` blocks of the sums' reads and the updates' traffic later)."""
    n = len(blocks)
    tensors = blocks[:, 0]
    last = np.empty(n, np.int64)  # each block's tensor's last block
    if n:
        ends = np.flatnonzero(np.append(tensors[1:] != tensors[:-1], True))
        last = np.repeat(ends, np.diff(np.append(-1, ends)))
    after = np.maximum(np.arange(n) + lag, last)
    order = np.argsort(np.concatenate([2 * np.arange(n), 2 * after + 1]), kind="stable")
    jobs = np.arange(n, dtype=np.int32)
    return np.concatenate([jobs, ~jobs])[order]


def first_blocks(numels: np.ndarray, chunk: int, counts: np.ndarray) -> np.ndarray:
    """The indices in `chunk_map(numels, chunk)` of each tensor's first counts[i] blocks (at
    most its blocks), in order: the blocks a pass launches over where the others would
    have nothing to do (a factored rule's combine and matrix passes)."""
    chunks = (np.asarray(numels, np.int64) + chunk - 1) // chunk
    counts = np.minimum(np.asarray(counts, np.int64), chunks)
    starts = np.repeat(np.cumsum(chunks) - chunks - (np.cumsum(counts) - counts), counts)
    return (starts + np.arange(len(starts))).astype(np.int32)


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
    fused: bool = False  # the table also lists a fused launch's jobs (`fused_jobs`)
    _table: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_blocks(self) -> int:
        return int(((self.numels + self.chunk - 1) // self.chunk).sum())

    def table(self) -> np.ndarray:
        """The group's table as bytes (uint8), ready to copy to the device as is. The block map
        depends only on the sizes, so rebinding pointers rewrites just the records."""
        if self._table is None:
            blocks = chunk_map(self.numels, self.chunk)
            jobs = fused_jobs(blocks) if self.fused else np.zeros(0, np.int32)
            self._table = np.zeros(self.jobs_offset + jobs.nbytes, np.uint8)
            self._table[:blocks.nbytes] = blocks.reshape(-1).view(np.uint8)
            self._table[self.jobs_offset:] = jobs.view(np.uint8)
        records = self._table[self.records_offset:self.jobs_offset].view(np.int64).reshape(
            len(self.numels), self.pointers.shape[1] + 1)
        records[:, 0] = self.numels
        records[:, 1:] = self.pointers.view(np.int64)
        return self._table.copy()

    @property
    def records_offset(self) -> int:
        return _round_up(self.n_blocks * 8, RECORD_ALIGN)

    @property
    def jobs_offset(self) -> int:
        return self.records_offset + len(self.numels) * (self.pointers.shape[1] + 1) * 8


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
