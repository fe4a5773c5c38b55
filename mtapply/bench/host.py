"""Host cost of `mtapply.torch` optimizer steps: `python -m mtapply.bench.host`.

Times `optimizer.step()` wall clock at 10,000 params (small 1-D tensors, so the GPU is never the
bottleneck), beside torch.optim.AdamW(fused=True): with grads kept in place
(`zero_grad(set_to_none=False)`), and with grads reallocated before every step, as autograd
does after the default `zero_grad()`. The reallocation itself is not timed, only `step()`.
With `flat_grads=True` the step is timed at 1,000, 10,000 and 100,000 params, and called from a
`torch.compile`d function; and with one param group per tensor (each its own lr and decay, as
`--op adam-groups` makes them) for the tensor lists of gpt2-124M and resnet152, steady and with
every group's lr set before each step as a scheduler does (the setting is not timed). The
flat_grads rows run in interleaved rounds (one order, then the reverse), each row the median of
its rounds' medians, so that the host's load moves them all alike.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _params(torch, n: int, size: int):
    return [torch.nn.Parameter(torch.randn(size, device="cuda")) for _ in range(n)]


def _time_steps(torch, opt, params, steps: int, reallocate: bool, before=None) -> float:
    """Median wall microseconds of `opt.step()` (the GPU is synchronised outside the timing,
    where `before()` runs too)."""
    times = []
    pool = [[torch.randn_like(p) for p in params] for _ in range(2)]
    for p, g in zip(params, pool[0]):
        p.grad = g
    for k in range(steps):
        if reallocate:
            for p, g in zip(params, pool[k % 2]):
                p.grad = g
        if before is not None:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return float(np.median(times[3:])) * 1e6


def _time_flat_steps(torch, opt, params, steps: int, step=None, before=None) -> float:
    """Like `_time_steps` for flat_grads. Before each step, outside the timing, the grads are
    zeroed and one view is written in place, which marks the flat buffer written as backward
    does (writing all n views, e.g. with a foreach op, would leave the host's caches cold for
    the step: a cost of that op, not of the step)."""
    step = step or opt.step
    opt.zero_grad()  # the grads' views are made here
    grad = params[0].grad
    times = []
    for _ in range(steps):
        opt.zero_grad()
        grad.add_(1e-3)
        if before is not None:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return float(np.median(times[3:])) * 1e6


def _group_rows(torch, mt, steps: int) -> tuple:
    """Host time of a step over one group per tensor, gpt2-124M's and resnet152's lists of
    tensors (at 256 elements each): torch's fused AdamW's rows, and mtapply's flat_grads cases
    for `_interleaved`."""
    from .adam_groups import groups
    from .workloads import EXPECTED

    rows, flat = [], []
    for workload in ("gpt2-124M", "resnet152"):
        n = EXPECTED[workload][0]
        for scheduled in (False, True):
            suffix = f"[{n} groups{', each lr set' if scheduled else ''}]"
            params = _params(torch, n, 256)
            opt = torch.optim.AdamW(groups(params), fused=True)
            before = _lr_decay(opt) if scheduled else None
            rows.append((f"torch.optim.AdamW(fused) {suffix}", "in place",
                         _time_steps(torch, opt, params, steps, False, before), n))
            params = _params(torch, n, 256)
            opt = mt.AdamW(groups(params), flat_grads=True)
            flat.append((f"mtapply.torch.AdamW(flat_grads=True) {suffix}", n, opt, params, None,
                         _lr_decay(opt) if scheduled else None))
    return rows, flat


def _interleaved(torch, cases: list, steps: int, rounds: int) -> list:
    """The flat_grads cases timed in rounds, in one order and then the reverse; each row the
    median of its rounds' medians."""
    times = {k: [] for k in range(len(cases))}
    for r in range(rounds):
        order = range(len(cases)) if r % 2 == 0 else reversed(range(len(cases)))
        for k in order:
            _, _, opt, params, step, before = cases[k]
            times[k].append(_time_flat_steps(torch, opt, params, steps, step, before))
    return [(label, "in place", float(np.median(times[k])), n)
            for k, (label, n, *_) in enumerate(cases)]


def _repeat_parts(torch, case) -> str:
    """Where a repeated flat_grads step's host time goes (the case's optimizer, stepped)."""
    label, _, opt, params, _, _ = case
    latest = opt._latest
    if latest is None:
        return f"{label}: the latest step is not repeated"
    (_, part), repeat = latest.parts[0], latest.repeats[0]

    def median_us(fn) -> float:
        times = []
        for _ in range(200):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        return float(np.median(times)) * 1e6

    parts = {"flat buffers' checks": lambda: opt._flat._check_some(opt.param_groups),
             "kernel launch (counts the step too)": repeat.launch,
             "stream check": lambda: repeat.current(part.plan)}
    return (f"parts of a repeated step, {label} (median us): "
            + ", ".join(f"{name} {median_us(fn):.1f}" for name, fn in parts.items()))


def _lr_decay(opt):
    """What a scheduler does before a step: a new lr in every group."""
    def decay() -> None:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.999
    return decay


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--flat-steps", type=int, default=100,
                        help="steps per round of each flat_grads row")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    import torch

    import mtapply.torch as mt

    rows = []
    for name, make in (("mtapply.torch.AdamW", lambda ps: mt.AdamW(ps, lr=1e-3)),
                       ("torch.optim.AdamW(fused)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))):
        for reallocate in (False, True):
            params = _params(torch, args.params, args.size)
            opt = make(params)
            us = _time_steps(torch, opt, params, args.steps, reallocate)
            rows.append((f"{name} [{args.params} params]", "reallocated" if reallocate else "in place", us))
    flat = []  # (label, n, optimizer, params, step, before): timed in interleaved rounds
    for n in (1_000, args.params, 100_000):
        params = _params(torch, n, args.size)
        opt = mt.AdamW(params, lr=1e-3, flat_grads=True)
        flat.append((f"mtapply.torch.AdamW(flat_grads=True) [{n} params]", n, opt, params, None,
                     None))
    params = _params(torch, args.params, args.size)
    opt = mt.AdamW(params, lr=1e-3, flat_grads=True)
    flat.append(("same, step() in torch.compile", args.params, opt, params,
                 torch.compile(lambda: opt.step()), None))
    group_rows, group_flat = _group_rows(torch, mt, args.steps)
    flat += group_flat
    rows += _interleaved(torch, flat, args.flat_steps, args.rounds) + group_rows
    print(f"optimizer.step() wall time, params of {args.size} elements (median us)")
    for name, grads, us, *n in rows:
        n = n[0] if n else args.params
        print(f"  {name:52s} grads {grads:11s} {us:10.1f} us  ({us / n * 1e3:.1f} ns/param)")
    print(_repeat_parts(torch, group_flat[0]))


if __name__ == "__main__":
    main()
