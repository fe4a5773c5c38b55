"""Device storage of plan tables: "memcpy" (device memory filled by async copies) or "unified".

memcpy: the table lives in device memory; a change is staged in pinned host memory and copied
  on the launch stream, so it is ordered with the launches. Staging buffers form a ring guarded
  by events: a buffer is never refilled while a copy may still read it. The ring grows (to a
  bound) rather than waiting, so a host that runs steps ahead of the GPU is not held back by a
  table written every step.
unified: the table lives in managed memory that the host writes directly. Two buffers alternate,
  and the host writes a buffer only once the launches that read it have finished (an event), so
  host writes never race a kernel.
Either way a step with an unchanged table does no host-to-device traffic at all.

Lifetimes: kernels and copies read this memory on the launch stream (the framework's, not
CuPy's), long after the host has moved on. So the work on one table is kept in one chain: a
launch or upload on another stream than the latest waits for it (an event, only when the
stream changes). And memory that mtapply lets go (`Keeper`) goes back to CuPy's pools only
after a device synchronisation, at the next `collect` (where tables are made): CuPy orders a
freed block after the work of the stream it was allocated under, which is not the launch stream,
and reuses pinned blocks at once; the launch stream itself may be gone by then (a CuPy stream is
destroyed with its object), so no call is made on it.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from ._rows import same_values
from .ops._spec import DeviceScalar

MODES = ("memcpy", "unified")
_H2D = 1


def configured_mode() -> str:
    """$MTAPPLY_TABLE_MODE as set (unchecked), else "memcpy"."""
    return os.environ.get("MTAPPLY_TABLE_MODE") or "memcpy"


def default_mode() -> str:
    """The table mode of a GPU plan that names none. Read only where GPU tables are built, so
    that a bad value never stops CPU work, which has no tables."""
    mode = configured_mode()
    if mode not in MODES:
        raise ValueError(f"MTAPPLY_TABLE_MODE={mode!r}; use one of {', '.join(MODES)}")
    return mode


def make_table(mode: str, nbytes: int, device_id: int):
    if mode == "memcpy":
        return MemcpyTable(nbytes, device_id)
    if mode == "unified":
        return UnifiedTable(nbytes, device_id)
    raise ValueError(f"table_mode={mode!r}; use one of {', '.join(MODES)}")


_RUNTIME = None  # CuPy's CUDA runtime module, imported at first use (a step calls it often)


def _runtime():
    global _RUNTIME
    if _RUNTIME is None:
        from cupy_backends.cuda.api import runtime

        _RUNTIME = runtime
    return _RUNTIME


def _capturing(stream: int) -> bool:
    return stream != 0 and _runtime().streamIsCapturing(stream) != 0


class _Event:
    """A CUDA event without timing, marking the point after which a buffer is free again."""

    def __init__(self):
        rt = _runtime()
        self.handle = rt.eventCreateWithFlags(rt.eventDisableTiming)
        self.recorded = False

    def record(self, stream: int) -> None:
        _runtime().eventRecord(self.handle, stream)
        self.recorded = True

    def wait_host(self) -> None:
        if self.recorded:
            _runtime().eventSynchronize(self.handle)

    def done(self) -> bool:
        return not self.recorded or _runtime().eventQuery(self.handle) == 0

    def wait_on(self, stream: int) -> None:
        if self.recorded:
            _runtime().streamWaitEvent(stream, self.handle, 0)

    def __del__(self):
        try:
            _runtime().eventDestroy(self.handle)
        except Exception:  # interpreter shutdown: the context may already be gone
            pass


_pending: dict = {}  # device -> memory let go, kept until the device is next synchronised
_pending_lock = threading.RLock()  # reentrant: a collection may run a Keeper's __del__


def retire(memory: list, stream, device_id: int) -> None:
    """Lets `memory` (CuPy device or pinned allocations) go back to its pool once the work
    queued so far (on `stream`, its latest, None for none) has run: at the next `collect`. It
    may run at any time (a garbage collection), a CUDA graph capture included, so it makes no
    CUDA call. Memory a captured graph launches with must outlive the graph (keep the plan)."""
    if memory and stream is not None:
        with _pending_lock:
            _pending.setdefault(device_id, []).append(memory)


def wait_for(latest, stream: int, event=None) -> None:
    """Makes `stream` wait for the work queued so far on `latest` (None, or the same stream:
    nothing to do). Not where either is being captured into a CUDA graph: a capture cannot wait
    on uncaptured work (a capture on another stream must start after a synchronisation, as
    torch.cuda.graph does)."""
    if latest is None or latest == stream or _capturing(stream):
        return
    try:
        if _capturing(latest):
            return
        event = event or _Event()
        event.record(latest)
    except Exception:  # `latest` was destroyed since: the work queued on it may still run
        _runtime().deviceSynchronize()
        return
    event.wait_on(stream)


def collect(stream: int = 0) -> None:
    """Gives back the memory let go since the last collection, after synchronising each of
    its devices once. Called where tables are made (on `stream`): never in a step, and a
    synchronisation only where something was let go (an optimizer or plan dropped since).
    Not while `stream` is captured into a CUDA graph: a synchronisation would end the capture."""
    if not _pending or _capturing(stream):
        return
    with _pending_lock:
        for device_id in list(_pending):
            try:
                import cupy

                with cupy.cuda.Device(device_id):
                    _runtime().deviceSynchronize()
            except Exception:  # refused now (a graph being captured): at a later collection
                continue
            del _pending[device_id]


def retired() -> int:
    """How many releases still wait for a collection."""
    with _pending_lock:
        return sum(map(len, _pending.values()))


class Keeper:
    """Memory that kernels or copies on `stream` (the latest stream that used it, set by its
    owner) may still read or write: when the owner drops it, it is retired (`retire`)."""

    __slots__ = ("memory", "stream", "device_id")

    def __init__(self, device_id: int):
        self.memory: list = []
        self.stream = None
        self.device_id = device_id

    def __del__(self):
        try:
            retire(self.memory, self.stream, self.device_id)
        except Exception:  # interpreter shutdown
            pass

    def __reduce_ex__(self, protocol):
        raise _not_copied(self)


def _not_copied(obj) -> TypeError:
    return TypeError(f"{type(obj).__name__} holds device memory and the addresses of tensors: it "
                     f"cannot be copied or pickled. Build a new plan (or optimizer) over the "
                     f"copied tensors instead")


class MemcpyTable:
    """A table in device memory, updated by async copies on the launch stream."""

    RING = 2  # staging buffers to start with
    MAX_RING = 16  # beyond this many copies in flight, a write waits for the oldest

    def __init__(self, nbytes: int, device_id: int):
        import cupy

        self.nbytes = nbytes
        self.device_id = device_id
        collect()
        self._keep = Keeper(device_id)  # the device table and the staging buffers
        with cupy.cuda.Device(device_id):
            self._device = cupy.cuda.alloc(max(nbytes, 16))
            self._staging = [self._pinned() for _ in range(self.RING)]
            self._copied = [_Event() for _ in range(self.RING)]
            self._latest_done = _Event()
        self._keep.memory += [self._device, *self._staging]
        self._next = 0

    def __reduce_ex__(self, protocol):
        raise _not_copied(self)

    @property
    def ptr(self) -> int:
        return self._device.ptr

    def before_launch(self, stream: int) -> None:
        """Orders a launch on `stream` after the latest upload or launch that used the table,
        where that was on another stream (one chain of work: see the module's docstring).

        A stream being captured cannot wait on uncaptured work; a capture on another stream than
        the upload's must start after a device synchronisation, as torch.cuda.graph does.
        """
        if stream != self._keep.stream:
            self._follow(stream)

    def launched_on(self, stream: int) -> None:
        """Notes the stream of the latest launch that reads the table."""
        self._keep.stream = stream

    def _follow(self, stream: int) -> None:
        """Makes `stream` wait for the work queued so far on the table's latest stream."""
        wait_for(self._keep.stream, stream, self._latest_done)
        self._keep.stream = stream

    def write(self, table: np.ndarray, stream: int) -> None:
        """Copies `table` (uint8) to the device, ordered on `stream` after earlier readers."""
        if _capturing(stream):
            raise RuntimeError("mtapply cannot upload a pointer table while the stream is being "
                               "captured into a CUDA graph: run one step before capturing, and "
                               "keep the same tensors while the graph is in use")
        if stream != self._keep.stream:  # after the launches that read the table, and copies
            self._follow(stream)
        k = self._free_staging()
        staging = self._staging[k]
        np.frombuffer(staging, dtype=np.uint8, count=table.nbytes)[:] = table
        _runtime().memcpyAsync(self._device.ptr, staging.ptr, table.nbytes, _H2D, stream)
        self._copied[k].record(stream)

    def _pinned(self):
        import cupy

        return cupy.cuda.alloc_pinned_memory(max(self.nbytes, 16))

    def _free_staging(self) -> int:
        """The next staging buffer of the ring, once no copy reads it: a buffer is added in
        front of one still in flight, up to MAX_RING, after which the oldest is waited for."""
        k = self._next
        if not self._copied[k].done():
            if len(self._staging) < self.MAX_RING:
                import cupy

                with cupy.cuda.Device(self.device_id):
                    self._staging.insert(k, self._pinned())
                    self._copied.insert(k, _Event())
                self._keep.memory.append(self._staging[k])
            else:
                self._copied[k].wait_host()  # MAX_RING copies in flight
        self._next = (k + 1) % len(self._staging)
        return k


class DeviceFloats:
    """float32 values in device memory, each read by kernels as a device scalar (`scalar(i)`),
    rewritten by one async copy on the launch stream only where they changed."""

    def __init__(self, n: int, device_id: int):
        self.table = MemcpyTable(4 * n, device_id)
        self._held = None  # the values last written

    def __reduce_ex__(self, protocol):
        raise _not_copied(self)

    def write(self, values: np.ndarray, stream: int) -> None:
        values = np.ascontiguousarray(values, np.float32).reshape(-1)
        if self._held is None or not same_values(values, self._held):
            self.table.write(values.view(np.uint8), stream)
            self._held = values

    def scalar(self, i: int):
        return DeviceScalar(ptr=self.table.ptr + 4 * i, obj=self.table, checked=True)


class UnifiedTable:
    """A table in managed memory written by the host; two buffers alternate."""

    def __init__(self, nbytes: int, device_id: int):
        import cupy

        self.nbytes = nbytes
        self.device_id = device_id
        rt = _runtime()
        if not rt.deviceGetAttribute(rt.cudaDevAttrConcurrentManagedAccess, device_id):
            raise RuntimeError(f"cuda:{device_id} cannot access managed memory concurrently with "
                               f"the host, which the unified table mode needs: use "
                               f"table_mode='memcpy'")
        collect()
        self._keep = Keeper(device_id)
        with cupy.cuda.Device(device_id):
            self._buffers = [cupy.cuda.malloc_managed(max(nbytes, 16)) for _ in range(2)]
            self._released = [_Event() for _ in range(2)]
            self._latest_done = _Event()
        self._keep.memory += self._buffers
        self._current = 0
        self._written = False

    def __reduce_ex__(self, protocol):
        raise _not_copied(self)

    @property
    def ptr(self) -> int:
        return self._buffers[self._current].ptr

    @property
    def _reader_stream(self):
        return self._keep.stream

    def before_launch(self, stream: int) -> None:
        """Host writes are complete before any later launch; launches on a new stream wait for
        the latest one's (one chain of work)."""
        if stream != self._keep.stream:
            wait_for(self._keep.stream, stream, self._latest_done)
            self._keep.stream = stream

    def launched_on(self, stream: int) -> None:
        self._keep.stream = stream

    def write(self, table: np.ndarray, stream: int) -> None:
        """Writes `table` into the buffer not read by the latest launch; switches to it."""
        if _capturing(stream):
            raise RuntimeError("mtapply cannot rewrite a pointer table while the stream is being "
                               "captured into a CUDA graph: run one step before capturing")
        target = 1 - self._current if self._written else self._current
        if self._written and self._reader_stream is not None:
            self._released[self._current].record(self._reader_stream)
        self._released[target].wait_host()  # launches that read `target` finished a step ago
        view = (ctypes.c_uint8 * table.nbytes).from_address(self._buffers[target].ptr)
        np.frombuffer(view, dtype=np.uint8)[:] = table
        self._current = target
        self._written = True
