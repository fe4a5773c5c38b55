"""CPU cost of `mtapply.torch` optimizer steps: `python -m mtapply.bench.cpu`.

Times `optimizer.step()` wall clock on CPU tensors (fp32 params, grads kept in place) at two
shapes of list, many large tensors (100 of 256x256) and many small ones (1000 of 32), for
mtapply.torch's AdamW, SGD (momentum 0.9), Lion and AdamW8bit beside torch.optim's AdamW and
SGD, foreach (torch's default on lists of tensors) and for-loop. torch has no Lion: its peer is
the same update in torch's foreach ops (as `mtapply.bench.lion` writes it); AdamW8bit's peer is
bitsandbytes' AdamW8bit where it is installed, and torch's foreach AdamW otherwise. The rows run
in interleaved rounds (one order, then the reverse), each row the median of its rounds' medians,
so that the host's load moves them all alike; each ratio is the row's time over its peer's.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

CASES = {"100x256x256": (100, (256, 256)), "1000x32": (1000, (32,))}
LR, BETAS, WEIGHT_DECAY, MOMENTUM = 1e-3, (0.9, 0.999), 1e-2, 0.9


def _lion_foreach(torch, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1):
    """Lion in torch's foreach ops (lion-pytorch's update), a `step()` with the state kept here."""
    moments = [torch.zeros_like(p) for p in params]
    beta1, beta2 = betas

    @torch.no_grad()
    def step():
        grads = [p.grad for p in params]
        torch._foreach_mul_(params, 1 - lr * weight_decay)
        update = torch._foreach_mul(moments, beta1)
        torch._foreach_add_(update, grads, alpha=1 - beta1)
        torch._foreach_sign_(update)
        torch._foreach_add_(params, update, alpha=-lr)
        torch._foreach_mul_(moments, beta2)
        torch._foreach_add_(moments, grads, alpha=1 - beta2)

    return step


def _bitsandbytes():
    try:
        import bitsandbytes
    except Exception:  # noqa: BLE001 - absent, or present without a usable CPU backend
        return None
    return bitsandbytes


def competitors(torch) -> dict:
    """Row name -> (peer row name, maker of a step function from a list of params)."""
    import mtapply.torch as mt

    def opt(make):
        return lambda params: make(params).step

    rows = {
        "torch AdamW foreach": (None, opt(lambda ps: torch.optim.AdamW(
            ps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True))),
        "torch AdamW forloop": ("torch AdamW foreach", opt(lambda ps: torch.optim.AdamW(
            ps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=False))),
        "mtapply AdamW": ("torch AdamW foreach", opt(lambda ps: mt.AdamW(
            ps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY))),
        "torch SGD foreach": (None, opt(lambda ps: torch.optim.SGD(
            ps, lr=LR, momentum=MOMENTUM, foreach=True))),
        "torch SGD forloop": ("torch SGD foreach", opt(lambda ps: torch.optim.SGD(
            ps, lr=LR, momentum=MOMENTUM, foreach=False))),
        "mtapply SGD": ("torch SGD foreach", opt(lambda ps: mt.SGD(ps, lr=LR, momentum=MOMENTUM))),
        "torch Lion foreach": (None, lambda ps: _lion_foreach(torch, ps)),
        "mtapply Lion": ("torch Lion foreach", opt(lambda ps: mt.Lion(
            ps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1))),
    }
    bnb = _bitsandbytes()
    peer = "torch AdamW foreach"
    if bnb is not None:
        peer = "bitsandbytes AdamW8bit"
        rows[peer] = (None, opt(lambda ps: bnb.optim.AdamW8bit(ps, lr=LR, betas=BETAS,
                                                               weight_decay=WEIGHT_DECAY)))
    rows["mtapply AdamW8bit"] = (peer, opt(lambda ps: mt.AdamW8bit(
        ps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)))
    return rows


def _params(torch, n: int, shape: tuple, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(shape, generator=gen) * 1e-2
    return params


def _time(step, steps: int) -> float:
    """Median wall milliseconds of `step()`."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def measure(torch, names=None, cases=None, steps: int = 20, rounds: int = 4,
            warmup: int = 3) -> list:
    """(case, row, peer, median ms) of each row and case, timed in interleaved rounds."""
    table = competitors(torch)
    names = list(table) if names is None else list(names)
    out = []
    for case in (CASES if cases is None else cases):
        n, shape = CASES[case] if isinstance(case, str) else case
        label = case if isinstance(case, str) else f"{n}x{'x'.join(map(str, shape))}"
        stepped = []
        for name in names:
            step = table[name][1](_params(torch, n, shape))
            for _ in range(warmup):  # the state made, the plans bound
                step()
            stepped.append(step)
        times = {name: [] for name in names}
        for r in range(rounds):
            order = range(len(names)) if r % 2 == 0 else reversed(range(len(names)))
            for k in order:
                times[names[k]].append(_time(stepped[k], steps))
        out += [(label, name, table[name][0], float(np.median(times[name]))) for name in names]
    return out


def format_rows(rows: list) -> str:
    medians = {(case, name): ms for case, name, _, ms in rows}
    lines = [f"  {'case':12s} {'row':24s} {'median ms':>10s}  ratio to peer"]
    for case, name, peer, ms in rows:
        ratio = (f"{ms / medians[case, peer]:5.2f}x {peer}" if (case, peer) in medians else "")
        lines.append(f"  {case:12s} {name:24s} {ms:10.2f}  {ratio}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), help="default: both")
    args = parser.parse_args(argv)
    import torch

    from mtapply import _cpu

    rows = measure(torch, args.rows, args.cases, args.steps, args.rounds)
    print(f"optimizer.step() on CPU tensors, fp32, {torch.get_num_threads()} torch threads, "
          f"{_cpu._threads()} mtapply threads (median ms of {args.rounds} interleaved rounds of "
          f"{args.steps} steps)")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
