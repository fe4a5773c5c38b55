"""What the digits examples share: relative gaps between loss curves, their plot, and the
folder the examples write to."""
from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"  # git-ignored


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


def save_plot(path: str, curves: list, names: list, title: str, rtol: float | None = None) -> None:
    """The loss curves (the first is the reference) and the others' relative gaps from it (and
    the tolerance `rtol` on them, if any), as a PNG; skipped with a note when matplotlib is not
    installed."""
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
    top.set(ylabel="mean training loss", yscale="log", title=title)
    top.legend()
    for curve, name, style in zip(curves[1:], names[1:], ("s-", "d--")):
        bottom.plot(epochs, relative_gaps(ref, curve), style, label=name)
    if rtol is not None:
        bottom.axhline(rtol, color="red", linestyle=":", label=f"tolerance {rtol:g}")
    # symlog: identical losses (a gap of exactly 0) sit at 0, rounding-level gaps on a log scale
    bottom.set_yscale("symlog", linthresh=1e-8)
    bottom.set(xlabel="epoch", ylabel="relative loss gap")
    bottom.set_ylim(bottom=0)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
