"""Results: one row per (workload, competitor), ratios, targets, the printed table and JSON."""
from __future__ import annotations

import json

from .workloads import TARGETS

TARGET_COMPETITORS = ("mtapply", "mtapply-unified")  # rows the targets apply to
DEFAULT_MTAPPLY = "mtapply"


def timing_row(workload: dict, competitor: str, timing) -> dict:
    """A measured row: medians, samples, and ratios to the byte floor."""
    floor_ms = workload["floor_ms"]
    return {"workload": workload["name"], "competitor": competitor,
            "gpu_ms": timing.gpu_ms, "wall_ms": timing.wall_ms, "wall_us": timing.wall_ms * 1e3,
            "x_floor": timing.gpu_ms / floor_ms, "x_floor_wall": timing.wall_ms / floor_ms,
            "steps": timing.steps, "repeats": timing.repeats,
            "gpu_ms_samples": timing.gpu_ms_samples, "wall_ms_samples": timing.wall_ms_samples}


def error_row(workload: dict, competitor: str, error: BaseException) -> dict:
    return {"workload": workload["name"], "competitor": competitor,
            "error": f"{type(error).__name__}: {error}"}


def add_ratios(rows: list, reference: str) -> None:
    """Adds each row's target verdict and its times over the reference competitor's."""
    for row in rows:
        if "error" in row:
            continue
        target = _target(row)
        if target is not None:
            row["target"] = target
        ref = _find(rows, row["workload"], reference)
        if ref is not None and "error" not in ref:
            row[f"x_{_key(reference)}_gpu"] = row["gpu_ms"] / ref["gpu_ms"]
            row[f"x_{_key(reference)}_wall"] = row["wall_ms"] / ref["wall_ms"]


def format_table(rows: list, reference: str) -> str:
    header = ["workload", "competitor", "GPU ms/step", "wall ms/step", "wall us/step", "x floor",
              f"x {reference} (GPU)", f"x {reference} (wall)", "steps x reps", "target"]
    lines = [header] + [_table_cells(row, reference) for row in rows]
    widths = [max(len(line[k]) for line in lines) for k in range(len(header))]
    text = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(text)


def format_summary(rows: list) -> str:
    """The issue's targets for mtapply's default row, and which table mode is faster."""
    lines = [f"targets ({DEFAULT_MTAPPLY}, table_mode='memcpy'):"]
    for row in rows:
        if row["competitor"] == DEFAULT_MTAPPLY and "target" in row:
            lines.append(f"  {row['workload']:<10} {row['target']['text']}")
    unified = [(row, _find(rows, row["workload"], "mtapply-unified")) for row in rows
               if row["competitor"] == DEFAULT_MTAPPLY and "error" not in row]
    if any(other is not None and "error" not in other for _, other in unified):
        lines.append("table mode (unified time / memcpy time; < 1 means unified is faster):")
        for row, other in unified:
            if other is not None and "error" not in other:
                lines.append(f"  {row['workload']:<10} GPU {other['gpu_ms'] / row['gpu_ms']:.3f}"
                             f"  wall {other['wall_ms'] / row['wall_ms']:.3f}")
    return "\n".join(lines)


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def _target(row: dict):
    """{'metric', 'limit', 'value', 'met', 'text'} for rows the issue sets a target on."""
    if row["competitor"] not in TARGET_COMPETITORS or row["workload"] not in TARGETS:
        return None
    metric, limit = TARGETS[row["workload"]]
    value = row[metric]
    met = value <= limit
    unit = "x floor" if metric == "x_floor" else " us wall/step"
    text = f"{'met' if met else 'MISSED'}: {value:.3f}{unit} (target <= {limit:g}{unit})"
    return {"metric": metric, "limit": limit, "value": value, "met": met, "text": text}


def _table_cells(row: dict, reference: str) -> list:
    head = [row["workload"], row["competitor"]]
    if "error" in row:
        return head + ["-"] * 7 + [f"skipped: {row['error']}"[:120]]
    ref = _key(reference)
    return head + [_time(row["gpu_ms"]), _time(row["wall_ms"]), _time(row["wall_us"]),
                   _ratio(row["x_floor"]), _ratio(row.get(f"x_{ref}_gpu")),
                   _ratio(row.get(f"x_{ref}_wall")), f"{row['steps']} x {row['repeats']}",
                   row["target"]["text"].split(":")[0] if "target" in row else ""]


def _time(value: float) -> str:
    return f"{value:.4g}" if value < 1000 else f"{value:.0f}"


def _ratio(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 100 else f"{value:.0f}"


def _find(rows: list, workload: str, competitor: str):
    return next((r for r in rows if r["workload"] == workload and r["competitor"] == competitor),
                None)


def _key(name: str) -> str:
    return name.replace("-", "_")
