"""Helpers of the tests that run several CPU processes (gloo) or one-rank process groups."""
import os
import sys


def needs_gloo():
    """torch.distributed; skips the test where it or its gloo backend is not available."""
    import pytest

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return dist


def end_worker(report_path: str, said) -> None:
    """A torchrun worker's end: its report written (unless `said` is None), every rank waited
    for, the process group ended and the process left at once (gloo's threads may abort a
    normal shutdown: see examples/distributed_torch.py)."""
    import torch.distributed as dist

    if said is not None:
        with open(report_path, "w") as report:
            report.write(said)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
