"""Streams and kernel launches.

A launch goes on the stream the caller passed, else on the current stream of the framework the
tensors come from (torch: torch.cuda.current_stream(device); otherwise CuPy's current stream),
so that it is ordered with the framework's own work. Kernel arguments are one struct of 64-bit
words packed once per group; a step rewrites the few words that change and launches through the
driver, so a step costs a handful of microseconds of host time.
"""
from __future__ import annotations

import ctypes
import struct
import sys

from ._torch_fast import order_after_current_stream

_NAN = float("nan")
_DOUBLE = struct.Struct("<d")
_ADDRESSES = ("_ptr", "_array", "_out")  # argument fields that carry a device address
_HEADER = "<2QdQQ8Q2q2Q2QqqQ"  # table, AMP, workspace, rows, step count, checks; then the op's
HEADER_BYTES = struct.calcsize(_HEADER)  # where the op's words start (kernels assert it)


def stream_pointer(stream, framework: str, device_id: int) -> int:
    """The CUDA stream handle (an int) to launch on."""
    if stream is None:
        if framework == "torch" and "torch" in sys.modules:
            return (_torch_stream or _find_torch_stream())(device_id)
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


def stream_and_owner(stream, framework: str, device_id: int) -> tuple:
    """(the CUDA stream handle to launch on, the object whose life its handle shares or None):
    a CuPy stream destroys its handle with the object (torch's pooled streams are never
    destroyed; a raw int is the caller's to keep)."""
    if stream is None and not (framework == "torch" and "torch" in sys.modules):
        import cupy

        current = cupy.cuda.get_current_stream(device_id)
        return current.ptr, current
    handle = stream_pointer(stream, framework, device_id)
    return handle, (None if stream is None or isinstance(stream, int) else stream)


_torch_stream = None  # torch's current raw stream of a device, once torch is imported


def _find_torch_stream():
    global _torch_stream
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 10x cheaper when present
    _torch_stream = raw or (lambda device_id: torch.cuda.current_stream(device_id).cuda_stream)
    return _torch_stream


def order_after_producer(framework: str, device_id: int, stream: int) -> None:
    """Makes `stream` wait for the work queued so far on the framework's current stream of
    the device (what a DLPack export with `stream=` does)."""
    if framework == "torch":
        order_after_current_stream(device_id, stream)
        return
    import cupy

    with cupy.cuda.Device(device_id):
        current = cupy.cuda.get_current_stream()
        if current.ptr != stream:
            cupy.cuda.runtime.streamWaitEvent(stream, current.record().ptr, 0)


def field_word(arg_fields: tuple, field: str) -> int:
    """Index of the 64-bit word of an op's argument field in the packed launch struct."""
    return struct.calcsize(_HEADER) // 8 + arg_fields.index(field)


def dlpack_stream(handle: int) -> int:
    """The DLPack `stream=` number for a handle: the legacy default stream is 1, not 0."""
    return 1 if handle == 0 else handle


