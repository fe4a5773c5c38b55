"""Measurement: the device's copy bandwidth (the floor's denominator) and step timing.

A step is timed two ways over the same back-to-back loop: CUDA events (GPU ms per step; for
host-bound runs this includes the GPU waiting on the host) and the wall clock between two
synchronizations (what the user's training loop pays, host overhead included). A step that runs
outside torch's streams (JAX) comes with its own wait and is timed by wall clock alone: its GPU
time is None.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch

COPY_ELEMENTS = 2**28  # 1 GiB of fp32


@dataclass
class Timing:
    """Medians over repeats, and every sample, of one competitor on one workload (GPU figures
    None for a step timed by wall clock alone)."""

    gpu_ms: float | None
    wall_ms: float
    steps: int
    repeats: int
    gpu_ms_samples: list | None
    wall_ms_samples: list


@dataclass
class Budget:
    """How long to measure: each repeat aims at `repeat_s` and at least `min_steps` steps,
    unless that would make the whole row exceed `row_s` (slow, host-bound competitors)."""

    warmup: int = 5
    repeats: int = 5
    repeat_s: float = 0.3
    min_steps: int = 20
    row_s: float = 6.0


def copy_bandwidth(device, samples: int = 10, warmup: int = 3) -> dict:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(COPY_ELEMENTS, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times_ms = []
    for _ in range(samples):
        start, end = _event_pair()
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    free_memory()
    median_ms = statistics.median(times_ms)
    return {"bytes_per_copy": moved, "median_ms": median_ms, "samples_ms": times_ms,
            "GBps": moved / median_ms / 1e6}


def measure(step, budget: Budget, sync=None) -> Timing:
    """Warms `step` up, sizes the loop from a probe, then times `budget.repeats` loops.

    `sync`, for a step outside torch's streams, waits for its work; such a step is timed by
    wall clock alone."""
    wait = sync or torch.cuda.synchronize
    for _ in range(budget.warmup):  # first steps compile kernels and fill caches
        step()
    wait()
    steps, repeats = _loop_size(_probe_seconds_per_step(step, wait), budget)
    if sync is not None:
        wall = [_wall_loop(step, steps, sync) for _ in range(repeats)]
        return Timing(None, statistics.median(wall), steps, repeats, None, wall)
    gpu, wall = zip(*(_timed_loop(step, steps) for _ in range(repeats)))
    return Timing(statistics.median(gpu), statistics.median(wall), steps, repeats,
                  list(gpu), list(wall))


def free_memory() -> None:
    """Returns freed tensors' memory to the device so the next workload starts clean."""
    gc.collect()  # optimizers and graphs can sit in reference cycles
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _probe_seconds_per_step(step, wait) -> float:
    """Wall seconds per step, from loops growing until one lasts long enough to trust."""
    count = 2
    while True:
        start = time.perf_counter()
        for _ in range(count):
            step()
        wait()
        elapsed = time.perf_counter() - start
        if elapsed >= 0.05 or count >= 4096:
            return elapsed / count
        count *= 4


def _loop_size(seconds_per_step: float, budget: Budget) -> tuple:
    """(steps per repeat, repeats) for this step time within `budget`."""
    steps = max(budget.min_steps, math.ceil(budget.repeat_s / seconds_per_step))
    repeats = budget.repeats
    if steps * repeats * seconds_per_step > budget.row_s:
        # A slow competitor: keep at least 3 repeats for a median, fewer steps in each.
        repeats = max(3, min(repeats, int(budget.row_s / (steps * seconds_per_step))))
        steps = max(5, min(steps, int(budget.row_s / (repeats * seconds_per_step))))
    return steps, repeats


def _timed_loop(step, steps: int) -> tuple:
    """(GPU ms per step, wall ms per step) over `steps` back-to-back steps."""
    start, end = _event_pair()
    torch.cuda.synchronize()
    wall_start = time.perf_counter()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall_start) * 1e3
    return start.elapsed_time(end) / steps, wall_ms / steps


def _wall_loop(step, steps: int, sync) -> float:
    """Wall ms per step over `steps` back-to-back steps, waiting with `sync` at both ends."""
    sync()
    wall_start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - wall_start) * 1e3 / steps


def _event_pair() -> tuple:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
