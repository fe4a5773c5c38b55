"""List utilities on the CPU backend: norms, clipping, scale, unscale, add, zero, against float64
and against torch's own functions where torch has one."""
import numpy as np
import pytest

import mtapply
from _registry import TOLERANCES, make_tensor, raw_bytes, to64

SHAPES = [(0,), (1,), (7,), (3, 5), (1000,), (0,)]


def _lists(dtype, lib, rng, shapes=SHAPES, scale=1.0):
    return [make_tensor(scale * rng.standard_normal(s), dtype, lib) for s in shapes]


def _norm64(t) -> float:
    return float(np.sqrt(np.sum(to64(t) ** 2)))


LIBS = [("numpy", "float32"), ("numpy", "float64"), ("numpy", "float16"), ("torch", "bfloat16"),
        ("torch", "float32")]


@pytest.mark.parametrize("lib,dtype", LIBS)
def test_l2_norms_match_float64(lib, dtype):
    if lib == "torch":
        pytest.importorskip("torch")
    tensors = _lists(dtype, lib, np.random.default_rng())
    norms, total = mtapply.l2_norms(tensors)
    expected = np.array([_norm64(t) for t in tensors])
    assert type(norms) is type(tensors[0]) and len(norms) == len(tensors)
    np.testing.assert_allclose(to64(norms), expected, rtol=2e-6)
    np.testing.assert_allclose(to64(total)[0], np.sqrt(np.sum(expected ** 2)), rtol=2e-6)


def test_l2_norms_into_given_outputs_and_of_empty_lists():
    rng = np.random.default_rng()
    tensors = _lists("float32", "numpy", rng)
    norms, total = np.full(len(tensors), np.nan, np.float32), np.full(1, np.nan, np.float32)
    got = mtapply.l2_norms(tensors, norms_out=norms, total_out=total)
    assert got[0] is norms and got[1] is total
    assert norms[0] == 0 and norms[-1] == 0 and np.isfinite(norms).all() and total[0] > 0
    empty_total = np.full(1, np.nan, np.float32)
    _, t = mtapply.l2_norms([np.zeros(0, np.float32)] * 3, total_out=empty_total)
    assert t[0] == 0
    n, t = mtapply.l2_norms([])
    assert len(n) == 0 and t[0] == 0


@pytest.mark.parametrize("bad,match", [
    (dict(total_out=np.zeros(2, np.float32)), "total_out must be .* 1 element"),
    (dict(total_out=np.zeros(1, np.float64)), "total_out must be .*float32"),
    (dict(norms_out=np.zeros(3, np.float32)), "norms_out must be .* 6 element"),
])
def test_bad_outputs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        mtapply.l2_norms(_lists("float32", "numpy", np.random.default_rng()), **bad)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clip_grad_norm_matches_float64_and_torch(dtype, max_norm):
    torch = pytest.importorskip("torch")
    grads = _lists(dtype, "torch", np.random.default_rng())
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    # torch takes bf16 norms of bf16 grads; ours are fp32 sums, so float64 is the judge
    expected_total = np.sqrt(sum(_norm64(g) ** 2 for g in grads))
    coefficient = min(1.0, max_norm / (expected_total + 1e-6))
    expected = [to64(g) * coefficient for g in grads]
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    total = mtapply.clip_grad_norm_(grads, max_norm)
    np.testing.assert_allclose(float(total[0]), expected_total, rtol=2e-6)
    rtol, atol = TOLERANCES[dtype]
    for g, p, want in zip(grads, params, expected):
        np.testing.assert_allclose(to64(g), want, rtol=rtol, atol=atol)
        np.testing.assert_allclose(to64(g), to64(p.grad), rtol=rtol, atol=atol)
    if max_norm > 1e5:  # far above the norm: a factor of exactly 1
        assert [raw_bytes(g) for g in grads] == [raw_bytes(p.grad) for p in params]


def test_clip_grad_norm_refuses_a_negative_max_norm_before_writing():
    grads = _lists("float32", "numpy", np.random.default_rng())
    before = [raw_bytes(g) for g in grads]
    with pytest.raises(ValueError, match="max_norm"):
        mtapply.clip_grad_norm_(grads, -1.0)
    assert [raw_bytes(g) for g in grads] == before


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_scale_in_place_and_into_outputs(dtype):
    rng = np.random.default_rng()
    tensors = _lists(dtype, "numpy", rng)
    originals = [t.copy() for t in tensors]
    outputs = [np.full_like(t, np.nan) for t in tensors]
    mtapply.scale_(tensors, -0.75, outputs=outputs)
    assert [raw_bytes(t) for t in tensors] == [raw_bytes(t) for t in originals]
    for out, t in zip(outputs, originals):
        np.testing.assert_array_equal(out, (t.astype(np.float64) * -0.75).astype(dtype))
    mtapply.scale_(tensors, 4.0)
    for t, o in zip(tensors, originals):
        np.testing.assert_array_equal(t, o * 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("poison", [None, np.inf, np.nan])
def test_unscale_matches_torch_amp(dtype, poison):
    torch = pytest.importorskip("torch")
    grads = _lists(dtype, "torch", np.random.default_rng(), scale=1024.0)
    if poison is not None:
        grads[4][-1] = poison
    expected = [g.clone() for g in grads]
    expected_flag = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_flag, torch.tensor([1 / 1024]))
    flag = torch.zeros(1)
    mtapply.unscale_(grads, 1 / 1024, flag)
    assert float(flag[0]) == float(expected_flag[0]) == (0.0 if poison is None else 1.0)
    assert [raw_bytes(g) for g in grads] == [raw_bytes(g) for g in expected]


def test_zero_sets_every_element():
    tensors = _lists("float32", "numpy", np.random.default_rng())
    mtapply.zero_(tensors)
    assert all(not t.any() for t in tensors)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_add_adds_a_number_and_refuses_a_bad_one_before_writing(dtype):
    tensors = _lists(dtype, "numpy", np.random.default_rng())
    originals = [t.copy() for t in tensors]
    mtapply.add_(tensors, -2.5)
    for t, o in zip(tensors, originals):
        np.testing.assert_array_equal(t, (o.astype(np.float64) - 2.5).astype(dtype))
    with pytest.raises(TypeError, match="value"):
        mtapply.add_(tensors, "1")
    for t, o in zip(tensors, originals):
        np.testing.assert_array_equal(t, (o.astype(np.float64) - 2.5).astype(dtype))
