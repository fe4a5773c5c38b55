"""Tensors on two GPUs: one launch set per device, on that device's stream; DDP and FSDP2."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mtapply
from test_examples import assert_params_agree

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
ROOT = Path(__file__).resolve().parents[2]


def _lists(shapes, devices, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda s, d, k=1.0: (torch.randn(s, generator=g) * k).to(d)  # noqa: E731
    params = [make(s, d) for s, d in zip(shapes, devices)]
    grads = [make(s, d) for s, d in zip(shapes, devices)]
    ms = [make(s, d, 0.1) for s, d in zip(shapes, devices)]
    vs = [make(s, d, 0.1).abs() for s, d in zip(shapes, devices)]
    return params, grads, ms, vs


def test_adam_over_two_gpus_launches_once_per_device_on_its_stream():
    shapes = [(1000,), (0,), (4097,), (3, 5), (278011,), (7,)]
    devices = ["cuda:0", "cuda:1"] * 3
    params, grads, ms, vs = _lists(shapes, devices)
    expected = [[t.clone() for t in column] for column in (params, grads, ms, vs)]
    launches = []
    original = mtapply._launch.KernelLaunch.launch
    mtapply._launch.KernelLaunch.launch = lambda self, s: (launches.append(s), original(self, s))[1]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    try:
        with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
            plan = mtapply.adam_plan(params, grads, ms, vs, decoupled_weight_decay=True)
            plan.step(lr=1e-2, step=1, weight_decay=0.1)
    finally:
        mtapply._launch.KernelLaunch.launch = original
    assert sorted(launches) == sorted(s.cuda_stream for s in streams)
    for d in (0, 1):
        torch.cuda.synchronize(d)
    for i, p in enumerate(params):  # each device's result equals a one-device run
        single = [[column[i].clone()] for column in expected]
        mtapply.adam_step(*single, lr=1e-2, step=1, weight_decay=0.1, decoupled_weight_decay=True)
        assert torch.equal(p, single[0][0]) and torch.equal(ms[i], single[2][0]), i
    fresh = [torch.randn_like(g) for g in grads]
    plan.rebind("grads", fresh)  # rebinding splits the new tensors by device too
    plan.step(lr=1e-2, step=2, weight_decay=0.1)
    for d in (0, 1):
        torch.cuda.synchronize(d)
    assert all(torch.isfinite(p).all() for p in params)


def test_whole_list_sums_and_device_scalars_refuse_two_gpus():
    params, grads, ms, vs = _lists([(10,), (10,)], ["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="call it once per GPU"):
        mtapply.l2_norms(grads)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    with pytest.raises(ValueError, match="several GPUs: pass a number"):
        plan.step(lr=torch.tensor([1e-3], device="cuda:0"), step=1)


def test_a_model_split_over_two_gpus_trains_like_torch_optim():
    import mtapply.torch as mt

    def model():
        torch.manual_seed(0)
        return (torch.nn.Linear(8, 16).to("cuda:0"), torch.nn.Linear(16, 4).to("cuda:1"))

    a, b = model(), model()
    oa = torch.optim.Adam([*a[0].parameters(), *a[1].parameters()], lr=1e-2, foreach=False)
    ob = mt.Adam([*b[0].parameters(), *b[1].parameters()], lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(16, 8, generator=g)
        for (first, second), opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            loss = second(first(x.to("cuda:0")).tanh().to("cuda:1")).pow(2).mean()
            scaler.scale(loss).backward() if opt is ob else loss.backward()
            scaler.step(opt) if opt is ob else opt.step()
        scaler.update()
    for p, q in zip([*a[0].parameters(), *a[1].parameters()], [*b[0].parameters(), *b[1].parameters()]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,optimizer", [("ddp", "adamw"), ("fsdp2", "adamw"),
                                            ("fsdp2", "lars"), ("fsdp2", "lamb"),
                                            ("fsdp2", "lion"), ("fsdp2", "adamw8bit"),
                                            ("fsdp2", "lion8bit"), ("fsdp2", "sgd8bit"),
                                            ("fsdp2", "lars8bit"), ("fsdp2", "lamb8bit"),
                                            ("fsdp2", "rmsprop8bit"), ("fsdp2", "adagrad8bit"),
                                            ("fsdp2", "ademamix8bit"), ("ddp", "lamb8bit"),
                                            ("ddp", "sgd8bit"), ("fsdp2", "muon"),
                                            ("fsdp2", "muon8bit"), ("fsdp2", "prodigy"),
                                            ("ddp", "prodigy")])
def test_distributed_training_equals_one_gpu(mode, optimizer, tmp_path):
    torchrun = shutil.which("torchrun")
    command = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = str(ROOT / "examples" / "distributed_torch.py")
    subprocess.run(command + ["--standalone", "--nproc_per_node=2", script, "--mode", mode, "--optimizer", optimizer,
                              "--device", "cuda", "--out", str(tmp_path)], check=True, env=env,
                   timeout=300)
    subprocess.run([sys.executable, script, "--mode", "single", "--optimizer", optimizer,
                    "--device", "cuda", "--out", str(tmp_path)], check=True, env=env, timeout=300)
    dist_result = torch.load(tmp_path / f"distributed_{mode}_{optimizer}.pt")
    one = torch.load(tmp_path / f"distributed_single_{optimizer}.pt")
    assert len(dist_result["params"]) == len(one["params"]) > 0
    eight_bit = optimizer.endswith("8bit")
    assert ("torch.uint8" in dist_result["state_dtypes"]) == eight_bit
    # sharded norms and reductions add in another order: a few fp32 roundings per step; with
    # 8-bit states such a rounding may pick the neighbouring code (Muon: a bfloat16 rounding)
    assert_params_agree(dist_result["params"], one["params"], eight_bit,
                        optimizer.startswith("muon"))
    assert not np.allclose(one["losses"][0], one["losses"][-1])  # it trained


@pytest.mark.parametrize("optimizer", ["adamw8bit", "lion8bit", "muon8bit"])
def test_fsdp2_state_resumes_from_a_checkpoint_exactly(optimizer, tmp_path):
    """8-bit states of FSDP2 shards on two GPUs through torch.distributed.checkpoint, halfway
    into a new optimizer: the same run as without (the example's --checkpoint)."""
    torchrun = shutil.which("torchrun")
    command = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = str(ROOT / "examples" / "distributed_torch.py")
    results = []
    for extra in ([], ["--checkpoint", str(tmp_path / "checkpoint")]):
        out = tmp_path / ("resumed" if extra else "straight")
        subprocess.run(command + ["--standalone", "--nproc_per_node=2", script, "--mode", "fsdp2",
                                  "--optimizer", optimizer, "--device", "cuda", "--out", str(out)]
                       + extra, check=True, env=env, timeout=300)
        results.append(torch.load(out / f"distributed_fsdp2_{optimizer}.pt"))
    straight, resumed = results
    assert "torch.uint8" in straight["state_dtypes"]
    for p, q in zip(straight["params"], resumed["params"], strict=True):
        assert torch.equal(p, q)
    assert straight["losses"] == resumed["losses"]
