"""Newton-Schulz's products in `mtapply.torch.Muon`, each timed alone, against a dense bfloat16
matmul on the same GPU: what share of the GPU's matmul throughput each product reaches.

    python -m mtapply.bench.products [--workloads gpt2-hidden matrices400] [--dense 8192]

For each shape of a workload, the matrices of that shape make one batch (as the optimizer
batches them) and one iteration's three products are timed in turn: G = X X^T (the short side's
Gram matrix), G' = b G + c G G and the X update a X + G' X (one cuBLASLt product on CUDA). A
product's TFLOPS count its multiply-adds twice; the dense row is one square bfloat16 matmul of
`--dense` rows. Where several shapes share their short side, one more row times b G + c G G
over all of their Gram matrices in one batch. On the CPU (no CUDA) it runs in wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from .workloads import WORKLOADS

PRODUCTS = ("gram", "gram_polynomial", "x_update")
COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's


def shape_groups(shapes) -> dict:
    """(rows, cols) -> how many matrices of the list have that shape, in first-seen order."""
    groups: dict = {}
    for shape in shapes:
        groups[tuple(shape)] = groups.get(tuple(shape), 0) + 1
    return groups


def product_flops(product: str, count: int, rows: int, cols: int) -> int:
    """Floating-point operations of one product over a batch of `count` rows x cols matrices
    (short side m, long side n): G is m x m from an m x n operand, G G is m x m by m x m, and the
    update takes m x m by m x n."""
    m, n = min(rows, cols), max(rows, cols)
    if product == "gram_polynomial":
        return 2 * count * m ** 3
    return 2 * count * m * m * n


def _batch(count: int, rows: int, cols: int, device):
    import torch

    from ..torch_muon import _Batch, _Grams

    params = [torch.empty((rows, cols), device=device) for _ in range(count)]
    batch = _Batch(params)
    _Grams.join([batch])  # its own Gram matrices
    batch.updates.copy_(torch.randn(batch.updates.shape, device=device))
    batch.updates.div_(torch.linalg.vector_norm(batch.updates, dim=(1, 2), keepdim=True))
    return batch


def _calls(batch) -> dict:
    """Each product of one iteration on the batch, as a call."""
    a, b, c = COEFFICIENTS
    x, y = batch.updates, batch.other
    batch.gram_of(x)
    batch.gram_polynomial(b, c)
    return {"gram": lambda: batch.gram_of(x),
            "gram_polynomial": lambda: batch.gram_polynomial(b, c),
            "x_update": lambda: batch.x_update(x, y, a)}


def time_call(call, device, repeats: int, steps: int) -> float:
    """Median seconds of one call: CUDA events on a GPU, the wall clock on the CPU."""
    import torch

    for _ in range(3):
        call()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(steps):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / steps)
        else:
            begin = time.perf_counter()
            for _ in range(steps):
                call()
            samples.append((time.perf_counter() - begin) / steps)
    return statistics.median(samples)


def dense_row(size: int, device, repeats: int, steps: int) -> dict:
    """One square bfloat16 matmul of `size` rows: the throughput the products are held to."""
    import torch

    x = torch.randn((size, size), device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    seconds = time_call(lambda: torch.matmul(x, x, out=out), device, repeats, steps)
    return {"product": "dense", "shape": [size, size, size], "seconds": seconds,
            "tflops": 2 * size ** 3 / seconds / 1e12}


def product_rows(shapes, device, repeats: int, steps: int) -> list:
    """A row per shape and product: its count, time and TFLOPS."""
    rows = []
    for (r, c), count in shape_groups(shapes).items():
        batch = _batch(count, r, c, device)
        for product, call in _calls(batch).items():
            seconds = time_call(call, device, repeats, steps)
            flops = product_flops(product, count, r, c)
            rows.append({"product": product, "shape": [count, r, c], "seconds": seconds,
                         "tflops": flops / seconds / 1e12})
    return rows


def joined_rows(shapes, device, repeats: int, steps: int) -> list:
    """For each short side shared by several shapes, b G + c G G over all their Gram matrices in
    one product (a row "gram_polynomial (joined)"), as the optimizer runs it (`_Grams.join`):
    against the per-shape rows, what joining them gains."""
    from ..torch_muon import _Grams

    sides: dict = {}
    for (r, c), count in shape_groups(shapes).items():
        sides.setdefault(min(r, c), []).append((count, r, c))
    _, b, c = COEFFICIENTS
    rows = []
    for side, groups in sides.items():
        if len(groups) < 2:
            continue
        batches = [_batch(*group, device) for group in groups]
        grams = _Grams.join(batches)
        for batch in batches:
            batch.gram_of(batch.updates)
        seconds = time_call(lambda: grams.polynomial(b, c), device, repeats, steps)
        total = grams.gram.shape[0]
        rows.append({"product": "gram_polynomial (joined)", "shape": [total, side, side],
                     "seconds": seconds, "tflops": 2 * total * side ** 3 / seconds / 1e12})
    return rows


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(prog="python -m mtapply.bench.products", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["gpt2-hidden", "matrices400"],
                        choices=["gpt2-hidden", "matrices400"])
    parser.add_argument("--dense", type=int, default=8192, help="rows of the dense matmul")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="calls per timed repeat")
    parser.add_argument("--json", default="products_results.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense = dense_row(args.dense, device, args.repeats, args.steps)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dense": dense, "workloads": {}}
    print(f"dense bf16 matmul {args.dense}^3: {dense['tflops']:.0f} TFLOPS")
    for name in args.workloads:
        shapes = WORKLOADS[name]()
        rows = (product_rows(shapes, device, args.repeats, args.steps)
                + joined_rows(shapes, device, args.repeats, args.steps))
        results["workloads"][name] = rows
        for row in rows:
            share = row["tflops"] / dense["tflops"]
            print(f"{name:<12} {'x'.join(map(str, row['shape'])):<16} {row['product']:<16} "
                  f"{row['seconds'] * 1e6:9.1f} us {row['tflops']:7.0f} TFLOPS {share:6.1%} of dense")
    with open(args.json, "w") as out:
        json.dump(results, out, indent=1)
    return results


if __name__ == "__main__":
    main()
