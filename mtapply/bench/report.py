"""Results: one row per (op, workload, competitor), ratios, targets, the printed table and JSON.

The functions that need an op's reference competitor or targets take `ops`, a mapping from op
name to its module (see `ops.py`).
"""
from __future__ import annotations

import json

from .ops import target_pairs

TARGET_COMPETITORS = ("mtapply", "mtapply-unified")  # rows the targets apply to
DEFAULT_MTAPPLY = "mtapply"


def timing_row(workload: dict, competitor: str, timing, moves=None, note=None,
               first_call_s=None) -> dict:
    """A measured row: medians, samples, and ratios to the op's byte floor. A row timed by wall
    clock alone has None for its GPU figures (n/a) and says so in "timed_by". `moves`: the bytes
    per param the competitor's step moves where that is not the floor's count (a peer with
    low-precision states); its row keeps x floor against the workload's floor, the one mtapply
    is held to, and adds x its own floor. `note`: what the reader must know about the row."""
    floor_ms = workload["floor_ms"]
    gpu_ms = timing.gpu_ms
    row = {"op": workload["op"], "workload": workload["name"], "competitor": competitor,
           "gpu_ms": gpu_ms, "wall_ms": timing.wall_ms, "wall_us": timing.wall_ms * 1e3,
           "x_floor": None if gpu_ms is None else gpu_ms / floor_ms,
           "x_floor_wall": timing.wall_ms / floor_ms,
           "steps": timing.steps, "repeats": timing.repeats,
           "gpu_ms_samples": timing.gpu_ms_samples, "wall_ms_samples": timing.wall_ms_samples}
    if gpu_ms is None:
        row["timed_by"] = ("wall clock only: the step runs on its own streams (JAX), which CUDA "
                           "events on torch's stream do not see; GPU ms n/a")
    if note:
        row["note"] = note
    if first_call_s is not None:
        row["first_call_s"] = first_call_s  # its first step: for JAX, tracing and compilation
    if moves is not None and moves != workload["bytes_per_param"]:
        own_floor_ms = floor_ms * moves / workload["bytes_per_param"]
        row.update(bytes_per_param=moves, own_floor_ms=own_floor_ms,
                   x_own_floor=None if gpu_ms is None else gpu_ms / own_floor_ms)
    return row


def error_row(workload: dict, competitor: str, error: BaseException) -> dict:
    return {"op": workload["op"], "workload": workload["name"], "competitor": competitor,
            "error": f"{type(error).__name__}: {error}"}


def add_ratios(rows: list, ops: dict) -> None:
    """Adds each row's times over its op's reference competitor's, then its target verdict
    (a target can be such a ratio)."""
    for row in rows:
        if "error" in row:
            continue
        reference = ops[row["op"]].REFERENCE
        ref = _find(rows, row, reference)
        if ref is not None and "error" not in ref:
            if row["gpu_ms"] is not None and ref["gpu_ms"] is not None:
                row[f"x_{_key(reference)}_gpu"] = row["gpu_ms"] / ref["gpu_ms"]
            row[f"x_{_key(reference)}_wall"] = row["wall_ms"] / ref["wall_ms"]
        target = _target(row, ops[row["op"]])
        if target is not None:
            row["target"] = target


def format_table(rows: list, ops: dict) -> str:
    """The table, then the rows' notes, each once, numbered as the competitors are marked."""
    label = _reference_label(rows, ops)
    notes = list(dict.fromkeys(row["note"] for row in rows if row.get("note")))
    header = ["op", "workload", "competitor", "GPU ms/step", "wall ms/step", "wall us/step",
              "x floor", f"x {label} (GPU)", f"x {label} (wall)", "steps x reps", "first call",
              "target"]
    lines = [header] + [_table_cells(row, ops[row["op"]].REFERENCE, notes) for row in rows]
    widths = [max(len(line[k]) for line in lines) for k in range(len(header))]
    text = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    text.insert(1, "-+-".join("-" * width for width in widths))
    if any("x_own_floor" in row for row in rows):
        text.append("x floor (own N): over the workload's floor; N over the floor of the bytes "
                    "the competitor itself moves (bytes_per_param in the JSON)")
    text += [f"[{number}] {note}" for number, note in enumerate(notes, 1)]
    return "\n".join(text)


