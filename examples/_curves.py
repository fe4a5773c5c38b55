"""What the examples share: their parser (the whole docstring as its help, `--out`, `--device`),
relative gaps between loss curves, their plot, and the folder the examples write to."""
from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"  # git-ignored


def parser_for(doc: str) -> argparse.ArgumentParser:
    """A parser whose `--help` prints the example's whole docstring, as written."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_device_argument(parser, gpu_available: bool) -> None:
    """`--device {cpu,cuda}`, cuda by default when the example's framework sees a GPU."""
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if gpu_available else "cpu",
                        help="where to run (default: cuda when a GPU is seen, else cpu)")


def add_out_argument(parser) -> None:
    """`--out DIR`: where the example writes its plot (default examples/out/)."""
    parser.add_argument("--out", default=str(OUT), help="folder for the example's outputs "
                        "(default: examples/out/, git-ignored)")


def output_path(folder: str, name: str) -> str:
    """`folder`/`name`, the folder made if missing."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    return str(Path(folder) / name)


def relative_gaps(ref: list, new: list) -> list:
    return [abs(a - b) / max(abs(a), abs(b), 1e-30) for a, b in zip(ref, new)]


def save_plot(path: str, curves: list, names: list, title: str, rtol: float | None = None, *,
              xlabel: str = "epoch", ylabel: str = "mean training loss",
              gaps: list | None = None, gap_label: str = "relative loss gap") -> None:
    """The loss curves (the first is the reference) and the others' relative gaps from it (or
    the given `gaps`, one list per other curve, labelled `gap_label`), with the tolerance `rtol`
    on them, if any, as a PNG; skipped with a note when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # file output only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install matplotlib)")
        return
    ref = curves[0]
    epochs = range(1, len(ref) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(6, 6))
    for curve, name, style in zip(curves, names, ("o-", "x--", "+:")):
        top.plot(epochs, curve, style, label=name)
    top.set(ylabel=ylabel, yscale="log", title=title)
    top.legend()
    if gaps is None:
        gaps = [relative_gaps(ref, curve) for curve in curves[1:]]
    for gap, name, style in zip(gaps, names[1:], ("s-", "d--")):
        bottom.plot(epochs, gap, style, label=name)
    if rtol is not None:
        bottom.axhline(rtol, color="red", linestyle=":", label=f"tolerance {rtol:g}")
    # symlog: identical losses (a gap of exactly 0) sit at 0, rounding-level gaps on a log scale
    bottom.set_yscale("symlog", linthresh=1e-8)
    bottom.set(xlabel=xlabel, ylabel=gap_label)
    bottom.set_ylim(bottom=0)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
