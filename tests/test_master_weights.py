"""fp32 master weights for 16-bit params, on every op: the master run equals an fp32 run.

The fp32 run starts from the master's values and takes the same (16-bit) grads, so its params
are what the master must hold; the 16-bit params must then be the master rounded to nearest.
"""
import numpy as np
import pytest

from _registry import OPS, raw_bytes

torch = pytest.importorskip("torch")

CHUNK = 4096
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CASES = [(op, OPS[op]["flag_sets"][-1], OPS[op]["hyper_sets"][1]) for op in OPS]
IDS = [op for op, _, _ in CASES]


def _shapes(device: str) -> list:
    if device == "cpu":
        return [(0,), (1,), (7,), (3, 5), (1000,), (0,)]
    return [(0,), (1,), (CHUNK - 1,), (CHUNK + 1,), (64, 3, 7, 7), (278011,), (0,)]


def _runs(op, flags, dtype, device):
    """(fp32 slots, 16-bit slots with masters): equal starting values, the same grads."""
    spec = OPS[op]["spec"](**flags)
    rng = np.random.default_rng()
    low = getattr(torch, dtype)
    fp32, mixed = {s: [] for s in spec.slots}, {s: [] for s in spec.slots}
    mixed["master_params"] = []
    for shape in _shapes(device):
        for s in spec.slots:
            values = (rng.standard_normal(shape) if s in ("params", "grads")
                      else OPS[op]["init_state"](s, shape, rng))
            t = torch.from_numpy(values).to(device=device, dtype=torch.float32)
            if s in ("params", "grads"):
                t = t.to(low).float()  # representable in 16 bits, so both runs start equal
                mixed[s].append(t.to(low))
            else:
                mixed[s].append(t.clone())
            fp32[s].append(t)
        mixed["master_params"].append(fp32["params"][-1].clone())
        mixed["params"][-1].fill_(float("nan"))  # never read with masters: must be written
    return fp32, mixed


def _same_grads(fp32, mixed, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    for a, b in zip(fp32["grads"], mixed["grads"]):
        fresh = torch.randn(a.shape, generator=g).to(b.dtype)
        b.copy_(fresh)
        a.copy_(fresh.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op,flags,hyper", CASES, ids=IDS)
def test_master_run_equals_fp32_run(op, flags, hyper, dtype, device):
    fp32, mixed = _runs(op, flags, dtype, device)
    reference = OPS[op]["plan"](**fp32, **flags)
    plan = OPS[op]["plan"](**mixed, **flags)
    for step in range(1, 4):
        _same_grads(fp32, mixed, step)
        reference.step(**hyper, step=step)
        plan.step(**hyper, step=step)
    # elementwise ops see bit-identical inputs; LARS/LAMB norms are sums whose order follows the
    # vector width (16 bytes of the narrowest slot), so on the GPU they may differ by roundings
    exact = device == "cpu" or op in ("adam", "sgd")
    for name in fp32:
        got = mixed["master_params"] if name == "params" else mixed[name]
        if name == "grads":
            continue
        for i, (a, b) in enumerate(zip(got, fp32[name])):
            if exact:
                assert raw_bytes(a.cpu()) == raw_bytes(b.cpu()), f"{name}[{i}]"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name}[{i}]")
    for i, (p, m) in enumerate(zip(mixed["params"], mixed["master_params"])):
        assert raw_bytes(p.cpu()) == raw_bytes(m.to(p.dtype).cpu()), f"params[{i}] is not the rounded master"
        if p.numel() > 1:
            assert not torch.isnan(p.flatten()[[0, -1]].float()).any()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bad,error,match", [
    ("master_dtype", TypeError, r"master_params\[4\] is torch.float16|master_params\[4\] is float16"),
    ("param_dtype", TypeError, r"params\[0\] is float32: master weights are for float16"),
    ("master_shape", ValueError, r"master_params\[4\] has shape"),
])
def test_bad_masters_are_refused_before_any_write(op, bad, error, match):
    fp32, mixed = _runs(op, OPS[op]["flag_sets"][-1], "bfloat16", "cpu")
    if bad == "master_dtype":
        mixed["master_params"][4] = mixed["master_params"][4].half()
    elif bad == "master_shape":
        mixed["master_params"][4] = mixed["master_params"][4].reshape(-1)[:-1].clone()
    else:
        mixed = dict(fp32, master_params=[p.clone() for p in fp32["params"]])
    before = {s: [raw_bytes(t) for t in column] for s, column in mixed.items()}
    with pytest.raises(error, match=match):
        OPS[op]["step"](**mixed, **OPS[op]["flag_sets"][-1], **OPS[op]["hyper_sets"][1], step=1)
    assert {s: [raw_bytes(t) for t in column] for s, column in mixed.items()} == before