def format_summary(rows: list) -> str:
    """Each op's targets for mtapply's default row, and which table mode is faster."""
    lines = []
    for op in dict.fromkeys(row["op"] for row in rows):
        targets = [row for row in rows if row["op"] == op
                   and row["competitor"] == DEFAULT_MTAPPLY and "target" in row]
        if targets:
            lines.append(f"{op} targets ({DEFAULT_MTAPPLY}, table_mode='memcpy'):")
            lines += [f"  {row['workload']:<10} {check['text']}" for row in targets
                      for check in row["target"].get("checks", [row["target"]])]
    pairs = [(row, _find(rows, row, "mtapply-unified")) for row in rows
             if row["competitor"] == DEFAULT_MTAPPLY and "error" not in row]
    pairs = [(row, other) for row, other in pairs if other is not None and "error" not in other]
    if pairs:
        lines.append("table mode (unified time / memcpy time; < 1 means unified is faster):")
        lines += [f"  {row['op']:<5} {row['workload']:<10} "
                  f"GPU {other['gpu_ms'] / row['gpu_ms']:.3f}  "
                  f"wall {other['wall_ms'] / row['wall_ms']:.3f}" for row, other in pairs]
    return "\n".join(lines) or f"no {DEFAULT_MTAPPLY} row with a target was run"


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


def _target(row: dict, op):
    """The verdict on the row's targets, for rows the issue sets targets on: one target's
    {'metric', 'limit', 'value', 'met', 'text'}, or for several {'met' (all of them), 'text',
    'checks' (each one's)}. A target whose value was not measured (its reference row is
    missing) is left out."""
    if row["competitor"] not in TARGET_COMPETITORS:
        return None
    pairs = target_pairs(op).get(row["workload"], [])
    checks = [_check(row, metric, limit, op.REFERENCE) for metric, limit in pairs
              if row.get(metric) is not None]
    if len(checks) <= 1:
        return checks[0] if checks else None
    return {"met": all(check["met"] for check in checks),
            "text": "; ".join(check["text"] for check in checks), "checks": checks}


def _check(row: dict, metric: str, limit: float, reference: str) -> dict:
    value = row[metric]
    met = value <= limit
    unit = _unit(metric, reference)
    text = f"{'met' if met else 'MISSED'}: {value:.3f}{unit} (target <= {limit:g}{unit})"
    return {"metric": metric, "limit": limit, "value": value, "met": met, "text": text}


def _unit(metric: str, reference: str) -> str:
    if metric == "x_floor":
        return "x floor"
    if metric == "wall_us":
        return " us wall/step"
    return f"x {reference} ({metric.rsplit('_', 1)[1]})"  # x_<reference>_gpu or _wall


def _reference_label(rows: list, ops: dict) -> str:
    """The reference competitor's name for the column headers, if every op shown shares it."""
    references = {ops[row["op"]].REFERENCE for row in rows}
    return references.pop() if len(references) == 1 else "reference"


def _table_cells(row: dict, reference: str, notes: list) -> list:
    mark = f" [{notes.index(row['note']) + 1}]" if row.get("note") else ""
    head = [row["op"], row["workload"], row["competitor"] + mark]
    if "error" in row:
        return head + ["-"] * 8 + [f"skipped: {row['error']}"[:120]]
    ref = _key(reference)
    wall_only = row["gpu_ms"] is None  # GPU time n/a: x floor by wall clock, and marked so
    x_floor = f"{_ratio(row['x_floor_wall'])} (wall)" if wall_only else _ratio(row["x_floor"])
    if row.get("x_own_floor") is not None:
        x_floor += f" (own {_ratio(row['x_own_floor'])})"
    return head + [_time(row["gpu_ms"]), _time(row["wall_ms"]), _time(row["wall_us"]),
                   x_floor, _ratio(row.get(f"x_{ref}_gpu")),
                   _ratio(row.get(f"x_{ref}_wall")), f"{row['steps']} x {row['repeats']}",
                   "" if row.get("first_call_s") is None else f"{row['first_call_s']:.2f} s",
                   _verdict(row)]


def _verdict(row: dict) -> str:
    if "target" not in row:
        return ""
    return "met" if row["target"]["met"] else "MISSED"


def _time(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if value < 1000 else f"{value:.0f}"


def _ratio(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 100 else f"{value:.0f}"


def _find(rows: list, like: dict, competitor: str):
    """`competitor`'s row on the same op and workload as the row `like`."""
    return next((r for r in rows if r["op"] == like["op"] and r["workload"] == like["workload"]
                 and r["competitor"] == competitor), None)


def _key(name: str) -> str:
    return name.replace("-", "_")
