"""mtapply's kernels as an XLA FFI custom call: the jitted step of `mtapply.optax` on GPUs.

At trace time `prepare` binds an op to the structure of a pytree (each leaf's dtype and size,
and which buffer of the call holds each slot of each leaf): on every local GPU it compiles the
kernels, uploads the block map and allocates the records and workspaces (_launcher.Launcher),
packs each launch's argument words, and registers all of it with the handler of
`csrc/xla_ffi.cpp` under an id. The traced program then holds one `mtapply_step` custom call
naming that id. At run time XLA calls the compiled handler with the buffers and its stream; no
Python runs. The handler re-uploads only the records whose buffers moved since its last call
on that device, on XLA's stream.

`available()` says whether the path can be used (a GPU, CuPy, and the handler built); callers
keep to `jax.experimental.buffer_callback` elsewhere, with the same semantics.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import _native
from ._launch import field_word
from ._launcher import Launcher, with_shapes
from .ops._spec import DeviceScalar

TARGET = "mtapply_step"

_lock = threading.Lock()
_state: dict = {}  # "lib", "registered", "problem"
_plans: dict = {}  # id -> the launchers that own each plan's device memory
_ids: dict = {}  # what a plan does (see _identity) -> its id: equal calls share one plan


def available() -> bool:
    """True when the FFI path can run here: the handler is built and registered with XLA,
    and CuPy sees the GPUs."""
    with _lock:
        if "registered" not in _state:
            _state["registered"] = _register()
    return _state["registered"]


def _register() -> bool:
    try:
        import cupy
        import jax

        if not jax.devices("gpu") or cupy.cuda.runtime.getDeviceCount() == 0:
            return False
    except Exception:  # no GPU backend, no CuPy, no driver
        return False
    lib = _native.library("xla_ffi")
    if lib is None:
        return False
    _configure(lib)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.mta_ffi_step), platform="CUDA")
    _state["lib"] = lib
    return True


def _configure(lib) -> None:
    i32, i64, u32, u64, ptr = (ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64,
                               ctypes.c_void_p)
    lib.mta_plan_create.restype = i64
    lib.mta_plan_create.argtypes = [i32, ptr, ptr, i32, ptr]
    lib.mta_plan_add_group.restype = i32
    lib.mta_plan_add_group.argtypes = [i64, i32, i32, ptr, u32, u32, i32, ptr, u64, i32, i32, ptr,
                                       ptr, ptr]
    lib.mta_plan_refresh.restype = i32
    lib.mta_plan_refresh.argtypes = [i64, i32, ptr, ptr]
    lib.mta_plan_records.restype = i32
    lib.mta_plan_records.argtypes = [i64, i32, i32, ptr]
    lib.mta_plan_destroy.restype = None
    lib.mta_plan_destroy.argtypes = [i64]


def prepare(spec, operands: np.ndarray, offsets: np.ndarray, dtypes: list, numels: list,
            hyper: dict, scalar_operands: dict, devices: list, elements: list,
            shapes: dict | None = None) -> int:
    """Registers `spec` over a tree of len(numels) leaves and returns the plan's id; a call
    equal to one registered before (the same op, hyperparameters, tree and buffers) gets that
    plan's id, so tracing a step again (a transformation made anew for each step, as
    optax.inject_hyperparams does) allocates nothing more on the GPUs.

    operands, offsets: (leaves, spec slots) arrays: the call's buffer holding each slot of each
        leaf (the call's results, then its arguments) and the leaf's byte offset in it.
    dtypes: per leaf, the dtype of each spec slot.
    hyper: the op's step arguments, with a placeholder DeviceScalar for each scalar operand.
    scalar_operands: step argument name -> operand index of its one-element float32 buffer.
    devices: the CUDA ordinals that may run the call; each gets its own kernels, tables and
        workspaces, and the handler picks them by the device of XLA's stream.
    elements: the element count of each of the call's buffers (results, then arguments),
        which the handler checks at each call: a call partitioned by XLA would hand it parts.
    shapes: spec slot -> the shape of each leaf's array of it (a factored rule's kernels read
        each param's rows and columns); None where the op needs none.
    """
    getattr(spec, "refuse_cuda", lambda: None)()  # a rule without CUDA kernels, by name
    elements = np.ascontiguousarray(elements, np.int64)
    shapes = None if shapes is None else {k: tuple(tuple(int(n) for n in shape) for shape in v)
                                          for k, v in shapes.items()}
    identity = _identity(spec, operands, offsets, dtypes, numels, hyper, scalar_operands,
                         devices, elements, shapes)
    with _lock:
        if identity in _ids:
            return _ids[identity]
        plan_id = _register_plan(spec, operands, offsets, dtypes, numels, hyper,
                                 scalar_operands, devices, elements, shapes)
        _ids[identity] = plan_id
        return plan_id


def _identity(spec, operands, offsets, dtypes, numels, hyper, scalar_operands, devices,
              elements, shapes) -> tuple:
    """Everything a registered plan depends on, hashable."""
    def value(v):
        return ("device", v.obj) if isinstance(v, DeviceScalar) else v

    return (spec.call_key(len(numels)), spec.param_mode, operands.tobytes(), operands.shape,
            offsets.tobytes(), tuple(dtypes), tuple(int(n) for n in numels),
            tuple(sorted((k, value(v)) for k, v in hyper.items())),
            tuple(sorted(scalar_operands.items())), tuple(devices), elements.tobytes(),
            None if shapes is None else tuple(sorted(shapes.items())))


def _register_plan(spec, operands, offsets, dtypes, numels, hyper, scalar_operands, devices,
                   elements, shapes) -> int:
    lib = _state["lib"]
    if operands.size and (operands.min() < 0 or operands.max() >= len(elements)):
        raise ValueError(f"mtapply: a plan's operand index is outside the call's "
                         f"{len(elements)} buffers")
    words = {name: field_word(spec.arg_fields, _pointer_field(spec, name))
             for name in scalar_operands if _pointer_field(spec, name) is not None}
    names = list(words)
    scalar_words = _i32([words[n] for n in names])
    operand_of = _i32([scalar_operands[n] for n in names])
    plan_id = lib.mta_plan_create(len(names), scalar_words.ctypes.data, operand_of.ctypes.data,
                                  len(elements), elements.ctypes.data)
    if plan_id < 0:
        raise ValueError("mtapply: a plan's scalar operand is outside the call's buffers")
    args = spec.arguments(**hyper)
    numels = np.asarray(numels, np.int64)
    pointers = np.zeros((len(numels), len(spec.slots)), np.uint64)
    launchers = []
    for device_id in devices:
        launcher = _device_launcher(spec, dtypes, numels, pointers, device_id, shapes)
        launchers.append(launcher)
        for group, table, passes in zip(launcher.groups, launcher.tables, launcher.launches):
            _add_group(lib, plan_id, device_id, group, table, passes, args,
                       operands[group.indices], offsets[group.indices])
    _plans[plan_id] = launchers
    return plan_id


def _pointer_field(spec, name: str) -> str | None:
    """The argument word that takes the address of `name`'s buffer: a device scalar's pointer
    (`<field>_ptr`), or an output array's own word (a rule's scalar state); None if the op has
    neither."""
    field = spec.field_of(name)
    if f"{field}_ptr" in spec.arg_fields:
        return f"{field}_ptr"
    return field if field.endswith("_out") and field in spec.arg_fields else None


def _device_launcher(spec, dtypes, numels, pointers, device_id, shapes) -> Launcher:
    """The kernels, tables and workspaces of the plan on one GPU, ready before XLA runs."""
    import cupy

    arrays, means = spec.tensor_arrays(len(numels)), 0
    if shapes is not None:
        arrays, means = with_shapes(spec, {k: [_Shape(s) for s in v] for k, v in shapes.items()},
                                    arrays)
    with cupy.cuda.Device(device_id):
        launcher = Launcher(spec, arrays, dtypes, numels, pointers, "memcpy", device_id, 0,
                            means)
        for passes in launcher.launches:  # an out-of-range value goes through, as in optax: a
            for launch in passes:  # skipped step would return the outputs unwritten
                launch.set_invalid(0)
        cupy.cuda.runtime.deviceSynchronize()  # XLA's stream does not wait for these uploads
    return launcher


def _add_group(lib, plan_id, device_id, group, table, passes, args, operands, offsets) -> None:
    for launch in passes:
        launch.set_args(args)
    # each array a local: its memory must outlive the call that reads it
    words = np.frombuffer(passes[0].words(), np.uint64).copy()
    functions = np.array([launch.function for launch in passes], np.uint64)
    numels = np.ascontiguousarray(group.numels, np.int64)
    operands = np.ascontiguousarray(operands, np.int32)
    offsets = np.ascontiguousarray(offsets, np.int64)
    status = lib.mta_plan_add_group(
        plan_id, device_id, len(passes), functions.ctypes.data, passes[0].n_blocks,
        passes[0].threads, len(words),
        words.ctypes.data, table.ptr + group.records_offset, len(numels), operands.shape[1],
        numels.ctypes.data, operands.ctypes.data, offsets.ctypes.data)
    if status != 0:
        raise RuntimeError(f"mtapply: registering plan {plan_id} failed")


class _Shape:
    """An array's shape and element count, as a factored rule's `shape_words` reads them."""

    def __init__(self, shape: tuple):
        self.shape, self.numel = shape, int(np.prod(shape, dtype=np.int64))


def placeholder(index: int) -> DeviceScalar:
    """The stand-in of scalar operand `index` while the argument words are packed (the handler
    writes the buffer's address over it at each call)."""
    return DeviceScalar(ptr=0, obj=index)


def _i32(values) -> np.ndarray:
    return np.ascontiguousarray(values, np.int32) if len(values) else np.zeros(1, np.int32)
