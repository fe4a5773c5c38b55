"""User-written rules on the GPU: the generated kernel against the rule's float64 definition
and its NumPy path, over lists with a big tensor (first and last elements checked), device
scalars, bf16 params with fp32 master weights, and a CUDA graph replay."""
import sys
from pathlib import Path

import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the CPU tests' rules
from test_rules import ADAGRAD, EVERYTHING, LION  # noqa: E402

SHAPES = [(10,), (3, 4), (0,), (1,), (257,), (1 << 20 | 3,)]


def _lists(n, seed, positive=(), device="cuda", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        column = [torch.randn(s, generator=g) for s in SHAPES]
        out.append([(x.abs() if k in positive else x).to(device, dtype) for x in column])
    return out


def _host(lists):
    return [[x.detach().cpu().numpy().copy() for x in column] for column in lists]


@pytest.mark.parametrize("name,definition,hyper,positive", [
    ("lion", LION, dict(lr=0.01, weight_decay=0.1), ()),
    ("adagrad", ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.05), (2,)),
    ("everything", EVERYTHING, dict(lr=0.1), (3,)),
])
def test_gpu_steps_match_the_cpu_path(name, definition, hyper, positive):
    rule = mtapply.rule(name, **definition)
    lists = _lists(len(rule.slots), 0, positive)
    host = _host(lists)
    for step in range(1, 6):
        rule.step(*lists, step=step, **hyper)
        rule.step(*host, step=step, **hyper)
    torch.cuda.synchronize()
    for k, slot in enumerate(rule.slots):
        for i, (got, want) in enumerate(zip(lists[k], host[k])):
            got = got.cpu().numpy()
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6,
                                       err_msg=f"{name}: {slot}[{i}]")
            if got.size:
                assert got.reshape(-1)[0] == pytest.approx(want.reshape(-1)[0], rel=2e-5, abs=2e-6)
                assert got.reshape(-1)[-1] == pytest.approx(want.reshape(-1)[-1], rel=2e-5,
                                                            abs=2e-6)


def test_device_scalars_and_a_cuda_graph():
    lion = mtapply.rule("lion", **LION)
    lists = _lists(3, 1)
    twin = [[x.clone() for x in column] for column in lists]
    lr = torch.full((1,), 0.01, device="cuda")
    plan = lion.plan(*lists)
    plan.step(lr=lr)  # warm up: compile and upload outside the capture
    lion.step(*twin, lr=0.01)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr)
    for value in (0.02, 0.005):
        lr.fill_(value)
        graph.replay()
        lion.step(*twin, lr=value)
    torch.cuda.synchronize()
    for got, want in zip(lists[0] + lists[2], twin[0] + twin[2]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_bf16_params_with_fp32_master_weights():
    lion = mtapply.rule("lion", **LION)
    params, grads, exp_avgs = _lists(3, 2)
    masters = [p.clone() for p in params]
    reference = [p.double() for p in params]
    ref_m = [m.double() for m in exp_avgs]
    params16 = [p.to(torch.bfloat16) for p in params]
    for _ in range(3):
        lion.step(params16, grads, exp_avgs, lr=0.01, master_params=masters)
        for i, g in enumerate(grads):
            c = 0.9 * ref_m[i] + 0.1 * g.double()
            reference[i] = reference[i] - 0.01 * torch.sign(c)
            ref_m[i] = 0.99 * ref_m[i] + 0.01 * g.double()
    torch.cuda.synchronize()
    for p16, master, want in zip(params16, masters, reference):
        torch.testing.assert_close(master.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p16, master.to(torch.bfloat16), rtol=0, atol=0)
