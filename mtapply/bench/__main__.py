"""python -m mtapply.bench: see `--help`. Prints a table and writes every number to JSON."""
from __future__ import annotations

import argparse
import datetime
import platform
import sys

from .ops import (OPS, accepts, all_competitors, bytes_per_param, make_data, runs_on,
                  target_pairs)
from .workloads import EXPECTED, FP32, WORKLOADS, count_params, dtypes


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.list:
        print(_listing())
        return 0
    torch = _require_cuda()
    from . import harness, report  # these import torch

    device = _cuda_device(torch, args.device)
    torch.cuda.set_device(device)  # CUDA events and torch's current stream follow this device
    results = _environment(torch, device, args)
    print(_header_text(results), flush=True)
    bandwidth = harness.copy_bandwidth(device)
    results["copy_bandwidth"] = bandwidth
    print(f"copy bandwidth: {bandwidth['GBps']:.0f} GB/s (1 GiB device-to-device copy, "
          f"read + written, median of {len(bandwidth['samples_ms'])})\n", flush=True)
    budget = harness.Budget(warmup=args.warmup, repeats=args.repeats, repeat_s=args.repeat_seconds,
                            min_steps=args.min_steps, row_s=args.max_row_seconds)
    for run in args.runs:
        op = OPS[run["op"]]
        for name in run["workloads"]:
            info, rows = _run_workload(op, name, run["competitors"], device, budget,
                                       bandwidth["GBps"], args.seed)
            results["workloads"].append(info)
            results["rows"].extend(rows)
            report.add_ratios(results["rows"], OPS)
            report.write_json(args.json, results)  # per workload: a cut-off run keeps its rows
    print()
    print(report.format_table(results["rows"], OPS))
    print()
    print(report.format_summary(results["rows"]))
    print(f"\nresults written to {args.json}")
    return 0


def _run_workload(op, name, competitors, device, budget, bandwidth_gbps, seed):
    """(workload info, rows): every selected competitor of `op` that runs on the workload, on its
    own copy of the same data, against the floor of `op`'s bytes per parameter in the workload's
    dtypes."""
    from .harness import free_memory

    shapes = WORKLOADS[name]()
    n_params = count_params(shapes)
    moved = bytes_per_param(op, name)
    floor_ms = moved * n_params / (bandwidth_gbps * 1e9) * 1e3
    info = {"op": op.NAME, "name": name, "n_tensors": len(shapes), "n_params": n_params,
            "dtypes": dtypes(name).text(), "bytes_per_param": moved, "floor_ms": floor_ms}
    _progress(f"{op.NAME} {name}: {len(shapes):,} tensors, {n_params:,} params, "
              f"{info['dtypes']}, floor {floor_ms:.4g} ms ({moved} B/param)")
    initial = make_data(op, name, shapes, device, seed)
    rows = [_run_competitor(op, info, competitor, initial, budget) for competitor in competitors
            if runs_on(op, competitor, name)]
    del initial
    free_memory()
    return info, rows


def _run_competitor(op, info: dict, competitor: str, initial, budget) -> dict:
    from . import harness, report

    stepper = None
    try:
        stepper = op.COMPETITORS[competitor].build(initial.clone())
        timing = harness.measure(stepper.step, budget, stepper.sync)
        row = report.timing_row(info, competitor, timing, stepper.moves, stepper.note,
                                stepper.first_call_s)
        _progress(f"  {competitor:<18} {_progress_times(row)}  "
                  f"({row['steps']} steps x {row['repeats']})")
    except Exception as error:  # one competitor failing (no managed memory, OOM) ends only its row
        row = report.error_row(info, competitor, error)
        _progress(f"  {competitor:<18} skipped: {row['error']}")
    stepper = None  # drop tensors, optimizer and graph before the next competitor allocates
    harness.free_memory()
    return row


