"""The examples run end to end, as a user runs them (a subprocess), and check what they claim.

Every example's `--help` prints its whole docstring. On the CPU with a few epochs (a few seconds
each); the `gpu` variants run the default length on the GPU. Each writes its plot into `--out`
and nothing into the folder it runs in, and its last line says what it checked.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ALL_EXAMPLES = sorted(path.name for path in EXAMPLES.glob("*.py") if not path.name.startswith("_"))


def _env() -> dict:
    # the script's own folder is first on its sys.path: point it at this checkout's mtapply too
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_example(name: str, tmp_path: Path, *args: str, closing: str = "",
                digits: bool = True) -> str:
    """Runs examples/<name> with `--out` under tmp_path; returns its output, checked: status 0,
    its plot in `--out`, and a last line "OK: ..." that contains `closing` (what it checked)."""
    if digits:
        pytest.importorskip("sklearn")
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args, "--out", str(out)],
                            cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    last = result.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("OK: ") and closing in last, output
    if digits:
        assert "test accuracy:" in output, output
    assert_plot(out / name.replace(".py", ".png"), output)
    assert not any(cwd.iterdir()), f"{name} wrote into the folder it ran in"
    return output


def assert_plot(path: Path, output: str) -> None:
    """The example wrote its plot to `path` (or said that matplotlib is missing)."""
    if _has_matplotlib():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", output
        assert f"plot: {path}" in output, output
    else:
        assert "matplotlib is not installed" in output, output


def _docstring(name: str) -> str:
    return ast.get_docstring(ast.parse((EXAMPLES / name).read_text()), clean=False).strip()


@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_example_help_prints_its_whole_description(name):
    """`--help` prints the docstring as written (usage lines and lists kept), and lists
    `--device {cpu,cuda}` and `--out`."""
    pytest.importorskip("torch")
    if name == "digits_jax.py":
        _needs_mtapply_optax()
    done = subprocess.run([sys.executable, str(EXAMPLES / name), "--help"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _docstring(name) in done.stdout, done.stdout
    assert "--device {cpu,cuda}" in done.stdout and "--out OUT" in done.stdout, done.stdout


def test_examples_all_tested():
    """Every example has its --help and CPU run here (the listed names are the files)."""
    assert ALL_EXAMPLES == ["adam_quickstart.py", "digits_8bit.py", "digits_cupy.py",
                            "digits_galore.py", "digits_jax.py", "digits_muon.py",
                            "digits_rule.py", "digits_torch.py", "distributed_torch.py"]


def test_adam_quickstart_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("adam_quickstart.py", tmp_path, "--device", "cpu", "--steps", "3",
                         digits=False, closing="after each of 3 steps, every element of "
                         "mtapply.adam_step's params is within 1e-05 of torch.optim.AdamW's")
    assert "device=cpu tensors=5 steps=3" in output


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
    output = run_example("digits_cupy.py", tmp_path, "--device", "cpu", "--epochs", "2",
                         closing="mtapply.adam_plan's mean training loss is within 0.0001 "
                         "(relative) of the reference AdamW's in each of the 2 epochs")
    assert "device=cpu (numpy) epochs=2" in output


def test_digits_torch_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_torch.py", tmp_path, "--device", "cpu", "--epochs", "2",
                         closing="mtapply.torch.AdamW's mean training loss is within 0.0001 "
                         "(relative) of torch.optim.AdamW's in each of the 2 epochs")
    assert "device=cpu epochs=2" in output


def test_digits_rule_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_rule.py", tmp_path, "--device", "cpu", "--epochs", "2",
                         closing="mtapply.rule Adagrad's mean training loss is within 0.0001 "
                         "(relative) of torch.optim.Adagrad's in each of the 2 epochs")
    assert "device=cpu epochs=2" in output


def test_digits_8bit_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_8bit.py", tmp_path, "--device", "cpu", "--epochs", "2",
                         closing="mtapply.torch.AdamW8bit's mean training loss is within 0.1 "
                         "(relative) of torch.optim.AdamW's in each of the 2 epochs")
    assert "mtapply.torch.AdamW8bit" in output and "state bytes per param" in output, output


def test_digits_galore_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    output = run_example("digits_galore.py", tmp_path, "--device", "cpu", "--epochs", "2",
                         closing="is within 8x torch.optim.AdamW's")
    assert "mtapply.torch.GaLoreAdamW" in output and "optimizer state of" in output, output


@pytest.mark.parametrize("seed,epochs", [(3, 5), (0, 20)])
def test_digits_jax_example_on_cpu(tmp_path, seed, epochs):
    """Any seed and length: the check bounds each step by float32 rounding, where independent
    runs' loss curves drift apart (seed 3 by 1.8e-4 at epoch 4, seed 0 by 4e-4 at epoch 20)."""
    _needs_mtapply_optax()
    output = run_example("digits_jax.py", tmp_path, "--device", "cpu", "--epochs", str(epochs),
                         "--seed", str(seed),
                         closing="the new params and moments of mtapply.optax.adamw and "
                         "fused_adamw are within float32 rounding of optax.adamw's")
    assert f"device=cpu (cpu:0) epochs={epochs}" in output
    ratios = re.findall(r"within (\S+) of the float32 rounding bound", output)
    assert len(ratios) == 2 and all(0 < float(r) <= 1 for r in ratios), output


