"""A plan whose tensors are on several GPUs: one launcher per device, and what a rule's step
shares between them (its whole-list sums and its scalar state)."""
from __future__ import annotations

import numpy as np

from . import _source, _tables
from ._launch import cupy_stream
from ._launcher import _device_copy, _on
from ._rows import Rows


class Devices:
    """The launchers of a plan whose tensors are on several GPUs, each with the positions of
    its tensors in the plan's lists; one launch set per device, on that device's stream.
    `shared` (a `Shared`) couples the devices' steps where a rule sums over the whole list or
    keeps scalar state."""

    def __init__(self, parts: list, shared: "Shared | None" = None):
        self.parts = parts  # (device_id, indices, Launcher)
        self.shared = shared
        self._origin_subsets = (None, [])  # (origin rows, each part's subset of them)
        self._latest = (None, [])  # (the latest step's rows, each part's share)

    def _rows_of_parts(self, rows: Rows | None) -> list:
        """Each part's share of `rows`: patches over the origin's subsets, made once each."""
        if rows is None:
            return [None] * len(self.parts)
        if self._latest[0] is not rows:
            origin, subsets = self._origin_subsets
            if origin is not rows.origin:
                subsets = [rows.origin.subset(indices) for _, indices, _ in self.parts]
                self._origin_subsets = (rows.origin, subsets)
            self._latest = (rows, [rows.on(subset) for subset in subsets])
        return self._latest[1]

    def run(self, args: dict, stream_of, grad_scale=1.0, found_inf=None, after_pass=None,
            rows=None) -> None:
        shares = self._rows_of_parts(rows)
        if self.shared is not None:
            self.shared.run(self.parts, args, stream_of, grad_scale, found_inf, shares)
            return
        stages = [launcher.passes(args, stream_of, grad_scale, found_inf, part_rows)
                  for (_, _, launcher), part_rows in zip(self.parts, shares)]
        for stage in stages:  # (every device's rows checked before any launch)
            for _ in stage:
                pass

    def invalid_flags(self) -> tuple:
        return tuple(launcher.invalid_flags() for _, _, launcher in self.parts)

    def clear_invalid(self, stream_of) -> None:
        for _, _, launcher in self.parts:
            launcher.clear_invalid(stream_of)

    def rebound(self, columns: dict, stream_of) -> "Devices":
        for device_id, _, launcher in self.parts:
            launcher.check_upload(stream_of(device_id))
        self.parts = [(device_id, indices,
                       launcher.rebound({k: a[indices] for k, a in columns.items()}, stream_of))
                      for device_id, indices, launcher in self.parts]
        return self


