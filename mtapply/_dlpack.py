"""Zero-copy ingestion of framework tensors through the DLPack protocol.

Each tensor becomes a `TensorRef`: its address, element count, layout, dtype and device, plus the
object itself so that the memory stays alive as long as mtapply refers to it. The capsule is read
and released at once; mtapply never holds a DLPack capsule across calls.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

_DEVICE_CPU, _DEVICE_CUDA, _DEVICE_CUDA_HOST, _DEVICE_CUDA_MANAGED = 1, 2, 3, 13
_FLAG_READ_ONLY, _FLAG_IS_COPIED = 1, 2
_UINT, _FLOAT, _BFLOAT = 1, 2, 4
_DTYPES = {(_FLOAT, 16): "float16", (_FLOAT, 32): "float32", (_FLOAT, 64): "float64",
           (_BFLOAT, 16): "bfloat16", (_UINT, 8): "uint8"}  # uint8: codes of 8-bit states
# DLPack's type codes (dlpack.h v1.1), for messages naming a dtype mtapply does not take
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle ", 4: "bfloat", 5: "complex",
               6: "bool", 7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz",
               10: "float8_e4m3fn", 11: "float8_e4m3fnuz", 12: "float8_e5m2",
               13: "float8_e5m2fnuz", 14: "float8_e8m0fnu", 15: "float6_e2m3fn",
               16: "float6_e3m2fn", 17: "float4_e2m1fn"}
_SIZED = (0, 1, 2, 3, 4, 5)  # the codes whose name takes the width in bits (int8, complex64)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


ITEMSIZES = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(eq=False, slots=True)
class TensorRef:
    """What mtapply knows of one tensor. `obj` keeps the memory alive; treat it as immutable."""

    obj: object
    ptr: int
    numel: int
    shape: tuple
    strides: tuple  # in elements, row-major when the producer gave none
    dtype: str  # "float32", "float16", "bfloat16", "float64", or a description of another dtype
    device: tuple  # ("cpu", 0) or ("cuda", ordinal)
    read_only: bool
    copied: bool
    row_major: bool  # dense in row-major order (strides of size-1 dimensions aside)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES.get(self.dtype, 0)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def framework_of(obj) -> str:
    """Top-level module of the object's type: "torch", "cupy", "numpy", "jax", "jaxlib", ..."""
    return type(obj).__module__.split(".", 1)[0]


def device_of(obj, where: str) -> tuple:
    """("cpu", 0) or ("cuda", ordinal) from `__dlpack_device__`."""
    if not hasattr(obj, "__dlpack_device__") or not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{where} is a {type(obj).__name__}, which does not implement DLPack: "
                        f"pass a torch tensor, CuPy array or NumPy array")
    try:
        kind, ordinal = obj.__dlpack_device__()
    except Exception as error:  # the producer refuses (torch's meta device, ...)
        raise _refused(obj, where, error) from None
    kind = int(kind)
    if kind == _DEVICE_CPU:
        return ("cpu", 0)
    if kind in (_DEVICE_CUDA, _DEVICE_CUDA_MANAGED):
        return ("cuda", int(ordinal))
    raise TypeError(f"{where} lives on DLPack device type {kind}; mtapply handles CPU and CUDA "
                    f"memory: move it to the GPU or to host memory first")


def export(obj, where: str, stream: int | None) -> TensorRef:
    """Reads `obj` through DLPack. `stream` is the stream mtapply will use (None for CPU)."""
    if framework_of(obj) in ("jax", "jaxlib"):
        raise TypeError(f"{where} is a JAX array; JAX arrays are immutable and the in-place API "
                        f"cannot update them: use mtapply's JAX integration, which returns new "
                        f"arrays, or pass CuPy/torch arrays that you own")
    device = device_of(obj, where)
    # torch refuses to export tensors that require grad (every nn.Parameter); detach shares memory.
    source = obj.detach() if getattr(obj, "requires_grad", False) and hasattr(obj, "detach") else obj
    try:
        capsule = _call_dlpack(source, stream if device[0] == "cuda" else None)
    except Exception as error:  # the producer refuses to export it (sparse, conjugate, ...)
        raise _refused(obj, where, error) from None
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name))
        flags, dl = managed.flags, managed.dl_tensor
    elif name == b"dltensor":
        managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, name))
        flags, dl = 0, managed.dl_tensor
    else:
        raise TypeError(f"{where}: __dlpack__ returned a capsule named {name!r}, not a DLPack tensor")
    shape = tuple(dl.shape[i] for i in range(dl.ndim))
    strides = tuple(dl.strides[i] for i in range(dl.ndim)) if dl.strides else row_major_strides(shape)
    numel = 1
    for extent in shape:
        numel *= extent
    dtype = dtype_name(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes)
    row_major = all(s == r for s, r, e in zip(strides, row_major_strides(shape), shape) if e != 1)
    return TensorRef(obj=obj, ptr=(dl.data or 0) + dl.byte_offset, numel=numel, shape=shape,
                     strides=strides, dtype=dtype, device=device,
                     read_only=bool(flags & _FLAG_READ_ONLY), copied=bool(flags & _FLAG_IS_COPIED),
                     row_major=row_major)


def dtype_name(code: int, bits: int, lanes: int = 1) -> str:
    """A DLPack dtype in words: "float32", "float8_e4m3fn", "complex64", "bool", "int8x4"."""
    name = _DTYPES.get((code, bits)) if lanes == 1 else None
    if name is None:
        base = _CODE_NAMES.get(code)
        if base is None:
            name = f"an unknown DLPack type (code {code}, {bits} bits)"
        else:
            name = f"{base}{bits}" if code in _SIZED else base
    return name + (f"x{lanes}" if lanes != 1 else "")


def _refused(obj, where: str, error: Exception) -> TypeError:
    """The error for a tensor that its producer does not export through DLPack."""
    what = type(obj).__name__
    details = [f"{name} {getattr(obj, name)}" for name in ("dtype", "device")
               if getattr(obj, name, None) is not None]
    described = f"a {what}" + (f" ({', '.join(details)})" if details else "")
    return TypeError(f"{where} is {described} that cannot be read through DLPack: its producer "
                     f"says \"{str(error).strip() or type(error).__name__}\". mtapply takes "
                     f"dense floating tensors in CPU or CUDA memory: move or convert it first")


def _call_dlpack(obj, stream):
    """`obj.__dlpack__` asking for a versioned capsule, falling back for older producers."""
    attempts = ({"stream": stream, "max_version": (1, 0), "copy": False},
                {"stream": stream, "max_version": (1, 0)}, {"stream": stream}, {})
    for kwargs in attempts:
        try:
            return obj.__dlpack__(**kwargs)
        except TypeError:
            continue
    return obj.__dlpack__()


def row_major_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def is_dense(ref: TensorRef) -> bool:
    """True when the tensor covers exactly `numel` consecutive elements, in some dimension order."""
    if ref.row_major or ref.numel == 0:  # producers give empty tensors arbitrary strides, e.g. (0, 0) for (3, 0)
        return True
    dims = sorted((s, e) for s, e in zip(ref.strides, ref.shape) if e != 1)
    expected = 1
    for stride, extent in dims:
        if stride != expected:
            return False
        expected *= extent
    return True
