"""Elementwise list utilities: scale, unscale with non-finite detection, add, zero."""
from __future__ import annotations

import numpy as np

from .. import _cpu
from .._ranges import FACTOR
from ._spec import OpSpec, number_or_device_scalar


class _ElementwiseSpec(OpSpec):
    """What the ops of kernels/scaling.cuh share: their kernel arguments."""

    kernel_file = "scaling.cuh"
    arg_fields = ("factor", "factor_ptr", "found_inf_out")
    device_scalars = ("factor",)
    ranges = {"factor": FACTOR, "value": FACTOR}


class ScaleSpec(_ElementwiseSpec):
    """tensors * factor, in place, or into `outputs` (one per tensor, same shape)."""

    name = "scale"
    functor = "mta::Scale"

    def __init__(self, *, into_outputs: bool = False):
        self.into_outputs = bool(into_outputs)
        self.slots = ("tensors", "outputs") if self.into_outputs else ("tensors",)
        self.written = frozenset({self.slots[-1]})
        self.flags = (("OUT", self.into_outputs),)

    def arguments(self, *, factor) -> dict:
        return {"factor": number_or_device_scalar("factor", factor, FACTOR),
                "found_inf_out": None}

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        return {self.slots[-1]: arrays["tensors"] * dtype(args["factor"])}


class UnscaleSpec(_ElementwiseSpec):
    """torch.amp's unscale: tensors *= factor (the inverse scale), and `found_inf_out` is set
    to 1 when any element is inf or NaN (checked before scaling). The flag is only ever set:
    zero it before the call, as GradScaler does."""

    name = "unscale"
    functor = "mta::Unscale"
    slots = ("tensors",)
    written = frozenset({"tensors"})
    flags = ()

    def output_numel(self, name: str, n_tensors: int) -> int:
        return 1

    def arguments(self, *, factor, found_inf_out) -> dict:
        return {"factor": number_or_device_scalar("factor", factor, FACTOR),
                "found_inf_out": found_inf_out}

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        values = arrays["tensors"]
        if not np.all(np.isfinite(values)):
            _cpu.store(args["found_inf_out"].ref, np.ones(1))
        factor = dtype(args["factor"])
        return {"tensors": values if factor == 1 else values * factor}


class AddSpec(_ElementwiseSpec):
    """tensors + value, in place (with `found_inf=` set, nothing is added: a step counter
    advanced only by the steps that are taken)."""

    name = "add"
    functor = "mta::Add"
    device_scalars = ("value",)
    slots = ("tensors",)
    written = frozenset({"tensors"})
    flags = ()

    def arguments(self, *, value) -> dict:
        return {"factor": number_or_device_scalar("value", value, FACTOR),
                "found_inf_out": None}

    def field_of(self, name: str) -> str:
        return "factor" if name == "value" else name

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        return {"tensors": arrays["tensors"] + dtype(args["factor"])}


class ZeroSpec(_ElementwiseSpec):
    """Every element set to zero (no reads)."""

    name = "zero"
    functor = "mta::Zero"
    slots = ("tensors",)
    written = frozenset({"tensors"})
    flags = ()

    def arguments(self) -> dict:
        return {"factor": 0.0, "found_inf_out": None}

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        return {"tensors": np.zeros_like(arrays["tensors"])}


__all__ = ["AddSpec", "ScaleSpec", "UnscaleSpec", "ZeroSpec"]
