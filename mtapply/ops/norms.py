"""L2 norms of a tensor list (per tensor and global), and clipping by the global norm."""
from __future__ import annotations

import numpy as np

from .. import _cpu
from ._spec import OpSpec, check_number


class L2NormSpec(OpSpec):
    """Per-tensor L2 norms into `norms_out` (caller's order, optional) and the global L2 norm
    of the whole list into `total_out`, in one launch per group. Sums of squares are fp32 for
    every storage type and are added in a fixed order: the result is deterministic."""

    name = "l2norm"
    kernel_file = "norms.cuh"
    functor = "mta::SumSquares"
    n_sums = 1
    slots = ("tensors",)
    written = frozenset()
    flags = ()
    arg_fields = ("norms_out", "total_out", "max_norm", "eps")
    single_device = True
    uniform_hyper = True

    def output_numel(self, name: str, n_tensors: int) -> int:
        return n_tensors if name == "norms_out" else 1

    def arguments(self, *, total_out, norms_out=None) -> dict:
        return {"norms_out": norms_out, "total_out": total_out, "max_norm": 0.0, "eps": 0.0}

    def cpu_run(self, refs: dict, args: dict, grad_scale: float) -> bool:
        squares = [float(np.sum(np.square(_cpu.load(ref, np.float64)))) for ref in refs["tensors"]]
        if args["norms_out"] is not None:
            _cpu.store(args["norms_out"].ref, np.sqrt(np.asarray(squares, np.float64)))
        total = np.float32(np.sqrt(np.sum(squares)))
        _cpu.store(args["total_out"].ref, np.asarray([total]))
        return True


class ClipGradNormSpec(L2NormSpec):
    """torch.nn.utils.clip_grad_norm_ on the device: the global L2 norm of the list, then every
    element times min(1, max_norm / (norm + eps)). Two launches per group; no host sync."""

    name = "clip_grad_norm"
    functors = ("mta::SumSquares", "mta::ClipScale")
    written = frozenset({"tensors"})

    def arguments(self, *, total_out, max_norm, eps=1e-6, norms_out=None) -> dict:
        return {"norms_out": norms_out, "total_out": total_out,
                "max_norm": check_number("max_norm", max_norm, low=0.0),
                "eps": check_number("eps", eps, low=0.0)}

    def cpu_run(self, refs: dict, args: dict, grad_scale: float) -> bool:
        super().cpu_run(refs, args, grad_scale)
        total = _cpu.load(args["total_out"].ref, np.float32)[0]
        coefficient = np.float32(args["max_norm"]) / (total + np.float32(args["eps"]))
        coefficient = np.float32(1.0) if coefficient > 1 else coefficient  # NaN stays NaN
        for ref in refs["tensors"]:
            if ref.numel:
                dtype = np.float64 if ref.dtype == "float64" else np.float32
                _cpu.store(ref, _cpu.load(ref, dtype) * dtype(coefficient))
        return True


__all__ = ["ClipGradNormSpec", "L2NormSpec"]
