"""Float32 Adam pieces stepped by the native library `cpu_eight_bit` (mtapply._native).

`mtapply._cpu._run_in_place` steps the in-place pieces of an op whose float32 update carries
`adam` (its options: AdamSpec's, amsgrad aside) with `mtapply_adam_piece`, the operations of
`reference.adam_into` bit for bit in one pass, with the GIL let go. Other pieces (float64), or
every piece without the library (or with MTAPPLY_NATIVE=0), are stepped by NumPy.
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import _cpu_eight_bit, _native

_FUNCTION = []  # the native function once its argument types are set


def native_step(cache: dict, pieces: list, updates: dict, numpy_step):
    """(items, step) stepping `pieces` natively where they are float32, `numpy_step(piece)`
    elsewhere; None where no piece is stepped natively (no Adam update, or no library)."""
    options = getattr(updates.get(np.float32), "adam", None)
    if options is None or not _native.enabled():
        return None
    function = _function()
    if function is None:
        return None
    items = cache.get("adam_native")
    if items is None:
        items = cache["adam_native"] = [(piece, _addresses(piece)) for piece in pieces]
    hyper, variant = _cpu_eight_bit._adam_scalars(options)
    address = hyper.ctypes.data

    def step(item: tuple) -> None:
        piece, addresses = item
        if addresses is None:
            numpy_step(piece)
        else:
            function(*addresses, address, variant)

    step.hyper = hyper  # the memory at `address`, alive while the pieces are stepped
    return items, step


def _function():
    if not _FUNCTION:
        library = _native.library("cpu_eight_bit")
        if library is None:
            return None
        function = library.mtapply_adam_piece
        pointer = ctypes.c_void_p
        function.argtypes = [pointer] * 4 + [ctypes.c_int64, pointer, ctypes.c_int32]
        function.restype = None
        _FUNCTION.append(function)
    return _FUNCTION[0]


def _addresses(piece: tuple):
    """(param, grad, exp_avg, exp_avg_sq addresses, size) of a float32 piece of Adam's slots;
    None for a float64 one."""
    _, dtype, reads, writes = piece
    if dtype is not np.float32 or len(reads) != 4 or len(writes) != 3:
        return None
    return (writes[0].ctypes.data, reads[1].ctypes.data, writes[1].ctypes.data,
            writes[2].ctypes.data, len(writes[0]))


__all__ = ["native_step"]
