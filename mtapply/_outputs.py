"""Result arrays that mtapply allocates for the caller, in the caller's framework."""
from __future__ import annotations

import numpy as np


def new_float32(framework: str, device: tuple, n: int):
    """An uninitialised float32 array of n elements on `device`, of the tensors' framework
    (torch tensors give torch tensors, CuPy arrays CuPy arrays, NumPy arrays NumPy arrays)."""
    if framework == "torch":
        import torch

        where = "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"
        return torch.empty(n, dtype=torch.float32, device=where)
    if device[0] == "cuda":
        import cupy

        with cupy.cuda.Device(device[1]):
            return cupy.empty(n, dtype=cupy.float32)
    return np.empty(n, dtype=np.float32)


def fill_zero(array) -> None:
    """Zeroes an array made by `new_float32` (or any torch, CuPy or NumPy array)."""
    if hasattr(array, "zero_"):
        array.zero_()
    else:
        array.fill(0)
