"""The ops the benchmark times, each a module with the same names: NAME, DESCRIPTION (the
"op:" header line), BYTES_PER_PARAM (the floor's numerator), REFERENCE (the competitor every
row is divided by), DEFAULT_WORKLOADS, TARGETS (workload -> (metric, limit) for mtapply's
rows, or a tuple of such pairs where a workload has several targets), make_data(shapes, device,
seed) and COMPETITORS (name -> Competitor).

A new op adds such a module and one entry here.
"""
from __future__ import annotations

from . import adam, lars, sgd

OPS = {op.NAME: op for op in (adam, sgd, lars)}


def all_competitors() -> list:
    """Every competitor name of any op, each once, in the ops' order."""
    return list(dict.fromkeys(name for op in OPS.values() for name in op.COMPETITORS))


def target_pairs(op) -> dict:
    """workload -> [(metric, limit), ...]: `op.TARGETS` with each single pair made a list."""
    return {workload: [targets] if isinstance(targets[0], str) else list(targets)
            for workload, targets in op.TARGETS.items()}
