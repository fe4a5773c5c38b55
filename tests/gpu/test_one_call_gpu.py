"""The one-call API called every step: the plan of a recent call is reused, rebound when only
addresses move, and every check still holds before anything is written."""
import numpy as np
import pytest

import mtapply
from mtapply import _calls, _describe, _native

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
from _helpers import adam_state, assert_matches, reference_step, to64  # noqa: E402

SHAPES = [(1000, 7), (3,), (0,), (4097,), (65, 65), (1,)]


@pytest.fixture(autouse=True, params=["native", "accessors"])
def describer(request, monkeypatch):
    """Every test runs with the compiled torch describer and with torch's accessors."""
    if request.param == "native":
        assert _native.library("torch_describe") is not None
    else:
        monkeypatch.setattr(_describe, "_native_describer", lambda: None)
    _calls.forget()
    yield request.param
    _calls.forget()


def _plans():
    return [recent.plan for candidates in _calls._recent.values() for recent in candidates]


def test_repeated_calls_reuse_one_plan_and_match_the_reference():
    p, g, m, v, _ = adam_state(SHAPES, seed=1)
    for t in range(1, 6):
        want = reference_step(p, g, m, v, None, lr=1e-2, step=t, weight_decay=0.1,
                              decoupled_weight_decay=True)
        mtapply.adam_step(p, g, m, v, lr=1e-2, step=t, weight_decay=0.1,
                          decoupled_weight_decay=True)
        for i, (pi, mi, vi, _) in enumerate(want):
            assert_matches(p[i], pi, "float32", f"params[{i}] step {t}")
            assert_matches(m[i], mi, "float32", f"exp_avgs[{i}] step {t}")
            assert_matches(v[i], vi, "float32", f"exp_avg_sqs[{i}] step {t}")
    assert len(_plans()) == 1


def test_fresh_grads_rebind_the_plan():
    p, g, m, v, _ = adam_state(SHAPES, seed=2)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=1)
    plan = _plans()[0]
    for t in range(2, 5):
        fresh = [torch.randn_like(x) for x in g]  # new memory, as autograd gives each step
        want = reference_step(p, fresh, m, v, None, lr=1e-3, step=t)
        mtapply.adam_step(p, fresh, m, v, lr=1e-3, step=t)
        for i, (pi, _, _, _) in enumerate(want):
            assert_matches(p[i], pi, "float32", f"params[{i}] step {t}")
    assert _plans() == [plan]


def _snapshot(*lists):
    return [to64(t).copy() for tensors in lists for t in tensors]


def test_aliasing_new_addresses_are_refused_and_nothing_changes():
    p, g, m, v, _ = adam_state(SHAPES, seed=3)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=1)
    before = _snapshot(p, g, m, v)
    bad = list(m)
    bad[-1] = v[-1]  # the same tensor in two written slots
    with pytest.raises(ValueError, match=r"exp_avgs\[5\] and exp_avg_sqs\[5\] share memory|"
                                         r"exp_avg_sqs\[5\] and exp_avgs\[5\] share memory"):
        mtapply.adam_step(p, g, bad, v, lr=1e-3, step=2)
    torch.cuda.synchronize()
    for got, want in zip(_snapshot(p, g, m, v), before):
        np.testing.assert_array_equal(got, want)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=2)  # the plan keeps working


@pytest.mark.parametrize("change", ["shape", "dtype", "layout", "device"])
def test_changed_tensors_get_the_full_checks(change):
    p, g, m, v, _ = adam_state([(4, 6), (5,)], seed=4)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=1)
    before = _snapshot(p, m, v)
    if change == "shape":
        g = [g[0].reshape(6, 4), g[1]]
        match = r"grads\[0\] has shape \(6, 4\) but params\[0\] has \(4, 6\)"
    elif change == "dtype":
        g = [g[0], g[1].half()]
        match = None  # a grad of another dtype is a new dtype group: allowed, checked, run
    elif change == "layout":
        g = [torch.randn(6, 4, device="cuda").t(), g[1]]
        match = r"grads\[0\] has strides"
    else:
        g = [g[0], g[1].cpu()]
        match = r"grads\[1\] is on cpu but params\[1\] is on cuda:0"
    if match is None:
        mtapply.adam_step(p, g, m, v, lr=1e-3, step=2)
        return
    with pytest.raises(ValueError, match=match):
        mtapply.adam_step(p, g, m, v, lr=1e-3, step=2)
    torch.cuda.synchronize()
    for got, want in zip(_snapshot(p, m, v), before):
        np.testing.assert_array_equal(got, want)