class Shared:
    """A rule's whole-list sums and scalar state over the GPUs of one plan.

    A step runs every device's passes up to its update (its totals, over its own tensors);
    each device copies its totals into a slot of every device's exchange buffer; each device
    waits for the others' copies and adds the slots in one order, the devices' order in the
    plan (so all devices hold the same totals, bit for bit), before its update. The exchange
    buffer has a half per step parity: a device may copy the next step's totals while another
    still reads this step's.

    The scalar state is the caller's array (`scalars_out`), on the plan's first device; each
    other device steps a copy of it, refreshed from it at the start of each step, and computes
    the same values from the same totals. Where the first device has nothing to launch, the
    first device that has writes the state back."""

    def __init__(self, parts: list, n_totals: int, n_scalars: int, sum_dtype, stream_of):
        self.width, self.n_scalars = n_totals, n_scalars
        self.itemsize = np.dtype(sum_dtype).itemsize
        self.adding = adding_source(np.dtype(sum_dtype).name)
        self._parity = 0
        count = len(parts)
        self._keep, self.exchange, self.zeros, self.copies = [], [], [], []
        for k, (device_id, _, _) in enumerate(parts):
            stream = stream_of(device_id)
            keep = _tables.Keeper(device_id)
            keep.stream = stream
            with _on(device_id):
                exchange = _device_copy(np.zeros(max(2 * count * n_totals, 1), sum_dtype), stream)
                zeros = _device_copy(np.zeros(max(n_totals, 1), sum_dtype), stream)
                copy = _device_copy(np.zeros(max(n_scalars, 1), sum_dtype), stream) if k else None
            keep.memory += [m for m in (exchange, zeros, copy) if m is not None]
            self._keep.append(keep)
            self.exchange.append(exchange.ptr)
            self.zeros.append(zeros.ptr)
            self.copies.append(copy)
        # (the first device reads a copy where it writes the state back: kept past that too)
        self._keep[0].memory += [copy for copy in self.copies if copy is not None]
        with _on(parts[0][0]):
            self._started = _tables._Event()  # the step's start on the first device
        self._copied: list = []  # per device, its copy of the scalar state refreshed
        self._done: list = []  # per device, its first pass and its totals' copies queued
        for device_id, _, _ in parts:
            with _on(device_id):
                self._copied.append(_tables._Event())
                self._done.append(_tables._Event())

    def run(self, parts: list, args: dict, stream_of, grad_scale, found_inf, shares) -> None:
        streams = [stream_of(device_id) for device_id, _, _ in parts]
        self._follow(parts, streams)
        own = args.get("scalars_out")
        each_args = [args] + [self._with_copy(args, own, k) for k in range(1, len(parts))]
        self._refresh_copies(parts, streams, own)
        parity = self._parity
        stages = [launcher.passes(each_args[k], stream_of, grad_scale, found_inf, shares[k],
                                  fused=False)
                  for k, (_, _, launcher) in enumerate(parts)]  # (every device's rows checked)
        for k, ((device_id, _, launcher), stream) in enumerate(zip(parts, streams)):
            _through_totals(stages[k], launcher.n_passes)
            with _on(device_id):
                self._send_totals(k, parts, stream, parity)
                self._done[k].record(stream)
        self._parity ^= 1  # (only once every device's totals are on their way)
        for k, ((device_id, _, launcher), stream) in enumerate(zip(parts, streams)):
            with _on(device_id):
                if self.width:
                    for other, done in enumerate(self._done):
                        if other != k:
                            done.wait_on(stream)
                    if launcher.totals is not None:
                        self._add_totals(k, device_id, launcher.totals, len(parts), parity,
                                         stream)
            for _ in stages[k]:  # the update, from the same totals on every device
                pass
            self._keep[k].stream = stream
        self._write_back(parts, streams, own)

    def _follow(self, parts: list, streams: list) -> None:
        """Each device's stream waits for the work this object queued on its stream of the
        step before, where that was another stream."""
        for (device_id, _, _), keep, stream in zip(parts, self._keep, streams):
            with _on(device_id):
                _tables.wait_for(keep.stream, stream)
                keep.stream = stream

    def _with_copy(self, args: dict, own, k: int) -> dict:
        """Device k's arguments: its copy of the scalar state in place of the caller's."""
        if own is None:
            return args
        copy = self.copies[k]
        return {**args, "scalars_out": type(own)(ptr=copy.ptr, obj=copy, ref=None)}

    def _refresh_copies(self, parts: list, streams: list, own) -> None:
        """Each other device's copy of the scalar state, from the caller's array, after what
        the first device's stream has queued so far (the latest step, the caller's writes);
        the first device's step waits for the copies."""
        if own is None:
            return
        first = parts[0][0]
        with _on(first):
            self._started.record(streams[0])
        for k in range(1, len(parts)):
            with _on(parts[k][0]):
                self._started.wait_on(streams[k])
                _tables._runtime().memcpyPeerAsync(self.copies[k].ptr, parts[k][0], own.ptr,
                                                   first, self.n_scalars * self.itemsize,
                                                   streams[k])
                self._copied[k].record(streams[k])
        with _on(first):
            for k in range(1, len(parts)):
                self._copied[k].wait_on(streams[0])

    def _send_totals(self, k: int, parts: list, stream: int, parity: int) -> None:
        """Device k's totals (zeros where it launches nothing) into its slot of this parity's
        half of every device's exchange buffer."""
        if not self.width:
            return
        launcher = parts[k][2]
        source = launcher.totals if launcher.launches_anything else self.zeros[k]
        nbytes = self.width * self.itemsize
        offset = (parity * len(parts) + k) * nbytes
        for other, (device_id, _, _) in enumerate(parts):
            _tables._runtime().memcpyPeerAsync(self.exchange[other] + offset, device_id, source,
                                               parts[k][0], nbytes, stream)

    def _add_totals(self, k: int, device_id: int, totals: int, count: int, parity: int,
                    stream: int) -> None:
        """totals = the sum of every device's slot, in the devices' order (the same on every
        device)."""
        half = self.exchange[k] + parity * count * self.width * self.itemsize
        adding = _source.kernel_functions(self.adding, device_id, 1)[0]
        adding((1,), (-(-self.width // 32) * 32,),
               (np.uint64(half), np.uint64(totals), np.int32(count), np.int32(self.width)),
               stream=cupy_stream(stream, device_id))

    def _write_back(self, parts: list, streams: list, own) -> None:
        """Where the first device launched nothing, the state that the first device that did
        stepped, back into the caller's array."""
        if own is None or parts[0][2].launches_anything:
            return
        writer = next((k for k, part in enumerate(parts) if part[2].launches_anything), None)
        if writer is None:
            return
        with _on(parts[writer][0]):
            self._done[writer].record(streams[writer])
        with _on(parts[0][0]):
            self._done[writer].wait_on(streams[0])
            _tables._runtime().memcpyPeerAsync(own.ptr, parts[0][0], self.copies[writer].ptr,
                                               parts[writer][0], self.n_scalars * self.itemsize,
                                               streams[0])


_ADDING = r"""
extern "C" __global__ void {entry}(const {t}* slots, {t}* totals, int count, int width) {{
  const int w = threadIdx.x;
  if (w >= width) return;
  {t} total = slots[w];
  for (int k = 1; k < count; ++k) total += slots[k * width + w];
  totals[w] = total;
}}
"""


def _through_totals(stage, n_passes: int) -> None:
    """Runs a step's passes (`Launcher.passes`) up to the update: through the pass that leaves
    the totals (the first of two; a factored rule's sums pass, after its factor passes), or
    through its one pass."""
    for p in stage:
        if p >= n_passes - 2:
            return


def adding_source(dtype: str) -> str:
    """The kernel adding the devices' totals (`Shared._add_totals`) in `dtype` (of the sums)."""
    return _ADDING.format(t=_source.CUDA_TYPES[dtype], entry=_source.entry_name(0))