class KernelLaunch:
    """The argument words and geometry of one kernel launch; `launch` issues it.

    The kernel takes one struct of 64-bit words (kernels/walker.cuh, `Launch`): the two table
    addresses, the AMP scaling words, the workspace words, then the op's `arg_fields` (a
    double; the address of a DeviceScalar for a `*_ptr` field; of a per-tensor array for an
    `*_array` field; of an output array for an `*_out` field). It lives in a host buffer that
    the driver copies at launch, so it can be rewritten right after.
    """

    def __init__(self, function, threads: int, n_blocks: int, arg_fields: tuple):
        self.function = function.ptr
        self.threads = threads
        self.n_blocks = n_blocks
        self._layout = [(name, name + "_ptr" in arg_fields) for name in arg_fields
                        if not name.endswith("_ptr")]
        self._packer = struct.Struct(_HEADER + "".join("Q" if f.endswith(_ADDRESSES) else "d"
                                                             for f in arg_fields))
        self._words = ctypes.create_string_buffer(self._packer.size)
        self._number_offsets = {f: 8 * field_word(arg_fields, f) for f in arg_fields
                                if not f.endswith(_ADDRESSES)}
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(self._words))
        self._params_ptr = ctypes.addressof(self._params)
        self._table = (0, 0)
        self._workspace = (0,) * 8
        self._fused = (0, 0)  # jobs and tickets: a fused launch's (walk_fused) or busy blocks
        self._rows = (0, 0)
        self._counting = (0, 0, 0)
        self._checks = (0, 0)  # rows the kernel checks, the address of the `invalid` flag
        self._arrays: dict = {}

    def set_table(self, blocks_ptr: int, records_ptr: int) -> None:
        self._table = (blocks_ptr, records_ptr)

    def set_workspace(self, partials_ptr: int, arrivals_ptr: int, sums_ptr: int, plan_sums) -> None:
        """This group's workspace, and the plan's (all_sums, positions, finished, n_tensors,
        n_nonempty): see kernels/walker.cuh, `Launch`."""
        self._workspace = (partials_ptr, arrivals_ptr, sums_ptr, *plan_sums)

    def set_fused(self, jobs_ptr: int, tickets_ptr: int) -> None:
        """Makes this a fused launch of a two-pass op: its jobs (kernels/walker.cuh,
        walk_fused) and the count of those taken."""
        self._fused = (jobs_ptr, tickets_ptr)

    def set_jobs(self, jobs_ptr: int, n_blocks: int) -> None:
        """Launches n_blocks blocks, block b taking the chunk of the group's block jobs[b]
        (kernels/factored.cuh, MatrixBlock)."""
        self._fused = (jobs_ptr, 0)
        self.n_blocks = n_blocks

    def set_rows(self, rows_ptr: int, row_of_ptr: int, checked_rows: int = 0) -> None:
        """Per-tensor args: the device rows of distinct args (as `row_words` packs them) and
        each tensor's row; (0, 0) for the launch's own args. `checked_rows`: how many rows the
        kernel checks (all of them where some hold device values the host did not check)."""
        self._rows = (rows_ptr, row_of_ptr)
        self._checks = (checked_rows, self._checks[1])

    def set_invalid(self, flag_ptr: int) -> None:
        """The float32 flag the launch sets to 1 when a device value is out of its range."""
        self._checks = (self._checks[0], flag_ptr)

    def set_counting(self, counter_ptr: int, arrivals_ptr: int, step_blocks: int) -> None:
        """The plan's step counter, which this launch reads (plus one) as the step, and its
        arrival count; `step_blocks` > 0 in the step's last pass, whose blocks advance it."""
        self._counting = (counter_ptr, arrivals_ptr, step_blocks)

    def row_words(self, args: dict) -> bytes:
        """The op's argument words for `args`, one row of the kernel's `args_rows`."""
        return self._packer.pack(*self._values(args, 1.0, None))[struct.calcsize(_HEADER):]

    def row_word(self, name: str) -> int:
        """Index of the word of the number field `name` in a row of `row_words`."""
        words = 0
        for field, has_pointer in self._layout:
            if field == name:
                return words
            words += 2 if has_pointer else 1
        raise KeyError(name)

    def set_array(self, name: str, ptr: int) -> None:
        self._arrays[name] = ptr

    def set_args(self, args: dict, grad_scale=1.0, found_inf=None) -> None:
        """Packs each argument: a float as is, a DeviceScalar as NaN plus its address.

        grad_scale is a float or a DeviceScalar; found_inf is None or a DeviceScalar.
        """
        self._packer.pack_into(self._words, 0, *self._values(args, grad_scale, found_inf))

    def set_number(self, field: str, value: float) -> None:
        """Packs a new number into the word of `field`, which held a number (not a device
        value) before: the other words, the device-value flag among them, stay as they are."""
        _DOUBLE.pack_into(self._words, self._number_offsets[field], value)

    def _values(self, args: dict, grad_scale, found_inf) -> list:
        values = list(self._table)
        if type(grad_scale) is float:
            values += (grad_scale, 0)
        else:
            values += (_NAN, grad_scale.ptr)
        values.append(0 if found_inf is None else found_inf.ptr)
        values += self._workspace[:6]
        values += self._fused
        values += self._workspace[6:]
        values += self._rows
        values += self._counting
        op_words, device_args = self._arg_values(args)
        # The flag goes only to a launch with device values to check: without it, the kernel
        # checks nothing (kernels/walker.cuh, step_runs), which saves every block the checks'
        # loads where all values are host numbers the host has checked.
        checked = (device_args or type(grad_scale) is not float or self._counting[0] != 0
                   or self._checks[0] > 0)
        values += (self._checks[0], self._checks[1] if checked else 0)
        return values + op_words

    def _arg_values(self, args: dict) -> tuple:
        """The op's argument words, and whether any of them points at a device scalar."""
        values, device = [], False
        for name, has_pointer in self._layout:
            if name.endswith("_array"):
                values.append(self._arrays[name])
                continue
            if name.endswith("_out"):  # an output array: its address, or 0 for none
                values.append(0 if args[name] is None else args[name].ptr)
                continue
            value = args[name]
            if type(value) is float:
                values.append(value)
                if has_pointer:
                    values.append(0)
            else:
                values.append(_NAN)
                values.append(value.ptr)
                device = True
        return values, device

    def words(self) -> bytes:
        """The packed argument struct, as the kernel receives it."""
        return self._words.raw

    def launch(self, stream: int) -> None:
        _launch_kernel(self.function, self.n_blocks, 1, 1, self.threads, 1, 1, 0, stream,
                       self._params_ptr, 0)


def _launch_kernel(*args) -> None:
    from cupy_backends.cuda.api import driver

    global _launch_kernel
    _launch_kernel = driver.launchKernel
    driver.launchKernel(*args)


class _StreamRef:
    """A raw stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def cupy_stream(handle: int, device_id: int):
    """A raw stream handle as a CuPy stream, to make it CuPy's current stream in a `with`
    (CuPy 14's from_external; ExternalStream before it)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamRef(handle))
    return cupy.cuda.ExternalStream(handle, device_id)
