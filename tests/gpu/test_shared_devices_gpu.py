"""A rule that sums over the whole list or keeps scalar state, over tensors on several devices
(mtapply._devices.Shared): every device adds all devices' totals in one order and steps the
same scalar state. On one GPU the plan's tensors are split into parts that stand in for
devices; the test on two GPUs is the real thing. Each equals the rule over one list."""
import numpy as np
import pytest

import mtapply.plan
from mtapply.rules import library, rule

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SHAPES = [(300,), (0,), (64, 65), (1,), (5000,), (7, 3), (0, 4), (2049,)]


def _clipped_adafactor():
    """Factored state (row and column means: passes of their own) and an update clipped by the
    grad's whole-list norm: the totals are exchanged after the first of several passes."""
    return rule("clipped_adafactor", slots="param:rw grad:r row_var:rw@row col_var:rw@col "
                "variance:rw@unfactored", hyper=dict(lr=1e-2, max_norm=1.0),
                totals={"g2": "grad * grad"}, update="""
                    g2e = grad * grad + 1e-30
                    row_var = row_var + (row_mean(g2e) - row_var) * 0.2
                    col_var = col_var + (col_mean(g2e) - col_var) * 0.2
                    variance = variance + (g2e - variance) * 0.2
                    v = row_var * col_var / col_mean(row_var) if factored else variance
                    u = grad * rsqrt(v)
                    param = param - lr / max(1, sqrt(g2) / max_norm) * u
                """)


RULES = {  # rule, its extra hyperparameters
    "prodigy": (library.prodigy, dict(beta3=0.999 ** 0.5, weight_decay=0.01)),
    "dadapt_adam": (library.dadapt_adam, dict(weight_decay=0.01)),
    "nadam": (library.nadam, dict(lr=1e-2)),  # scalar state, no whole-list sums
    "clipped_adafactor": (_clipped_adafactor, {}),  # whole-list sums, no scalar state
}
POSITIVE = ("exp_avg_sq", "row_var", "col_var", "variance")


