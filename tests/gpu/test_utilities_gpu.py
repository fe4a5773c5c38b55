"""List utilities on the GPU: norms, clipping, unscale, scale, add and zero against float64 and
torch."""
import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import count_launches  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(0,), (1,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (278011,), (555, 555), (2048 * 32 + 1,), (0,)]


def _lists(dtypes=("float32",), scale=1.0, shapes=SHAPES, seed=None):
    """Random tensors; dtypes cycle over the list, so several dtypes make several groups."""
    g = torch.Generator(device="cuda").manual_seed(seed if seed is not None else np.random.randint(1 << 30))
    return [(torch.randn(s, generator=g, device="cuda") * scale).to(getattr(torch, dtypes[i % len(dtypes)]))
            for i, s in enumerate(shapes)]


def _norms64(tensors) -> np.ndarray:
    return np.array([float(t.double().pow(2).sum().sqrt()) for t in tensors])


@pytest.mark.parametrize("dtypes", [("float32",), ("bfloat16",), ("float16",), ("float64",),
                                    ("float32", "bfloat16", "float16")], ids="-".join)
def test_l2_norms_match_float64_in_the_callers_order(dtypes):
    tensors = _lists(dtypes)
    norms = torch.full((len(tensors),), float("nan"), device="cuda")
    total = torch.full((1,), float("nan"), device="cuda")
    mtapply.l2_norms(tensors, norms_out=norms, total_out=total)
    expected = _norms64(tensors)
    np.testing.assert_allclose(norms.double().cpu().numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(float(total), np.sqrt(np.sum(expected ** 2)), rtol=1e-5)


def test_l2_norms_are_deterministic_and_one_launch_for_100k_tensors():
    sizes = np.random.default_rng(0).integers(0, 300, size=100_000)
    tensors = _lists(shapes=[(int(n),) for n in sizes], seed=3)
    runs = []
    for _ in range(3):
        count = count_launches(lambda: runs.append(mtapply.l2_norms(tensors)))
        assert count == 1
    for norms, total in runs[1:]:
        assert torch.equal(norms, runs[0][0]) and torch.equal(total, runs[0][1])
    expected = _norms64(tensors)
    np.testing.assert_allclose(runs[0][0].double().cpu().numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(float(runs[0][1]), np.sqrt(np.sum(expected ** 2)), rtol=1e-5)


def test_l2_norms_of_empty_tensors_are_zero():
    _, total = mtapply.l2_norms([torch.empty(0, device="cuda")] * 3, total_out=torch.full((1,), 7.0, device="cuda"))
    assert float(total) == 0.0


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "bfloat16")], ids="-".join)
def test_clip_grad_norm_matches_float64_and_torch(dtypes, max_norm):
    grads = _lists(dtypes)
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected_total = np.sqrt(np.sum(_norms64(grads) ** 2))
    coefficient = min(1.0, max_norm / (expected_total + 1e-6))
    expected = [g.double() * coefficient for g in grads]
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    total = mtapply.clip_grad_norm_(grads, max_norm)
    np.testing.assert_allclose(float(total), expected_total, rtol=1e-5)
    # torch rounds the norms of bf16 grads to bf16, so next to torch bf16 precision applies
    near_torch = 1.6e-2 if len(dtypes) > 1 else 1e-5
    for i, (g, p, want) in enumerate(zip(grads, params, expected)):
        rtol = 1.6e-2 if g.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(g.double(), want, rtol=rtol, atol=1e-6, msg=f"grads[{i}]")
        torch.testing.assert_close(g, p.grad, rtol=near_torch, atol=1e-5, msg=f"grads[{i}] vs torch")
        if g.numel() > 1:
            assert g.flatten()[0] != 0 and g.flatten()[-1] != 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
@pytest.mark.parametrize("as_array", [False, True], ids=["number", "array"])
def test_unscale_matches_torch_amp_bit_for_bit(dtype, poison, as_array):
    grads = _lists((dtype,), scale=256.0)
    if poison is not None:
        grads[5][-1] = poison  # the last element of a large tensor
    inv_scale = torch.full((1,), 1 / 256, device="cuda")
    expected = [(g.float() * inv_scale).to(g.dtype) for g in grads]  # fp32 math, then rounding
    if dtype != "bfloat16":  # torch's CUDA unscale has no bf16 kernel
        from_torch, torch_flag = [g.clone() for g in grads], torch.zeros(1, device="cuda")
        torch._amp_foreach_non_finite_check_and_unscale_(from_torch, torch_flag, inv_scale)
        assert float(torch_flag) == (0.0 if poison is None else 1.0)
        assert all(_same_bits(a, b) for a, b in zip(from_torch, expected))
    flag = torch.zeros(1, device="cuda")
    mtapply.unscale_(grads, inv_scale if as_array else 1 / 256, flag)
    assert float(flag) == (0.0 if poison is None else 1.0)
    for i, (a, b) in enumerate(zip(grads, expected)):
        assert _same_bits(a, b), f"grads[{i}]"


def _same_bits(a, b) -> bool:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(bits), b.view(bits))


def test_scale_into_outputs_and_zero():
    tensors = _lists(("float32", "bfloat16"))
    before = [t.clone() for t in tensors]
    outputs = [torch.full_like(t, float("nan")) for t in tensors]
    factor = torch.full((1,), -3.0, device="cuda")
    mtapply.scale_(tensors, factor, outputs=outputs)
    for t, b, o in zip(tensors, before, outputs):
        assert torch.equal(t, b) and torch.equal(o, (b.float() * -3.0).to(b.dtype))
    mtapply.zero_(outputs)
    assert all(not o.any() for o in outputs)


def test_add_a_number_or_a_device_value_skipped_where_found_inf_is_set():
    """add_ in place; a plan of AddSpec (as the torch optimizers advance their step counters)
    adds nothing while found_inf is non-zero."""
    tensors = _lists(("float32", "bfloat16", "float64"))
    before = [t.clone() for t in tensors]
    mtapply.add_(tensors, torch.full((1,), 0.5, device="cuda"))
    for t, b in zip(tensors, before):
        assert torch.equal(t, (b.double() + 0.5).to(b.dtype))
    counter = torch.tensor(3.0, device="cuda")
    plan = mtapply.Plan(mtapply.ops.AddSpec(), {"tensors": [counter]})
    found_inf = torch.zeros(1, device="cuda")
    for flag in (0.0, 1.0, 0.0, 2.0, 0.0):
        found_inf.fill_(flag)
        plan.step(value=1.0, found_inf=found_inf)
    assert float(counter) == 6.0


def test_norms_and_clipping_replay_in_a_cuda_graph():
    grads = _lists(("float32", "bfloat16"), seed=11)
    total = torch.zeros(1, device="cuda")
    eager = [g.clone() for g in grads]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mtapply.clip_grad_norm_(grads, 0.5, total_out=total)  # warm up: compiles, uploads tables
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mtapply.clip_grad_norm_(grads, 0.5, total_out=total)
    for k in range(3):
        fresh = _lists(("float32", "bfloat16"), seed=20 + k)
        for g, e, f in zip(grads, eager, fresh):
            g.copy_(f)
            e.copy_(f)
        graph.replay()
        eager_total = mtapply.clip_grad_norm_(eager, 0.5)
        torch.cuda.synchronize()
        assert torch.equal(total, eager_total)
        for g, e in zip(grads, eager):
            assert torch.equal(g, e)
