"""Descriptions of whole tensor lists in a few C-level passes: what the one-call API compares.

A description is an int64 array of five rows, one column per tensor: the address of its first
element, its element count, a code (dtype | device << 8 | contiguous << 24), and hashes of its
shape and strides. Two calls whose descriptions are equal pass the same tensors as far as any
check of mtapply can tell: same memory, dtypes, devices, shapes and layouts.

torch tensors are read by a small compiled library (`mtapply._native`, about 25 ns a tensor)
or, until it is built or where it cannot be, by maps of torch's accessors (about 0.5 us a
tensor); CuPy arrays by maps of their attributes. Lists of other producers, or of CPU tensors,
are not described: the caller then ingests them through DLPack every call.
"""
from __future__ import annotations

import ctypes
import operator
import sys

import numpy as np

from . import _native

ROWS = 5  # address, numel, code, shape hash, strides hash
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "uint8": 5}
_CONTIGUOUS = 1 << 24


def describe(tensors, framework: str) -> np.ndarray | None:
    """The (5, n) description of a list of CUDA tensors of `framework`, or None."""
    if framework == "torch":
        if not getattr(tensors[0], "is_cuda", False):
            return None  # the CPU backend gains nothing from a description
        description = describe_torch(tensors)
    elif framework == "cupy":
        description = _cupy(tensors)
    else:
        return None
    return None if description is None else _on_gpu(description)


def device_of(description: np.ndarray) -> np.ndarray:
    """The CUDA ordinal of each described tensor (-1 for a CPU tensor)."""
    return ((description[2] >> 8) & 0xFFFF) - 1


def describe_torch(tensors, *, native: bool = True) -> np.ndarray | None:
    """The description of torch tensors (CPU ones too), by the compiled describer once it is
    built (`native`), else by torch's accessors."""
    torch = sys.modules["torch"]
    function = _native_describer() if native else None
    if function is None:
        return _torch_by_accessors(tensors, torch)
    out = np.empty((len(tensors), ROWS), np.int64)
    if function(tensors, out.ctypes.data, torch.Tensor, torch.nn.Parameter) < 0:
        return None
    return out.T.copy()


def _native_describer():
    """The compiled describer once built (its build starts in the background on first use)."""
    return native_function("mta_describe_torch", [ctypes.py_object, ctypes.c_void_p,
                                                  ctypes.py_object, ctypes.py_object])


def native_function(name: str, argtypes: list):
    """A function of the compiled torch library (csrc/torch_describe.cpp) returning int64, once
    built (its build starts in the background on first use); None until then, or where it
    cannot be built."""
    lib = _native.library("torch_describe", wait=False)
    if lib is None:
        return None
    function = getattr(lib, name)
    if function.restype is not ctypes.c_int64:
        function.restype = ctypes.c_int64
        function.argtypes = argtypes
    return function


def _torch_by_accessors(tensors, torch) -> np.ndarray | None:
    """The description from torch's accessors, mapped over the list at C level."""
    n, T = len(tensors), torch.Tensor
    if not set(map(type, tensors)) <= {T, torch.nn.Parameter} or any(map(T.is_neg, tensors)):
        return None
    _torch_codes(torch)
    try:
        codes = np.fromiter(map(_TORCH_CODES.__getitem__, map(_DTYPE, tensors)), np.int64, n)
        out = np.empty((ROWS, n), np.int64)
        out[0] = np.fromiter(map(T.data_ptr, tensors), np.uint64, n).view(np.int64)
    except (KeyError, RuntimeError):  # another dtype, or no storage: DLPack explains
        return None
    out[1] = np.fromiter(map(T.numel, tensors), np.int64, n)
    devices = np.fromiter(map(T.get_device, tensors), np.int64, n)
    contiguous = np.fromiter(map(T.is_contiguous, tensors), np.int64, n)
    out[2] = codes | ((devices + 1) << 8) | contiguous * _CONTIGUOUS
    # the compiled describer's hashes: a plan described by one is found again by the other
    out[3] = np.fromiter(map(_fnv1a, map(_SHAPE, tensors)), np.uint64, n).view(np.int64)
    out[4] = np.fromiter(map(_fnv1a, map(T.stride, tensors)), np.uint64, n).view(np.int64)
    return out


def _fnv1a(values) -> int:
    """FNV-1a over 64-bit words, as csrc/torch_describe.cpp hashes sizes and strides."""
    h = 1469598103934665603 ^ len(values)
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _cupy(arrays) -> np.ndarray | None:
    """The description from CuPy's attributes. A C-contiguous array's strides follow from its
    shape, so only other arrays' strides are read."""
    import cupy

    n = len(arrays)
    if set(map(type, arrays)) != {cupy.ndarray}:
        return None
    try:
        codes = np.fromiter(map(_NUMPY_CODES.__getitem__, map(_DTYPE, arrays)), np.int64, n)
    except KeyError:
        return None
    out = np.empty((ROWS, n), np.int64)
    out[0] = np.fromiter(map(_DATA_PTR, arrays), np.uint64, n).view(np.int64)
    out[1] = np.fromiter(map(_SIZE, arrays), np.int64, n)
    devices = np.fromiter(map(_DEVICE_ID, arrays), np.int64, n)
    contiguous = np.fromiter(map(_cupy_contiguous(), arrays), np.int64, n)
    out[2] = codes | ((devices + 1) << 8) | contiguous * _CONTIGUOUS
    out[3] = shape_hashes(arrays)
    out[4] = 0
    for i in np.flatnonzero(contiguous == 0):
        out[4, i] = hash(arrays[i].strides)
    return out


def _cupy_contiguous():
    """CuPy's cached C-contiguity flag (`flags.c_contiguous` builds an object per call)."""
    global _C_CONTIGUOUS
    if _C_CONTIGUOUS is None:
        import cupy

        probe = cupy.ndarray
        _C_CONTIGUOUS = (operator.attrgetter("_c_contiguous") if hasattr(probe, "_c_contiguous")
                         else operator.attrgetter("flags.c_contiguous"))
    return _C_CONTIGUOUS


def shape_hashes(arrays) -> np.ndarray:
    """Hashes of the arrays' shapes, as the CuPy description holds them."""
    return np.fromiter(map(hash, map(_SHAPE, arrays)), np.int64, len(arrays))


def _on_gpu(description: np.ndarray) -> np.ndarray | None:
    """Only lists wholly on GPUs are described: the CPU backend gains nothing from it."""
    return description if (device_of(description) >= 0).all() else None


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_SIZE = operator.attrgetter("size")
_DATA_PTR = operator.attrgetter("data.ptr")
_DEVICE_ID = operator.attrgetter("data.device_id")
_C_CONTIGUOUS = None  # set at first use, see _cupy_contiguous
_NUMPY_CODES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
_TORCH_CODES: dict = {}


def _torch_codes(torch) -> None:
    if not _TORCH_CODES:
        _TORCH_CODES.update({getattr(torch, name): code for name, code in DTYPE_CODES.items()})