def _import_example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


class _CountOneAhead:
    """An mtapply.optax optimizer that takes one step more than it is given: bias corrections
    one step off."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def update(self, grads, state, params):
        return self.optimizer.update(grads, state._replace(count=state.count + 1), params)

    def step(self, params, grads, state):
        return self.optimizer.step(params, grads, state._replace(count=state.count + 1))


def test_digits_jax_step_check_refuses_other_semantics():
    """The bound passes mtapply's AdamW and fails a step that forgets the weight decay or takes
    its bias corrections one step off: it tells a wrong optimizer from rounding."""
    _needs_mtapply_optax()
    pytest.importorskip("sklearn")
    import jax
    import optax

    import mtapply.optax as mtx

    example = _import_example("digits_jax")
    args = example.parse_args(["--device", "cpu"])
    device = jax.devices("cpu")[0]
    x, y = (a[:args.batch_size] for a in example.load_data(0, device)[:2])
    reference = optax.adamw(args.lr, weight_decay=args.weight_decay)

    def worst(transformation, fused, steps=20):
        step = example.checked_step(args, reference, transformation, fused)
        params = example.init_params(0, device)
        state, ratios = reference.init(params), []
        for _ in range(steps):
            params, state, _, ratio = step(params, state, x, y)
            ratios.append([float(r) for r in ratio])
        return [max(column) for column in zip(*ratios)]

    right = (mtx.adamw(args.lr, weight_decay=args.weight_decay),
             mtx.fused_adamw(args.lr, weight_decay=args.weight_decay))
    assert max(worst(*right)) <= 1
    no_decay = worst(mtx.adamw(args.lr), mtx.fused_adamw(args.lr))
    one_off = worst(*(_CountOneAhead(optimizer) for optimizer in right))
    assert min(no_decay) > 1 and min(one_off) > 1, (no_decay, one_off)


def _torchrun() -> list:
    torchrun = shutil.which("torchrun")
    return [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.parametrize("mode,optimizer", [("ddp", "adamw"), ("fsdp2", "adamw"),
                                            ("fsdp2", "lion"), ("fsdp2", "adamw8bit"),
                                            ("fsdp2", "lion8bit"), ("fsdp2", "ademamix8bit"),
                                            ("ddp", "rmsprop8bit"), ("fsdp2", "muon"),
                                            ("fsdp2", "muon8bit"), ("ddp", "prodigy"),
                                            ("fsdp2", "lars"), ("fsdp2", "lamb"),
                                            ("fsdp2", "prodigy"), ("fsdp2", "lamb8bit")])
def test_distributed_example_on_cpu_equals_one_process(tmp_path, mode, optimizer):
    """torchrun with two CPU processes (gloo) trains as one process on whole batches does; over
    FSDP2 shards 8-bit states too (each weight's shard holds whole blocks of its tensor). The
    example checks itself against one process and says so last; checked here again from the
    files it saves, against a separate one-process run."""
    _needs_mtapply_torch()
    import numpy as np
    import torch

    script = str(EXAMPLES / "distributed_torch.py")
    common = ["--optimizer", optimizer, "--device", "cpu", "--out", str(tmp_path)]
    closings = (f"OK: every final param of the {mode} run over 2 ranks is within ",
                "OK: trained in one process")
    outputs = []
    for command, closing in zip(
            (_torchrun() + ["--standalone", "--nproc_per_node=2", script, "--mode", mode],
             [sys.executable, script, "--mode", "single"]), closings):
        done = subprocess.run(command + common, env=_env(), capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert done.stdout.rstrip("\n").splitlines()[-1].startswith(closing), output
        outputs.append(output)
    assert "loss (mean over ranks)" in outputs[0] and "loss (one process)" in outputs[1], outputs
    for run, output in zip((mode, "single"), outputs):
        assert_plot(tmp_path / f"distributed_{run}_{optimizer}.png", output)
    both = torch.load(tmp_path / f"distributed_{mode}_{optimizer}.pt")
    one = torch.load(tmp_path / f"distributed_single_{optimizer}.pt")
    assert len(both["params"]) == len(one["params"]) > 0
    eight_bit = optimizer.endswith("8bit")
    assert ("torch.uint8" in both["state_dtypes"]) == eight_bit == ("torch.uint8" in one["state_dtypes"])
    assert_params_agree(both["params"], one["params"], eight_bit, optimizer.startswith("muon"))
    assert not np.allclose(one["losses"][0], one["losses"][-1])  # it trained


def assert_params_agree(got: list, want: list, eight_bit: bool, muon: bool = False) -> None:
    """Params of a distributed run against one process's: the ranks' half-batch gradients are
    averaged, a few float32 roundings per step. With 8-bit state such a rounding may put a
    value on the neighbouring code, and that element's later steps then differ by up to a few
    lr (3e-3 AdamW, 3e-4 Lion): at most 2e-3, and all but 1% of the elements agree as with
    float state. Muon's bfloat16 Newton-Schulz spreads a rounding that goes the other way over
    the matrix (some 1% of a step, lr 0.02): each element within 1e-2, the RMS within 2e-3."""
    import torch

    for p, q in zip(got, want, strict=True):
        if muon:
            torch.testing.assert_close(p, q, rtol=0, atol=1e-2)
            assert (p - q).pow(2).mean().sqrt() <= 2e-3
            continue
        if not eight_bit:
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
            continue
        agree = ((p - q).abs() <= 1e-5 + 1e-4 * q.abs()).float().mean().item()
        assert agree >= 0.99, agree
        torch.testing.assert_close(p, q, rtol=0, atol=2e-3)


@pytest.mark.parametrize("optimizer", ["muon", "muon8bit"])
def test_muon_over_fsdp2_shards_steps_as_over_ddp_exactly(tmp_path, optimizer):
    """Muon over FSDP2 shards (each rank gathers the whole matrices for Newton-Schulz and steps
    its own shards, the AdamW biases too) ends with the params that DDP's whole params end with,
    to the bit, with float and with 8-bit states."""
    _needs_mtapply_torch()
    import torch

    script = str(EXAMPLES / "distributed_torch.py")
    finals = []
    for mode in ("ddp", "fsdp2"):
        done = subprocess.run(_torchrun() + ["--standalone", "--nproc_per_node=2", script, "--mode",
                                             mode, "--optimizer", optimizer, "--device", "cpu",
                                             "--out", str(tmp_path)],
                              env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        finals.append(torch.load(tmp_path / f"distributed_{mode}_{optimizer}.pt"))
    ddp, fsdp2 = finals
    assert ddp["state_dtypes"] == fsdp2["state_dtypes"]
    assert ("torch.uint8" in fsdp2["state_dtypes"]) == optimizer.endswith("8bit")
    for k, (p, q) in enumerate(zip(fsdp2["params"], ddp["params"], strict=True)):
        assert torch.equal(p, q), f"params[{k}]: {(p - q).abs().max().item():.3e} apart"


@pytest.mark.parametrize("optimizer", ["adamw8bit", "lion", "muon8bit"])
def test_distributed_example_resumes_from_a_checkpoint_exactly(tmp_path, optimizer):
    """FSDP2 shards' optimizer state (8-bit codes and block scales included) saved halfway
    through torch.distributed.checkpoint and loaded into a new optimizer: the same run."""
    _needs_mtapply_torch()
    import torch

    script = str(EXAMPLES / "distributed_torch.py")
    results = []
    for extra in ([], ["--checkpoint", str(tmp_path / "checkpoint")]):
        out = tmp_path / ("resumed" if extra else "straight")
        command = _torchrun() + ["--standalone", "--nproc_per_node=2", script, "--mode", "fsdp2",
                                 "--optimizer", optimizer, "--device", "cpu", "--out", str(out)]
        done = subprocess.run(command + extra, env=_env(), capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        results.append(torch.load(out / f"distributed_fsdp2_{optimizer}.pt"))
    assert any((tmp_path / "checkpoint").iterdir())  # written there
    straight, resumed = results
    for p, q in zip(straight["params"], resumed["params"], strict=True):
        assert torch.equal(p, q)
    assert straight["losses"] == resumed["losses"]


def test_distributed_example_refuses_under_torchrun_with_its_reason(tmp_path):
    """Under torchrun a refusal is the rank's last line, with no traceback of the example's,
    and the root cause in torchrun's own failure summary."""
    _needs_mtapply_torch()
    import torch

    if torch.cuda.is_available():
        pytest.skip("refuses --device cuda only where torch sees no CUDA device")
    done = subprocess.run(_torchrun() + ["--standalone", "--nproc_per_node=2",
                                         str(EXAMPLES / "distributed_torch.py"), "--device",
                                         "cuda", "--mode", "fsdp2", "--optimizer", "lars",
                                         "--out", str(tmp_path / "out")],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    message = "--device cuda, but torch sees no CUDA device"
    assert f"distributed_torch.py: error: {message}" in done.stderr, output
    assert f"traceback : {message}" in done.stderr, output  # torchrun's summary
    assert 'distributed_torch.py", line' not in output, output
    assert not (tmp_path / "out").exists()


def test_distributed_example_refuses_fsdp2_outside_torchrun(tmp_path):
    _needs_mtapply_torch()
    done = subprocess.run([sys.executable, str(EXAMPLES / "distributed_torch.py"), "--device",
                           "cpu", "--mode", "fsdp2", "--optimizer", "lars", "--out",
                           str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "--mode fsdp2 runs under torchrun" in done.stderr, output
    assert not any(tmp_path.iterdir())


def test_digits_muon_example_on_cpu(tmp_path):
    _needs_mtapply_torch()
    import torch

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch 2.9+")
    output = run_example("digits_muon.py", tmp_path, "--device", "cpu", "--epochs", "3",
                         closing="mtapply.torch.Muon's mean training loss is within 0.01 "
                         "(relative) of torch.optim.Muon + AdamW's in each of the first 3 epochs")
    assert "mtapply.torch.Muon" in output and "below torch's" in output, output


@pytest.mark.gpu
def test_digits_cupy_example_on_gpu(tmp_path):
    output = run_example("digits_cupy.py", tmp_path, "--device", "cuda")
    assert "device=cuda (cupy)" in output


@pytest.mark.gpu
@pytest.mark.parametrize("name,shows", [("digits_torch.py", "mtapply.torch.AdamW"),
                                        ("digits_rule.py", "epochs=20"),
                                        ("digits_8bit.py", "mtapply.torch.AdamW8bit"),
                                        ("digits_galore.py", "mtapply.torch.GaLoreAdamW"),
                                        ("digits_muon.py", "mtapply.torch.Muon"),
                                        ("adam_quickstart.py", "steps=10")])
def test_torch_examples_on_gpu(tmp_path, name, shows):
    _needs_mtapply_torch()
    import torch

    if not torch.cuda.is_available():
        pytest.skip("this torch build sees no CUDA device")
    digits = name.startswith("digits_")
    output = run_example(name, tmp_path, "--device", "cuda", digits=digits)
    assert "device=cuda" in output and shows in output, output
    assert "epochs=20" in output or not digits, output


@pytest.mark.gpu
def test_digits_jax_example_on_gpu(tmp_path):
    _needs_mtapply_optax()
    pytest.importorskip("cupy")  # mtapply.optax's GPU callback launches through CuPy
    if not _jax_sees_a_gpu():
        pytest.skip("this jax build sees no GPU")
    output = run_example("digits_jax.py", tmp_path, "--device", "cuda")
    assert "device=cuda" in output and "epochs=20" in output