def _lists(rule, devices, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = [s.name for s in rule.program.slots]
    columns = {name: [] for name in slots}
    for shape, device in zip(SHAPES, devices):
        param = torch.randn(shape, generator=g, dtype=torch.float64)
        state_shapes = rule.state_shapes(shape)
        for name in slots:
            value = torch.randn(state_shapes.get(name, shape), generator=g, dtype=torch.float64)
            value = {"param": param, "p0": param}.get(
                name, value.abs() * 0.01 if name in POSITIVE else value * 0.1)
            columns[name].append(value.to(device, dtype).clone())
    return columns


def _run(name, devices, dtype, steps=5, late=None, streams=None):
    """The rule's steps over lists on `devices`; `late`: a device whose stream sleeps before
    each step, so that its totals come after the others' (the waits must hold them);
    `streams`: streams of the first device that the steps take in turn, the first held back."""
    make, hyper = RULES[name]
    rule = make()
    columns = _lists(rule, devices, dtype)
    scalars = torch.tensor(rule.initial_scalars(np.dtype(str(dtype).split(".")[1])),
                           device=devices[0])
    out = dict(scalars_out=scalars) if rule.scalars else {}
    plan = rule.plan(*columns.values())
    g = torch.Generator().manual_seed(9)
    for step in range(1, steps + 1):
        for grad in columns["grad"]:  # new grads each step, on their devices
            grad.copy_(torch.randn(grad.shape, generator=g, dtype=torch.float64).to(grad))
        if late is not None:
            with torch.cuda.device(late):
                torch.cuda._sleep(20_000_000)  # some 10 ms of the device's stream
        if streams is None:
            plan.step(step=step, **out, **hyper)
            continue
        stream = streams[step % len(streams)]
        stream.wait_stream(torch.cuda.current_stream())  # (the new grads)
        with torch.cuda.stream(stream):
            if stream is streams[0]:
                torch.cuda._sleep(20_000_000)
            plan.step(step=step, **out, **hyper)
        torch.cuda.current_stream().wait_stream(stream)
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


@pytest.mark.parametrize("name", sorted(RULES))
def test_parts_that_change_streams_between_steps_step_as_one_list(name, monkeypatch):
    """Steps on streams taken in turn, the one of odd steps held back: each step's passes wait
    for the step before on the other stream (its totals and scalar state)."""
    theirs = _run(name, ["cuda:0"] * len(SHAPES), torch.float64)
    monkeypatch.setattr(mtapply.plan, "_parts_by_device", lambda params: [
        (0, np.arange(len(params))[k::3]) for k in (0, 1, 2)])
    streams = [torch.cuda.Stream() for _ in range(2)]
    ours = _run(name, ["cuda:0"] * len(SHAPES), torch.float64, streams=streams)
    assert len(ours[2]._cuda.parts) == 3
    _assert_same(name, ours, theirs, torch.float64)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("late", [None, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(RULES))
def test_two_gpus_step_as_one_list(name, dtype, late):
    devices = ["cuda:0", "cuda:1", "cuda:1", "cuda:0", "cuda:1", "cuda:0", "cuda:0", "cuda:1"]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    with torch.cuda.stream(streams[0]), torch.cuda.stream(streams[1]):
        ours = _run(name, devices, dtype, late=late)
    assert [d for d, _, _ in ours[2]._cuda.parts] == [0, 1]
    _assert_same(name, ours, _run(name, ["cuda:0"] * len(SHAPES), dtype), dtype)


def _prodigy_models(split_devices=("cuda:0", "cuda:0")):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(20, 30), torch.nn.Linear(30, 3)
    return first.to(split_devices[0]), second.to(split_devices[1])


def _train(layers, opt, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g).to(layers[0].weight.device)
        opt.zero_grad()
        hidden = layers[0](x).tanh().to(layers[1].weight.device)
        layers[1](hidden).square().mean().backward()
        opt.step()


def _params(layers):
    return [p for layer in layers for p in layer.parameters()]


def test_a_torch_optimizer_whose_plan_spans_parts_steps_as_over_one(monkeypatch):
    """mtapply.torch.Prodigy whose one plan spans devices (parts of one GPU standing in): its
    step counted on the host, each part's sums shared, the same params as one plan's."""
    import mtapply.torch as mt

    one, split = _prodigy_models(), _prodigy_models()
    theirs = mt.Prodigy(_params(one), weight_decay=0.01)
    ours = mt.Prodigy(_params(split), weight_decay=0.01)
    _train(one, theirs, 6)
    original = mtapply.plan._parts_by_device
    monkeypatch.setattr(mtapply.plan, "_parts_by_device", lambda params: [
        (0, np.arange(len(params))[k::2]) for k in (0, 1)] if len(params) > 1 else original(params))
    _train(split, ours, 6)
    (part,) = ours._bound[0].parts
    assert part.plan.spans_devices and part.host_counter
    step = ours.state[_params(split)[0]]["step"]
    assert step.device.type == "cpu" and float(step) == 6.0
    for p, q in zip(_params(split), _params(one)):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7)
    assert float(ours.state[_params(split)[0]]["d"]) > 1e-6  # d grew

    scaler = torch.amp.GradScaler("cuda", init_scale=4.0)
    ours.zero_grad()
    scaler.scale(split[1](split[0](torch.randn(4, 20, device="cuda")).tanh()).sum()).backward()
    before = [p.clone() for p in _params(split)]
    with pytest.raises(ValueError, match="over params on several GPUs takes no GradScaler"):
        scaler.step(ours)
    assert all(torch.equal(p, q) for p, q in zip(_params(split), before))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_torch_optimizer_over_a_model_split_over_two_gpus_steps_as_over_one():
    """mtapply.torch.Prodigy over a model whose layers are on two GPUs: one plan over both,
    every device with the same d, the params as on one GPU."""
    import mtapply.torch as mt

    one, split = _prodigy_models(), _prodigy_models(("cuda:0", "cuda:1"))
    theirs = mt.Prodigy(_params(one), weight_decay=0.01)
    ours = mt.Prodigy(_params(split), weight_decay=0.01)
    _train(one, theirs, 6)
    _train(split, ours, 6)
    (part,) = ours._bound[0].parts
    assert part.plan.spans_devices and part.host_counter
    for p, q in zip(_params(split), _params(one)):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=2e-5, atol=1e-7)


def test_a_value_that_only_a_later_part_holds_is_refused_with_nothing_written(monkeypatch):
    """Every part (device) checks its per-tensor values before any part launches: an lr that
    only the second part's tensors take and that overflows float32 is refused, the first
    part's tensors unwritten. (Rules with whole-list sums or scalar state take one value of
    each hyperparameter for all tensors.)"""
    rule = library.adam()
    monkeypatch.setattr(mtapply.plan, "_parts_by_device", lambda params: [
        (0, np.arange(len(params))[k::2]) for k in (0, 1)])
    columns = _lists(rule, ["cuda:0"] * len(SHAPES), torch.float32)
    plan = rule.plan(*columns.values())
    assert len(plan._cuda.parts) == 2
    plan.step(step=1, lr=[1e-2] * len(SHAPES))
    torch.cuda.synchronize()
    before = {slot: [t.clone() for t in values] for slot, values in columns.items()}
    lrs = [1e-2] * (len(SHAPES) - 1) + [1e39]  # the last tensor is the second part's
    with pytest.raises(ValueError, match="lr overflows float32"):
        plan.step(step=2, lr=lrs)
    torch.cuda.synchronize()
    for slot, values in columns.items():
        for k, (got, want) in enumerate(zip(values, before[slot])):
            assert torch.equal(got, want), f"{slot}[{k}] was written"
    plan.step(step=2, lr=[1e-2] * len(SHAPES))  # the plan steps on
    torch.cuda.synchronize()
    assert not torch.equal(columns["param"][0], before["param"][0])
