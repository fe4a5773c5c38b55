"""The ops the benchmark times, each a module with the same names: NAME, DESCRIPTION (the
"op:" header line), BYTES_PER_PARAM (the floor's numerator), REFERENCE (the competitor every
row is divided by), DEFAULT_WORKLOADS, TARGETS (workload -> (metric, limit) for mtapply's
rows, or a tuple of such pairs where a workload has several targets), make_data(shapes, device,
seed) and COMPETITORS (name -> Competitor); twins8bit makes several such ops from a table.

An op whose data can be other than fp32 also has DTYPES (the workload `Dtypes` its make_data takes
as a fourth argument) and bytes_per_param(dtypes) (the floor's numerator for them); the others run
fp32 workloads only. A new op adds such a module and one entry here.
"""
from __future__ import annotations

from . import (adafactor, adam, adam8bit, adam_groups, clipped, lars, lion, lion8bit, muon,
               prodigy, sgd, twins8bit)
from .workloads import FP32, dtypes

OPS = {op.NAME: op for op in (adam, sgd, lars, lion, adam8bit, adam_groups, lion8bit,
                                *twins8bit.OPS, clipped, prodigy, muon, adafactor)}


def all_competitors() -> list:
    """Every competitor name of any op, each once, in the ops' order."""
    return list(dict.fromkeys(name for op in OPS.values() for name in op.COMPETITORS))


def target_pairs(op) -> dict:
    """workload -> [(metric, limit), ...]: `op.TARGETS` with each single pair made a list."""
    return {workload: [targets] if isinstance(targets[0], str) else list(targets)
            for workload, targets in op.TARGETS.items()}


def accepts(op, workload: str) -> bool:
    """Whether `op` can make data in `workload`'s dtypes."""
    return dtypes(workload) in getattr(op, "DTYPES", (FP32,))


def runs_on(op, competitor: str, workload: str) -> bool:
    """Whether `competitor` of `op` has a row on `workload`: a mixed-precision-only one would
    repeat another row on an fp32 workload."""
    entry = op.COMPETITORS[competitor]
    if entry.fp32_only and dtypes(workload) != FP32:
        return False
    return not entry.mixed_only or dtypes(workload) != FP32


def bytes_per_param(op, workload: str) -> int:
    """The floor's numerator for `op` on `workload`."""
    kind = dtypes(workload)
    return op.BYTES_PER_PARAM if kind == FP32 else op.bytes_per_param(kind)


def make_data(op, workload: str, shapes, device, seed: int):
    """`op`'s random initial data for `workload`, in its dtypes."""
    kind = dtypes(workload)
    if kind == FP32:
        return op.make_data(shapes, device, seed)
    return op.make_data(shapes, device, seed, kind)
