"""What every op spec provides to the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceScalar:
    """A one-element float32 device array read by the kernel at run time (lr, step, ...)."""

    ptr: int
    obj: object  # keeps the memory alive


class OpSpec:
    """Base of op specs.

    A subclass sets: `name`, `kernel_file`, `functor` (C++ name), `slots` (argument names in
    kernel slot order), `written` (the slots the op writes), `flags` (compile-time switches),
    `arg_fields` (kernel argument words in order; a `*_ptr` word carries a DeviceScalar's address)
    and implements `arguments(**hyper)` and `cpu_update(arrays, args)`.
    """

    name: str
    kernel_file: str
    functor: str
    slots: tuple
    written: frozenset
    flags: tuple
    arg_fields: tuple

    @property
    def key(self) -> tuple:
        return (self.name, self.flags)


def check_number(name: str, value, *, low=None, high=None, high_open=False, low_open=False) -> float:
    """`value` as a float, or ValueError/TypeError naming `name` and the accepted range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if hasattr(value, "__float__") and not hasattr(value, "__dlpack__"):
            value = float(value)
        else:
            raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    bad = math.isnan(value)
    bad |= low is not None and (value <= low if low_open else value < low)
    bad |= high is not None and (value >= high if high_open else value > high)
    if bad:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}, "
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        rng = f"{lo}{hi}" if lo and hi else (f">{'' if low_open else '='} {low}" if lo else f"<= {high}")
        raise ValueError(f"{name} must be {rng}, got {value!r}")
    return value
