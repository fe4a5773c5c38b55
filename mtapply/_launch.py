"""Streams and kernel launches.

A launch goes on the stream the caller passed, else on the current stream of the framework the
tensors come from (torch: torch.cuda.current_stream(device); otherwise CuPy's current stream),
so that it is ordered with the framework's own work. Kernel arguments are one struct of 64-bit
words packed once per group; a step rewrites the few words that change and launches through the
driver, so a step costs a handful of microseconds of host time.
"""
from __future__ import annotations

import sys

import numpy as np


def stream_pointer(stream, framework: str, device_id: int) -> int:
    """The CUDA stream handle (an int) to launch on."""
    if stream is None:
        torch = sys.modules.get("torch") if framework == "torch" else None
        if torch is not None:
            return torch.cuda.current_stream(device_id).cuda_stream
        import cupy

        return cupy.cuda.get_current_stream(device_id).ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise TypeError(f"stream must be a torch or CuPy stream, an object with __cuda_stream__, or a "
                    f"raw cudaStream_t int; got {type(stream).__name__}")


def dlpack_stream(handle: int) -> int:
    """The DLPack `stream=` number for a handle: the legacy default stream is 1, not 0."""
    return 1 if handle == 0 else handle


class KernelLaunch:
    """The argument words and geometry of one group's kernel; `launch` issues it."""

    def __init__(self, kernel, threads: int, n_blocks: int, arg_fields: tuple):
        self.function = kernel.kernel.ptr
        self.threads = threads
        self.n_blocks = n_blocks
        self.words = np.zeros(2 + len(arg_fields), dtype=np.uint64)
        self.doubles = self.words.view(np.float64)
        self.slot = {name: 2 + k for k, name in enumerate(arg_fields)}
        self._params = np.array([self.words.ctypes.data], dtype=np.uint64)
        self._params_ptr = self._params.ctypes.data

    def set_table(self, blocks_ptr: int, records_ptr: int) -> None:
        self.words[0] = blocks_ptr
        self.words[1] = records_ptr

    def set_args(self, args: dict) -> None:
        """Writes each argument: a number into its word, a DeviceScalar's address into `*_ptr`."""
        for name, value in args.items():
            index = self.slot[name]
            if isinstance(value, float):
                self.doubles[index] = value
                if name + "_ptr" in self.slot:
                    self.words[self.slot[name + "_ptr"]] = 0
            else:
                self.doubles[index] = float("nan")
                self.words[self.slot[name + "_ptr"]] = value.ptr

    def launch(self, stream: int) -> None:
        from cupy_backends.cuda.api import driver

        driver.launchKernel(self.function, self.n_blocks, 1, 1, self.threads, 1, 1, 0, stream,
                            self._params_ptr, 0)
