"""python -m mtapply.bench.galore: one GaLore AdamW step (between projector refreshes) with
mtapply against galore-torch (where installed) and full-rank torch fused AdamW, on the same
matrices and grads, with the byte floor and the optimizer-state memory.

Cases: one 4096 x 4096 matrix at ranks 32, 64 and 128, and GPT-2 124M's 2-D weights at rank
128. The floor is the bytes the step must move at the measured copy bandwidth: per m x n matrix
projected to r rows (or columns), the grad and the projector read for the projection, the
projection written, Adam on it (read R, m, v; write the step, m, v), and the back-projection
(projector and step read, the param read and written): 4 * (3mn + 2(m + n)r + 8 r max(m, n))
bytes for fp32, counting the longer side's r-wide products.

Each case runs at torch's float32 matmul precision "highest" (float32 products) and "high"
(TF32 tensor cores), which every variant's matmuls follow (`--precision`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CASES = {"4096-r32": ([(4096, 4096)], 32), "4096-r64": ([(4096, 4096)], 64),
         "4096-r128": ([(4096, 4096)], 128), "gpt2-124M-r128": (None, 128)}


def shapes_of(case: str) -> tuple:
    shapes, rank = CASES[case]
    if shapes is None:
        from .workloads import WORKLOADS

        shapes = [s for s in WORKLOADS["gpt2-124M"]() if len(s) == 2]
    return shapes, rank


def floor_bytes(shapes, rank: int) -> int:
    return sum(4 * (3 * m * n + 2 * (m + n) * rank + 8 * rank * max(m, n)) for m, n in shapes)


def variants() -> dict:
    """name -> (params -> optimizer)."""
    import importlib.util

    import torch

    import mtapply.torch as mt

    made = {"mtapply": lambda groups: mt.GaLoreAdamW(groups, lr=1e-3, weight_decay=0.01),
            "torch-fused-full-rank": lambda groups: torch.optim.AdamW(
                [{"params": g["params"]} for g in groups], lr=1e-3, weight_decay=0.01,
                fused=groups[0]["params"][0].is_cuda)}
    if importlib.util.find_spec("galore_torch"):
        def galore_torch(groups):
            import galore_torch

            return galore_torch.GaLoreAdamW(groups, lr=1e-3, weight_decay=0.01)
        made["galore-torch"] = galore_torch
    return made


def state_bytes(optimizer) -> int:
    import torch

    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for k, v in s.items() if isinstance(v, torch.Tensor) and k != "step")


def time_variant(make, shapes, rank: int, device, steps: int, repeats: int) -> dict:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=generator) * 0.02)
              for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=generator)
    optimizer = make([{"params": params, "rank": rank, "update_proj_gap": 10**9, "scale": 0.25,
                       "proj_type": "std"}])
    for _ in range(3):  # the projector's SVD, then plans bound
        optimizer.step()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return {"ms": statistics.median(samples), "samples_ms": samples,
            "state_bytes": state_bytes(optimizer)}


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch

    device = torch.device(args.device)
    bandwidth = None
    if device.type == "cuda":
        from .harness import copy_bandwidth

        bandwidth = copy_bandwidth(device)["GBps"]
    rows = []
    saved = torch.get_float32_matmul_precision()
    for precision in args.precision:  # every variant's matmuls follow it
        torch.set_float32_matmul_precision(precision)
        for case in args.cases:
            shapes, rank = shapes_of(case)
            floor_ms = floor_bytes(shapes, rank) / bandwidth / 1e6 if bandwidth else None
            for name, make in variants().items():
                timing = time_variant(make, shapes, rank, device, args.steps, args.repeats)
                rows.append({"case": case, "precision": precision, "variant": name,
                             "floor_ms": floor_ms, **timing})
                print(f"{case} {precision} {name}: {timing['ms']:.3f} ms, "
                      f"state {timing['state_bytes'] / 2**20:.1f} MiB", flush=True)
    torch.set_float32_matmul_precision(saved)
    print(table(rows))
    with open(args.json, "w") as handle:
        json.dump({"device": str(device), "copy_GBps": bandwidth, "rows": rows}, handle, indent=1)
    print(f"results written to {args.json}")
    return 0


def table(rows: list) -> str:
    lines = [("| case | float32 matmul precision | variant | ms per step (wall) | x floor | "
              "x mtapply | state MiB |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    ours = {(row["case"], row["precision"]): row["ms"] for row in rows
            if row["variant"] == "mtapply"}
    for row in rows:
        floor = f"{row['ms'] / row['floor_ms']:.2f}" if row["floor_ms"] else "-"
        lines.append(f"| {row['case']} | {row['precision']} | {row['variant']} | {row['ms']:.3f} | "
                     f"{floor} | {row['ms'] / ours[(row['case'], row['precision'])]:.2f} | "
                     f"{row['state_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def _parse_args(argv):
    import torch

    parser = argparse.ArgumentParser(prog="python -m mtapply.bench.galore",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", nargs="+", choices=("highest", "high"),
                        default=["highest", "high"],
                        help="torch's float32 matmul precision (high: TF32 tensor cores)")
    parser.add_argument("--json", default="galore_results.json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
