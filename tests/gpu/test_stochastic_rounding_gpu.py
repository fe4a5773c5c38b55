"""Stochastic rounding on the GPU: the kernel's bfloat16 params against the CPU path (the same
Philox bits), for Adam and SGD, vector and scalar paths, a tensor of 2**20 + 3 elements (first
and last elements), and device steps replayed from a CUDA graph."""
import pytest

import mtapply

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPES = [(1 << 20 | 3,), (1000,), (7, 9), (0,), (5,)]


def _lists(seed, device):
    g = torch.Generator().manual_seed(seed)
    made = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES] for _ in range(2)]
    made += [[torch.randn(s, generator=g) * 0.1 for s in SHAPES],
             [torch.rand(s, generator=g) * 0.01 for s in SHAPES]]
    return [[x.to(device) for x in column] for column in made]


def _assert_same_bits(gpu, cpu, steps):
    """Equal but for values an fma moved across a rounding threshold: one bfloat16 ulp, which
    later steps carry, so at most one per step."""
    for k, (a, b) in enumerate(zip(gpu, cpu)):
        x = a.cpu().view(torch.int16).int().reshape(-1)
        y = b.view(torch.int16).int().reshape(-1)
        if not x.numel():
            continue
        assert (x - y).abs().max().item() <= steps, k
        assert (x == y).float().mean().item() >= 0.9999, k
        assert x[0] == y[0] and x[-1] == y[-1], k


@pytest.mark.parametrize("op", ["adamw", "sgd"])
def test_kernel_rounds_with_the_cpu_paths_bits(op):
    gpu, cpu = _lists(0, "cuda"), _lists(0, "cpu")
    before = gpu[0][0].clone()
    for lists in (gpu, cpu):
        for t in range(1, 4):
            if op == "adamw":
                mtapply.adam_step(*lists, lr=1e-3, step=t, weight_decay=0.01, seed=12345,
                                  decoupled_weight_decay=True, stochastic_rounding=True)
            else:
                mtapply.sgd_step(lists[0], lists[1], lists[2], lr=1e-2, step=t, momentum=0.9,
                                 seed=12345, stochastic_rounding=True)
    torch.cuda.synchronize()
    assert not torch.equal(gpu[0][0], before)
    _assert_same_bits(gpu[0], cpu[0], steps=3)


def test_device_steps_in_a_cuda_graph():
    gpu, cpu = _lists(1, "cuda"), _lists(1, "cpu")
    plan = mtapply.adam_plan(*gpu, stochastic_rounding=True)
    step = torch.ones(1, device="cuda")
    plan.step(lr=1e-3, step=step, seed=9)  # warm up outside the capture
    mtapply.adam_step(*cpu, lr=1e-3, step=1, seed=9, stochastic_rounding=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=1e-3, step=step, seed=9)
    for t in (2, 3, 4):
        step.fill_(t)
        graph.replay()
        mtapply.adam_step(*cpu, lr=1e-3, step=t, seed=9, stochastic_rounding=True)
    torch.cuda.synchronize()
    _assert_same_bits(gpu[0], cpu[0], steps=4)
