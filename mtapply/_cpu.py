"""The CPU backend: the same ops on host memory, with NumPy, slowly but with the same semantics.

Tensors are viewed in place through their addresses (zero copy); the math runs in float32 for
16- and 32-bit storage and float64 for float64, then rounds back to the storage type. Values
given as one-element float32 arrays (device scalars on a GPU) are read when the step runs and
checked as the kernels check them: one out of its range makes the step write nothing.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ._ranges import GRAD_SCALE
from .stochastic import round_to_bfloat16_stochastic

_STORAGE = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
            "uint8": np.uint8}


def view(ref) -> np.ndarray:
    """A flat NumPy view of a dense host tensor's memory (bfloat16 as raw uint16)."""
    storage = _STORAGE[ref.dtype]
    if ref.numel == 0:
        return np.empty(0, dtype=storage)
    buffer = (ctypes.c_char * ref.nbytes).from_address(ref.ptr)
    return np.frombuffer(buffer, dtype=storage, count=ref.numel)


def load(ref, dtype) -> np.ndarray:
    raw = view(ref)
    if ref.dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(dtype)
    return raw.astype(dtype)


def store(ref, values: np.ndarray) -> None:
    raw = view(ref)
    if ref.dtype == "bfloat16":
        raw[:] = round_to_bfloat16_bits(values)
    else:
        raw[:] = values.astype(raw.dtype)


def store_stochastic(ref, values: np.ndarray, args: dict, tensor: int) -> None:
    """bfloat16 params rounded stochastically, with the bits the kernel draws for them."""
    seed = int(args["seed_lo"]) | int(args["seed_hi"]) << 32
    view(ref)[:] = round_to_bfloat16_stochastic(values, seed, int(args["step"]), tensor)


def round_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float values rounded to bfloat16 (nearest, ties to even), as raw uint16 bits."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    nan = np.isnan(values)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def run(spec, refs: dict, args: dict, grad_scale=1.0, rows=None, found_inf=None) -> bool:
    """Applies `spec` to every tensor of `refs` (slot -> list of TensorRef) with `args`, or
    with its row's where `rows` (mtapply._rows.Rows) is given; grads are divided by
    `grad_scale` first (AMP), in the math type, as the kernel does. With master
    weights the op sees the fp32 master as its param, and the param receives the rounded
    result. Param modes as `OpSpec.with_param_mode` says.

    DeviceScalars (of `args`, the rows, `grad_scale`, `found_inf`) are read now: nothing is
    written where found_inf is non-zero, nor where a value is out of its range, which returns
    False (as the kernels do, see kernels/walker.cuh `step_runs`)."""
    if found_inf is not None and _read(found_inf) != 0.0:
        return True
    values = _values(spec, args, rows, grad_scale)
    if values is None:
        return False
    args, row_args, grad_scale = values
    if rows is None and spec.cpu_run(refs, args, grad_scale):
        return True
    tensor_args = (lambda i: args) if rows is None else (lambda i: row_args[rows.row_of[i]])
    totals = None
    if spec.n_totals:  # whole-list sums: a first pass over every tensor
        totals = spec.cpu_totals((i, arrays, tensor_args(i), dtype)
                                 for i, dtype, arrays in _tensors(spec, refs, grad_scale))
    for i, dtype, arrays in _tensors(spec, refs, grad_scale):
        given = tensor_args(i) if totals is None else dict(tensor_args(i), totals_array=totals)
        for name, values in spec.cpu_update(dict(arrays), given, dtype, i).items():
            if name == "params" and spec.param_mode == "delta":
                store(refs["updates"][i], values - arrays["params"])
                continue
            if name == "params" and spec.stochastic_rounding:
                store_stochastic(refs[name][i], values, given, i)
                continue
            store(refs[name][i], values)
            if name == "params" and spec.master_weights:
                store(refs["master_params"][i], values)
    return True


def _tensors(spec, refs: dict, grad_scale):
    """(index, math dtype, slot name -> values) of each non-empty tensor, as the op sees it:
    the fp32 master as the param, zero params in the zero mode, grads unscaled."""
    first = refs[spec.slots[0]]
    for i in range(len(first)):
        if first[i].numel == 0:
            continue
        dtype = np.float64 if first[i].dtype == "float64" else np.float32
        arrays = {name: load(column[i], dtype) for name, column in refs.items()
                  if name != "updates"}
        if spec.master_weights:
            arrays["params"] = arrays.pop("master_params")
        if spec.param_mode == "zero":
            arrays["params"] = np.zeros_like(arrays["params"])
        if grad_scale != 1.0:
            arrays["grads"] = arrays["grads"] / dtype(grad_scale)
        yield i, dtype, arrays


def _values(spec, args: dict, rows, grad_scale):
    """(args, each row's args, grad_scale) with every DeviceScalar read; None where one is out
    of the range its op declares."""
    if not isinstance(grad_scale, float):
        grad_scale = _read(grad_scale)
        if not GRAD_SCALE.holds(grad_scale):
            return None
    checks = [(spec.field_of(name), spec.scalar_range(name), spec.scalar_count(name))
              for name in spec.device_scalars]
    resolved = [_read_args(args, checks)]
    if rows is not None:
        resolved += [_read_args(row, checks) for row in rows.checked]
    if any(r is None for r in resolved):
        return None
    return resolved[0], resolved[1:], grad_scale


def _read_args(args: dict, checks: list) -> dict | None:
    out = dict(args)
    for field, allowed, count in checks:
        value = args.get(field)
        if hasattr(value, "ptr") and not hasattr(value, "ref"):  # a DeviceScalar
            values = [_read(value, j) for j in range(count)]
            if not all(map(allowed.holds, values)):
                return None
            out[field] = values[0]
    return out


def _read(scalar, index: int = 0) -> float:
    """The float32 value at a DeviceScalar's address in host memory (a number stays itself)."""
    if isinstance(scalar, (int, float)):
        return float(scalar)
    return float(ctypes.c_float.from_address(scalar.ptr + 4 * index).value)
