"""The loss-curve runner on the CPU with a tiny GPT-2: every variant trains from the same
weights on the same batches, and 8-bit AdamW follows fp32 AdamW."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from mtapply.bench import losses  # noqa: E402


def test_tiny_gpt2_curves_fall_together(tmp_path):
    out = tmp_path / "losses.json"
    argv = ["--steps", "40", "--layers", "2", "--width", "64", "--heads", "2", "--vocab", "300",
            "--tokens", "32", "--batch", "4", "--distinct-batches", "2", "--lr", "3e-3",
            "--device", "cpu", "--json", str(out), "--plot", ""]
    assert losses.main(argv) == 0
    results = json.loads(out.read_text())
    curves = results["losses"]
    assert list(curves)[:2] == ["torch-adamw", "mtapply-8bit"]
    for name, values in curves.items():
        assert len(values) == 40 and values[-1] < 0.5 * values[0], name
    assert curves["torch-adamw"][0] == curves["mtapply-8bit"][0]  # same weights, same batch
    assert results["late_gaps"]["mtapply-8bit"] < 0.2


def test_tiny_gpt2_galore_curves(tmp_path):
    """GaLore at a rank below the blocks' widths: the projected weights are those of the
    transformer blocks, and mtapply's curve equals galore-torch's where that is installed."""
    out = tmp_path / "losses.json"
    argv = ["--family", "galore", "--rank", "8", "--steps", "30", "--layers", "2", "--width",
            "32", "--heads", "2", "--vocab", "200", "--tokens", "16", "--batch", "4",
            "--distinct-batches", "2", "--lr", "3e-3", "--device", "cpu", "--json", str(out),
            "--plot", ""]
    assert losses.main(argv) == 0
    curves = json.loads(out.read_text())["losses"]
    assert list(curves)[:2] == ["torch-adamw", "mtapply-galore"]
    assert curves["mtapply-galore"][-1] < 0.7 * curves["mtapply-galore"][0]
    if "galore-torch" in curves:
        for ours, theirs in zip(curves["mtapply-galore"], curves["galore-torch"]):
            assert abs(ours - theirs) <= 1e-4 * abs(theirs)