def test_storage_swapped_under_the_same_tensor_is_followed():
    p, g, m, v, _ = adam_state([(300,), (40,)], seed=5)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=1)
    old = p[0].clone()
    p[0].data = torch.randn(300, device="cuda")  # the same object, new memory
    fresh = p[0].clone()
    want = reference_step(p, g, m, v, None, lr=1e-3, step=2)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=2)
    assert_matches(p[0], want[0][0], "float32", "params[0] after its storage moved")
    assert not torch.equal(p[0], fresh) and not torch.equal(p[0], old)


def test_cupy_arrays_known_by_identity_and_shape_reassignment():
    rng = cupy.random.default_rng(6)
    p, g, m = ([rng.standard_normal(n, dtype=cupy.float32) for n in (12, 5000)] for _ in range(3))
    v = [rng.random(n, dtype=cupy.float32) for n in (12, 5000)]
    for t in range(1, 4):
        want = [mtapply.reference.adam(cupy.asnumpy(a).astype(np.float64),
                                       cupy.asnumpy(b).astype(np.float64),
                                       cupy.asnumpy(c).astype(np.float64),
                                       cupy.asnumpy(d).astype(np.float64), lr=1e-3, step=t)[0]
                for a, b, c, d in zip(p, g, m, v)]
        mtapply.adam_step(p, g, m, v, lr=1e-3, step=t)
        for i, w in enumerate(want):
            np.testing.assert_allclose(cupy.asnumpy(p[i]), w, rtol=1.3e-6, atol=1e-5)
    assert len(_plans()) == 1
    for attribute, value in (("data", g[0].data), ("dtype", cupy.float16), ("size", 3)):
        with pytest.raises(AttributeError):  # what the identity path relies on
            setattr(g[0], attribute, value)
    g[0].shape = (3, 4)  # allowed in place: the call sees it
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(3, 4\) but params\[0\] has \(12,\)"):
        mtapply.adam_step(p, g, m, v, lr=1e-3, step=4)


def test_a_plan_captured_in_a_graph_keeps_its_tables():
    p, g, m, v, _ = adam_state([(2000,), (33,)], seed=7)
    others = [torch.randn_like(x) for x in g]
    lr = torch.full((1,), 1e-3, device="cuda")
    step = torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mtapply.adam_step(p, g, m, v, lr=lr, step=step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mtapply.adam_step(p, g, m, v, lr=lr, step=step)
    q = [x.clone() for x in p]
    mq, vq = [x.clone() for x in m], [x.clone() for x in v]
    mtapply.adam_step(q, others, mq, vq, lr=1e-3, step=1)  # other tensors of the same shapes
    expect = reference_step(p, g, m, v, None, lr=1e-3, step=1)
    graph.replay()  # still steps p with g
    torch.cuda.synchronize()
    for i, (pi, _, _, _) in enumerate(expect):
        assert_matches(p[i], pi, "float32", f"params[{i}] after a replay")


def test_a_caller_stream_waits_for_the_producer():
    p, g, m, v, _ = adam_state([(1 << 20,)], seed=8)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=1)
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # keep the current stream busy, then write the grads on it
    g[0].fill_(0.5)
    want = reference_step(p, [torch.full_like(g[0], 0.5)], m, v, None, lr=1e-3, step=2)
    mtapply.adam_step(p, g, m, v, lr=1e-3, step=2, stream=other)
    torch.cuda.synchronize()
    assert_matches(p[0], want[0][0], "float32", "params after a step on another stream")
