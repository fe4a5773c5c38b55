"""A rule that sums over the whole list or keeps scalar state, over tensors on several devices
(mtapply._devices.Shared): every device adds all devices' totals in one order and steps the
same scalar state. On one GPU the plan's tensors are split into parts that stand in for
devices; the test on two GPUs is the real thing. Each equals the rule over one list."""
import numpy as np
import pytest

import mtapply.plan
from mtapply.rules import library

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SHAPES = [(300,), (0,), (64, 65), (1,), (5000,), (7, 3), (0, 4), (2049,)]
RULES = {  # rule, its extra hyperparameters
    "prodigy": (library.prodigy, dict(beta3=0.999 ** 0.5, weight_decay=0.01)),
    "dadapt_adam": (library.dadapt_adam, dict(weight_decay=0.01)),
    "nadam": (library.nadam, dict(lr=1e-2)),  # scalar state, no whole-list sums
}


def _lists(rule, devices, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = [s.name for s in rule.program.slots]
    columns = {name: [] for name in slots}
    for shape, device in zip(SHAPES, devices):
        param = torch.randn(shape, generator=g, dtype=torch.float64)
        for name in slots:
            value = {"param": param, "p0": param, "exp_avg_sq": param.abs() * 0.01}.get(
                name, torch.randn(shape, generator=g, dtype=torch.float64) * 0.1)
            columns[name].append(value.to(device, dtype).clone())
    return columns


def _run(name, devices, dtype, steps=5):
    make, hyper = RULES[name]
    rule = make()
    columns = _lists(rule, devices, dtype)
    scalars = torch.tensor(rule.initial_scalars(np.dtype(str(dtype).split(".")[1])),
                           device=devices[0])
    plan = rule.plan(*columns.values())
    g = torch.Generator().manual_seed(9)
    for step in range(1, steps + 1):
        for grad in columns["grad"]:  # new grads each step, on their devices
            grad.copy_(torch.randn(grad.shape, generator=g, dtype=torch.float64).to(grad))
        plan.step(step=step, scalars_out=scalars, **hyper)
    for device in dict.fromkeys(devices):
        torch.cuda.synchronize(device)
    return columns, scalars, plan


def _assert_same(name, ours, theirs, dtype):
    exact = name == "nadam"  # the same sums: bit for bit
    rtol = 0 if exact else (1e-12 if dtype == torch.float64 else 2e-5)
    (columns, scalars, _), (expected, expected_scalars, _) = ours, theirs
    torch.testing.assert_close(scalars.cpu(), expected_scalars.cpu(), rtol=rtol, atol=0)
    for slot, values in columns.items():
        for k, (got, want) in enumerate(zip(values, expected[slot])):
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rtol, atol=rtol * 1e-3,
                                       msg=lambda m: f"{slot}[{k}]: {m}")


@pytest.mark.parametrize("split", ["alternate", "three", "first-empty", "one-empty"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(RULES))
def test_parts_of_one_gpu_step_as_one_list(name, dtype, split, monkeypatch):
    labels = {"alternate": [0, 1] * 4, "three": [0, 1, 2, 2, 1, 0, 2, 1],
              # the first part's tensors are empty: another part writes the scalar state
              "first-empty": [0, 1, 0, 1, 1, 1, 0, 1],
              "one-empty": [0, 0, 1, 0, 0, 0, 1, 0]}[split]
    theirs = _run(name, ["cuda:0"] * len(SHAPES), dtype)

    def parts(params):
        assert all(ref.device == ("cuda", 0) for ref in params)
        order = dict.fromkeys(labels)
        return [(0, np.flatnonzero(np.array(labels) == label)) for label in order]

    monkeypatch.setattr(mtapply.plan, "_parts_by_device", parts)
    ours = _run(name, ["cuda:0"] * len(SHAPES), dtype)
    assert len(ours[2]._cuda.parts) == len(set(labels))
    _assert_same(name, ours, theirs, dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(RULES))
def test_two_gpus_step_as_one_list(name, dtype):
    devices = ["cuda:0", "cuda:1", "cuda:1", "cuda:0", "cuda:1", "cuda:0", "cuda:0", "cuda:1"]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
        ours = _run(name, devices, dtype)
    assert [d for d, _, _ in ours[2]._cuda.parts] == [0, 1]
    _assert_same(name, ours, _run(name, ["cuda:0"] * len(SHAPES), dtype), dtype)