def _progress_times(row: dict) -> str:
    if row["gpu_ms"] is None:  # timed by wall clock alone
        return (f"GPU n/a  wall {row['wall_ms']:.4g} ms  "
                f"x floor (wall) {row['x_floor_wall']:.3f}")
    return (f"GPU {row['gpu_ms']:.4g} ms  wall {row['wall_ms']:.4g} ms  "
            f"x floor {row['x_floor']:.3f}")


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mtapply.bench",
        description="Benchmark mtapply's fused optimizer steps (Adam in fp32 and in bf16 with "
                    "fp32 master weights, SGD with momentum, LARS) against their peers "
                    "(torch.optim, a PyTorch loop, optax) on a CUDA GPU. Reports GPU and wall ms "
                    "per step, x the byte floor (the bytes per param mtapply's step moves over "
                    "the measured copy bandwidth: Adam 28, SGD 20, LARS 20) and x the op's "
                    "reference peer (torch's fused step; for LARS the PyTorch loop). Needs "
                    "PyTorch with CUDA. --list shows each op's workloads and competitors.")
    parser.add_argument("--op", choices=[*OPS, "all"], default="all",
                        help="op to benchmark (default: %(default)s)")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help="workloads to run for each op (default: each op's own, see --list): "
                             f"{', '.join(WORKLOADS)}")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="competitors to run (default: all); an op runs those it has: "
                             f"{', '.join(all_competitors())}")
    parser.add_argument("--json", default="bench_results.json", metavar="PATH",
                        help="where to write all results as JSON (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repeats per row, median reported (default: %(default)s)")
    parser.add_argument("--repeat-seconds", type=float, default=0.3, metavar="S",
                        help="target length of one repeat (default: %(default)s)")
    parser.add_argument("--min-steps", type=int, default=20,
                        help="least steps per repeat, unless the row budget forbids "
                             "(default: %(default)s)")
    parser.add_argument("--max-row-seconds", type=float, default=6.0, metavar="S",
                        help="time budget of one row's repeats; slow competitors get fewer steps "
                             "(default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps first (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random data (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="CUDA device (default: %(default)s)")
    parser.add_argument("--list", action="store_true",
                        help="list workloads, ops and their competitors, then exit")
    args = parser.parse_args(argv)
    if min(args.repeats, args.warmup, args.min_steps) < 1:
        parser.error("--repeats, --warmup and --min-steps must be at least 1")
    args.runs = _runs(parser, args)
    return args


def _runs(parser, args) -> list:
    """{'op', 'workloads', 'competitors'} for each chosen op with a chosen competitor that runs
    on one of its chosen workloads (an fp32-only op skips mixed-precision workloads)."""
    workloads = None if args.workloads is None else _selected(parser, "--workloads",
                                                               args.workloads, WORKLOADS)
    only = None if args.only is None else _selected(parser, "--only", args.only,
                                                    all_competitors())
    runs = []
    for name in OPS if args.op == "all" else [args.op]:
        op = OPS[name]
        competitors = [c for c in op.COMPETITORS if only is None or c in only]
        chosen = [w for w in workloads or op.DEFAULT_WORKLOADS if accepts(op, w)
                  and any(runs_on(op, c, w) for c in competitors)]
        if chosen:
            runs.append({"op": name, "workloads": chosen, "competitors": competitors})
    if not runs:
        among = f" among --only {' '.join(only)}" if only else ""
        on = f"--workloads {' '.join(workloads)}" if workloads else "its default workloads"
        parser.error(f"nothing to run: no competitor of --op {args.op}{among} runs on {on} "
                     f"(see --list)")
    return runs


def _selected(parser, option: str, values: list, known) -> list:
    """Names given with spaces or commas, checked, in the registry's order."""
    names = {name for value in values for name in value.split(",") if name}
    unknown = sorted(names - set(known))
    if unknown or not names:
        problem = f"unknown {', '.join(unknown)}" if unknown else "no name given"
        parser.error(f"{option}: {problem}; choose from {', '.join(known)}")
    return [name for name in known if name in names]


def _require_cuda():
    """torch, or exit with a message saying what is missing."""
    try:
        import torch
    except ImportError:
        sys.exit("mtapply.bench needs PyTorch with CUDA (the competitors and the timers are "
                 "torch's): install torch, e.g. `pip install torch`")
    if not torch.cuda.is_available():
        sys.exit(f"mtapply.bench needs a CUDA GPU, and torch {torch.__version__} sees none "
                 f"(torch.cuda.is_available() is False)")
    return torch


def _cuda_device(torch, name: str):
    """`name` as a torch.device with an index (torch.cuda.set_device refuses a bare 'cuda')."""
    device = torch.device(name)
    if device.type != "cuda":
        sys.exit(f"--device {name}: mtapply.bench times CUDA devices only")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _environment(torch, device, args) -> dict:
    import cupy

    import mtapply

    props = torch.cuda.get_device_properties(device)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "device_memory_GiB": props.total_memory / 2**30, "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cupy": cupy.__version__,
            "mtapply": mtapply.__version__, "ops": {run["op"]: _op_info(OPS[run["op"]])
                                                    for run in args.runs},
            "settings": {k: v for k, v in vars(args).items() if k != "list"},
            "workloads": [], "rows": []}


