"""The public norm entry points: per-tensor and global L2 norms, global-norm clipping."""
from __future__ import annotations

from . import _calls, _outputs
from ._dlpack import device_of, framework_of
from ._validate import check_lists
from .ops.norms import ClipGradNormSpec, L2NormSpec


def l2_norms(tensors, *, norms_out=None, total_out=None, stream=None, table_mode=None):
    """The L2 norm of each tensor and of the whole list, computed on the tensors' device.

    One launch per (device, dtype) group, no host synchronisation: the results stay on the
    device (read them when you need them). Sums of squares are fp32 and added in a fixed order,
    so the results are deterministic.

    Args:
        tensors: a list of tensors (torch, CuPy, NumPy, any DLPack producer) on one device.
        norms_out: optional float32 array of len(tensors) elements to write the norms into.
        total_out: optional one-element float32 array for the global norm.
        stream, table_mode: as for `mtapply.adam_plan`.

    Returns:
        (norms, total): the per-tensor norms and the one-element global norm, as arrays of the
        tensors' framework (the given outputs when passed). The global norm can be passed on as
        a device scalar, e.g. `lamb_step(..., global_grad_norm=total)`.
    """
    return _run(L2NormSpec(), tensors, {}, norms_out, total_out, stream, table_mode,
                want_norms=True)


def clip_grad_norm_(tensors, max_norm, *, eps=1e-6, norms_out=None, total_out=None, stream=None,
                    table_mode=None):
    """Scales a list of grads in place so that their global L2 norm is at most `max_norm`,
    as torch.nn.utils.clip_grad_norm_: every element times min(1, max_norm / (norm + eps)).

    Two launches per (device, dtype) group and no host synchronisation (torch's version may
    read the norm back). Returns the global norm before clipping as a one-element array of the
    tensors' framework (`total_out` when given); `norms_out` optionally receives the per-tensor
    norms before clipping.
    """
    hyper = {"max_norm": max_norm, "eps": eps}
    ClipGradNormSpec().arguments(total_out=None, **hyper)  # checks before anything is allocated
    return _run(ClipGradNormSpec(), tensors, hyper, norms_out, total_out, stream, table_mode)[1]


def _run(spec, tensors, hyper: dict, norms_out, total_out, stream, table_mode, want_norms=False):
    n = check_lists({"tensors": tensors})
    framework = framework_of(tensors[0]) if n else "numpy"
    device = device_of(tensors[0], "tensors[0]") if n else ("cpu", 0)
    if total_out is None:
        total_out = _outputs.new_float32(framework, device, 1)
    if norms_out is None and want_norms:
        norms_out = _outputs.new_float32(framework, device, n)
    plan = _calls.step(spec, {"tensors": tensors}, table_mode=table_mode, stream=stream,
                       total_out=total_out, norms_out=norms_out, **hyper)
    if plan.empty:  # nothing was launched
        for output in (total_out, norms_out):
            if output is not None:
                _outputs.fill_zero(output)
    return norms_out, total_out
