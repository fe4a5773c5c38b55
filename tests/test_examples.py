"""The digits examples run end to end, as a user runs them (a subprocess), and their curves agree.

On the CPU with two epochs (a few seconds); the `gpu` variants run the default length on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, tmp_path: Path, *args: str) -> str:
    """Runs examples/<name> with a plot path under tmp_path; returns its output, checked."""
    pytest.importorskip("sklearn")
    plot = tmp_path / "curves.png"
    # the script's own folder is first on its sys.path: point it at this checkout's mtapply too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args,
                             "--plot", str(plot)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK: the loss curves agree" in output, output
    assert "test accuracy:" in output, output
    if _has_matplotlib():
        assert plot.stat().st_size > 0, output
    else:
        assert "matplotlib is not installed" in output, output
    return output


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_mtapply_torch():
    pytest.importorskip("torch")
    pytest.importorskip("mtapply.torch")


def _needs_mtapply_optax():
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    pytest.importorskip("mtapply.optax")


def _jax_sees_a_gpu() -> bool:
    """Asked in a subprocess: jax in this process would take GPU memory from the tests."""
    probe = "import jax, sys; sys.exit(0 if jax.devices('gpu') else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          timeout=300).returncode == 0


def test_digits_cupy_example_on_cpu(tmp_path):
    output = run_example("digits_cupy.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "device=cpu (numpy) epochs=2" in output


def test_digits_torch_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_torch.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "device=cpu epochs=2" in output


def test_digits_rule_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_rule.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "device=cpu epochs=2" in output


def test_digits_8bit_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_8bit.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "mtapply.torch.AdamW8bit" in output and "state bytes per param" in output, output


def test_digits_galore_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_galore.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "mtapply.torch.GaLoreAdamW" in output and "optimizer state of" in output, output


def test_digits_jax_example_on_cpu(tmp_path):
    _needs_mtapply_optax()
    output = run_example("digits_jax.py", tmp_path, "--device", "cpu", "--epochs", "2")
    assert "device=cpu (cpu:0) epochs=2" in output


@pytest.mark.gpu
def test_digits_cupy_example_on_gpu(tmp_path):
    output = run_example("digits_cupy.py", tmp_path, "--device", "cuda")
    assert "device=cuda (cupy)" in output


@pytest.mark.gpu
@pytest.mark.parametrize("name,shows", [("digits_torch.py", "mtapply.torch.AdamW"),
                                        ("digits_rule.py", "epochs=20"),
                                        ("digits_8bit.py", "mtapply.torch.AdamW8bit"),
                                        ("digits_galore.py", "mtapply.torch.GaLoreAdamW")])
def test_torch_digits_examples_on_gpu(tmp_path, name, shows):
    _needs_mtapply_torch()
    import torch

    if not torch.cuda.is_available():
        pytest.skip("this torch build sees no CUDA device")
    output = run_example(name, tmp_path, "--device", "cuda")
    assert "device=cuda" in output and "epochs=20" in output and shows in output, output


@pytest.mark.gpu
def test_digits_jax_example_on_gpu(tmp_path):
    _needs_mtapply_optax()
    pytest.importorskip("cupy")  # mtapply.optax's GPU callback launches through CuPy
    if not _jax_sees_a_gpu():
        pytest.skip("this jax build sees no GPU")
    output = run_example("digits_jax.py", tmp_path, "--device", "gpu")
    assert "device=gpu" in output and "epochs=5" in output