def _op_info(op) -> dict:
    return {"description": op.DESCRIPTION, "bytes_per_param": op.BYTES_PER_PARAM,
            "reference": op.REFERENCE,
            "targets": {name: _targets_info(pairs) for name, pairs in target_pairs(op).items()}}


def _targets_info(pairs: list):
    """{'metric', 'limit'} for a workload's one target, a list of them for several."""
    info = [{"metric": metric, "limit": limit} for metric, limit in pairs]
    return info[0] if len(info) == 1 else info


def _header_text(results: dict) -> str:
    return (f"mtapply.bench  {results['date']}\n"
            f"device: {results['device']} (sm {results['compute_capability']}, "
            f"{results['device_memory_GiB']:.0f} GiB)\n"
            f"torch {results['torch']} (CUDA {results['torch_cuda']}), cupy {results['cupy']}, "
            f"mtapply {results['mtapply']}, python {results['python']}\n"
            + "\n".join(f"op: {op['description']}; floor = {op['bytes_per_param']} B/param / "
                        f"copy bandwidth" for op in results["ops"].values()))


def _listing() -> str:
    lines = ["workloads:"]
    width = max(map(len, WORKLOADS))
    lines += [f"  {name:<{width}} {tensors:>6,} tensors {params:>13,} params  {dtypes(name).text()}"
              for name, (tensors, params) in EXPECTED.items() if name in WORKLOADS]
    for name, op in OPS.items():
        targets = ", ".join(f"{workload} {metric} <= {limit:g}"
                            for workload, pairs in target_pairs(op).items()
                            for metric, limit in pairs)
        lines += [f"op {name}: {op.DESCRIPTION}",
                  f"  floor {_floors(op)}; ratios over {op.REFERENCE}",
                  f"  default workloads: {', '.join(op.DEFAULT_WORKLOADS)}",
                  f"  targets (mtapply): {targets}", "  competitors:"]
        lines += [f"    {competitor:<18} {entry.description}"
                  + (" (mixed-precision workloads only)" if entry.mixed_only else "")
                  for competitor, entry in op.COMPETITORS.items()]
    return "\n".join(lines)


def _floors(op) -> str:
    """The op's floor in bytes per param: fp32's, then each mixed-precision workload's it runs."""
    mixed = [f"{name} {bytes_per_param(op, name)}" for name in WORKLOADS
             if dtypes(name) != FP32 and accepts(op, name)]
    if not mixed:
        return f"{op.BYTES_PER_PARAM} B/param (fp32 workloads only)"
    return f"{op.BYTES_PER_PARAM} B/param (fp32), {', '.join(mixed)} B/param"


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
