"""The public elementwise list utilities: scale, unscale (AMP), add, zero."""
from __future__ import annotations

from . import _calls
from .ops.scaling import AddSpec, ScaleSpec, UnscaleSpec, ZeroSpec


def scale_(tensors, factor, *, outputs=None, stream=None, table_mode=None) -> None:
    """Multiplies every element of a list by `factor`: in place, or into `outputs` (one tensor
    of the same shape per input; the inputs are then only read).

    `factor` is a number or a one-element float32 device array read by the kernel. One launch
    per (device, dtype) group.
    """
    spec = ScaleSpec(into_outputs=outputs is not None)
    slots = {"tensors": tensors, "outputs": outputs} if outputs is not None else {"tensors": tensors}
    spec.arguments(factor=factor)
    _calls.step(spec, slots, table_mode=table_mode, stream=stream, factor=factor)


def unscale_(grads, inv_scale, found_inf, *, stream=None, table_mode=None) -> None:
    """torch.amp.GradScaler's unscale on the device: grads *= inv_scale, and `found_inf`
    (a one-element float32 array) is set to 1.0 when any grad is inf or NaN.

    `found_inf` is only ever set, never cleared: zero it first, as GradScaler does. Pass the
    result on as `found_inf=` to a step, which then writes nothing.
    """
    _calls.step(UnscaleSpec(), {"tensors": grads}, table_mode=table_mode, stream=stream,
                factor=inv_scale, found_inf_out=found_inf)


def add_(tensors, value, *, stream=None, table_mode=None) -> None:
    """Adds `value` (a number, or a one-element float32 device array read by the kernel) to
    every element of a list, in place, in one launch per (device, dtype) group."""
    AddSpec().arguments(value=value)
    _calls.step(AddSpec(), {"tensors": tensors}, table_mode=table_mode, stream=stream,
                value=value)


def zero_(tensors, *, stream=None, table_mode=None) -> None:
    """Sets every element of a list to zero, in one launch per (device, dtype) group."""
    _calls.step(ZeroSpec(), {"tensors": tensors}, table_mode=table_mode, stream=stream)
