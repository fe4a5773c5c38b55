"""Engine behaviour on the GPU: lists, alignment, device scalars, graphs, streams, sizes."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtapply

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
from _helpers import adam_state, assert_matches, reference_step, to64  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SPECIAL = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]


def views(sizes, offsets, dtype, seed):
    """Tensors of `sizes`, each a view at element `offset` of a larger random buffer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    out = []
    for n, off in zip(sizes, offsets):
        base = torch.randn(n + off + 1, generator=g, device="cuda").to(dt)
        out.append(base[off:off + n])
    return out


@st.composite
def tensor_lists(draw):
    count = draw(st.integers(0, 5000))
    budget = 2**22
    sizes = []
    for _ in range(count):
        if draw(st.booleans()):
            n = draw(st.sampled_from(SPECIAL))
        else:
            n = draw(st.integers(0, 2**20 if budget > 2**20 else 4096))
        n = min(n, max(budget, 0))
        budget -= n
        sizes.append(n)
    aligned = draw(st.booleans())
    offsets = [0 if aligned else draw(st.integers(0, 3)) for _ in sizes]
    return sizes, offsets


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(lists=tensor_lists(), dtype=st.sampled_from(["float32", "bfloat16"]),
       amsgrad=st.booleans(), mode=st.sampled_from(["memcpy", "unified"]), seed=st.integers(0, 2**16))
def test_drawn_lists_match_reference(lists, dtype, amsgrad, mode, seed):
    sizes, offsets = lists
    params, grads, ms, vs, vmax = (views(sizes, offsets, dtype, seed + k) for k in range(5))
    for v in vs + vmax:
        v.abs_()
    kw = dict(lr=1e-2, step=2, weight_decay=0.05, eps=1e-3)
    expected = reference_step(params, grads, ms, vs, vmax if amsgrad else None, amsgrad=amsgrad, **kw)
    mtapply.adam_step(params, grads, ms, vs, max_exp_avg_sqs=vmax if amsgrad else None,
                      amsgrad=amsgrad, table_mode=mode, **kw)
    torch.cuda.synchronize()
    scale = 2.0 if dtype == "bfloat16" else 1.0
    for i, (p, m, v, x) in enumerate(expected):
        assert_matches(params[i], p, dtype, f"params[{i}]", scale)
        assert_matches(ms[i], m, dtype, f"exp_avgs[{i}]", scale)
        assert_matches(vs[i], v, dtype, f"exp_avg_sqs[{i}]", scale)
        if amsgrad:
            assert_matches(vmax[i], x, dtype, f"max_exp_avg_sqs[{i}]", scale)


def test_misaligned_views_give_the_aligned_results():
    sizes = [1, 17, CHUNK + 5, 1000]
    aligned = views(sizes, [0] * 4, "float32", 7)
    shifted = [torch.empty(n + 1, device="cuda")[1:] for n in sizes]
    for a, s in zip(aligned, shifted):
        s.copy_(a)
    results = []
    for params in (aligned, shifted):
        grads = [torch.ones_like(p) * 0.5 for p in params]
        mtapply.adam_step(params, grads, [torch.ones_like(p) * 0.1 for p in params],
                          [torch.ones_like(p) * 0.2 for p in params], lr=1e-2, step=1)
        results.append([to64(p) for p in params])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_empty_list_and_empty_tensors_anywhere():
    mtapply.adam_step([], [], [], [], lr=1e-3, step=1)
    for layout in ([0, 100, 5], [100, 0, 5], [100, 5, 0], [0, 0, 0]):
        params, grads, ms, vs, _ = adam_state([(n,) for n in layout], seed=8)
        expected = reference_step(params, grads, ms, vs, None, lr=1e-2, step=1)
        mtapply.adam_step(params, grads, ms, vs, lr=1e-2, step=1)
        for i, e in enumerate(expected):
            assert_matches(params[i], e[0], "float32", f"params[{i}] of {layout}")


@pytest.mark.parametrize("maker", ["torch", "cupy"])
def test_device_scalar_lr_and_step(maker):
    params, grads, ms, vs, _ = adam_state([(1000,), (CHUNK + 1,)], seed=9)
    twin = [[t.clone() for t in ts] for ts in (params, grads, ms, vs)]
    if maker == "torch":
        lr, step = torch.tensor([0.0], device="cuda"), torch.tensor([0.0], device="cuda")
    else:
        lr, step = cupy.zeros(1, dtype=cupy.float32), cupy.zeros(1, dtype=cupy.float32)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan_twin = mtapply.adam_plan(*twin)
    for t in range(1, 6):
        lr.fill(0.01 * t) if maker == "cupy" else lr.fill_(0.01 * t)
        step.fill(t) if maker == "cupy" else step.fill_(t)
        plan.step(lr=lr, step=step, weight_decay=0.01)
        plan_twin.step(lr=float(np.float32(0.01 * t)), step=t, weight_decay=0.01)
    torch.cuda.synchronize()
    for a, b in zip(params, twin[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_device_scalar_must_be_float32_one_element():
    params, grads, ms, vs, _ = adam_state([(10,)], seed=1)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    with pytest.raises(ValueError, match="lr"):
        plan.step(lr=torch.ones(2, device="cuda"), step=1)
    with pytest.raises(ValueError, match="step"):
        plan.step(lr=1e-3, step=torch.ones(1, device="cuda", dtype=torch.float64))


def test_torch_cuda_graph_capture_and_replay():
    params, grads, ms, vs, _ = adam_state([(1000,), (CHUNK * 3 + 7,), (0,)], seed=11)
    twin = [[t.clone() for t in ts] for ts in (params, grads, ms, vs)]
    lr = torch.tensor([1e-2], device="cuda")
    step = torch.tensor([0.0], device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.add_(1)
        plan.step(lr=lr, step=step)  # warm-up step (also compiles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.add_(1)
        plan.step(lr=lr, step=step)
    for _ in range(4):
        graph.replay()
    plan_twin = mtapply.adam_plan(*twin)
    for t in range(1, 6):
        plan_twin.step(lr=float(np.float32(1e-2)), step=t)
    torch.cuda.synchronize()
    assert step.item() == 5
    for a, b in zip(params, twin[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cupy_graph_capture_and_replay():
    shapes = [(777,), (CHUNK + 9,)]
    rng = cupy.random.default_rng(3)
    make = lambda: [rng.standard_normal(s, dtype=cupy.float32) for s in shapes]  # noqa: E731
    params, grads, ms, vs = make(), make(), make(), [abs(v) for v in make()]
    twin = [[t.copy() for t in ts] for ts in (params, grads, ms, vs)]
    stream = cupy.cuda.Stream(non_blocking=True)
    lr = cupy.full(1, 1e-2, dtype=cupy.float32)
    step = cupy.zeros(1, dtype=cupy.float32)
    with stream:
        plan = mtapply.adam_plan(params, grads, ms, vs)
        step += 1
        plan.step(lr=lr, step=step)
        stream.begin_capture()
        step += 1
        plan.step(lr=lr, step=step)
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch()
    stream.synchronize()
    plan_twin = mtapply.adam_plan(*twin)
    for t in range(1, 5):
        plan_twin.step(lr=float(np.float32(1e-2)), step=t)
    cupy.cuda.Device().synchronize()
    assert float(step[0]) == 4
    for a, b in zip(params, twin[0]):
        cupy.testing.assert_array_equal(a, b)


def test_table_upload_during_capture_is_refused_with_a_clear_error():
    params, grads, ms, vs, _ = adam_state([(100,)], seed=12)
    plan = mtapply.adam_plan(params, grads, ms, vs, table_mode="memcpy")
    plan.step(lr=1e-3, step=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captur"):
        with torch.cuda.graph(graph, stream=s):
            plan.rebind("grads", [g.clone() for g in grads])
    torch.cuda.synchronize()
    plan.step(lr=1e-3, step=2)  # the plan still works after the refusal


def test_launches_on_the_current_torch_stream_and_orders_with_it():
    shapes = [(2**20,), (4097,)]
    params, grads, ms, vs, _ = adam_state(shapes, seed=13)
    twin_p, twin_g, twin_m, twin_v, _ = adam_state(shapes, seed=13)
    for g in twin_g:
        g.fill_(0.25)
    expected = reference_step(twin_p, twin_g, twin_m, twin_v, None, lr=1e-2, step=1)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert mtapply._launch.stream_pointer(None, "torch", 0) == side.cuda_stream
        torch.cuda._sleep(50_000_000)  # delays the grads written below on this stream
        for g in grads:
            g.fill_(0.25)
        plan.step(lr=1e-2, step=1)  # reads the new grads only if ordered on `side`
    side.synchronize()
    for i, e in enumerate(expected):
        assert_matches(params[i], e[0], "float32", f"params[{i}]")


def test_explicit_stream_argument():
    params, grads, ms, vs, _ = adam_state([(5000,)], seed=14)
    expected = reference_step(params, grads, ms, vs, None, lr=1e-2, step=1)
    s = cupy.cuda.Stream(non_blocking=True)
    torch.cuda.synchronize()
    mtapply.adam_step(params, grads, ms, vs, lr=1e-2, step=1, stream=s)
    s.synchronize()
    assert_matches(params[0], expected[0][0], "float32", "params[0]")


def test_step_does_not_synchronise_the_host():
    params, grads, ms, vs, _ = adam_state([(1000,)] * 10, seed=15)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.step(lr=1e-3, step=1)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the step
    busy = torch.cuda.Event()
    busy.record(stream)
    plan.step(lr=1e-3, step=2)
    plan.rebind("grads", [g.clone() for g in grads])  # a table re-upload must not wait either
    plan.step(lr=1e-3, step=3)
    assert not busy.query(), "step() waited for earlier GPU work"
    torch.cuda.synchronize()


def test_hundred_thousand_tensors_in_one_launch():
    n = 100_000
    params, grads, ms, vs, _ = adam_state([(int(k % 7) + 1,) for k in range(n)], seed=16)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    assert [passes[0].n_blocks for passes in plan._cuda.launches] == [n]
    launches = []
    original = mtapply._launch.KernelLaunch.launch
    mtapply._launch.KernelLaunch.launch = lambda self, s: (launches.append(s), original(self, s))[1]
    try:
        flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads, ms, vs)]
        expected = mtapply.reference.adam(*(to64(f) for f in flat), lr=1e-2, step=1)
        plan.step(lr=1e-2, step=1)
    finally:
        mtapply._launch.KernelLaunch.launch = original
    assert len(launches) == 1
    got = to64(torch.cat([p.reshape(-1) for p in params]))
    np.testing.assert_allclose(got, expected[0], rtol=1.3e-6, atol=1e-5)


def test_rebind_grads_keeps_the_rest():
    params, grads, ms, vs, _ = adam_state([(300,), (CHUNK + 2,)], seed=17)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.step(lr=1e-2, step=1)
    new_grads = [torch.randn_like(g) for g in grads]
    expected = reference_step(params, new_grads, ms, vs, None, lr=1e-2, step=2)
    plan.rebind("grads", new_grads)
    plan.step(lr=1e-2, step=2)
    for i, e in enumerate(expected):
        assert_matches(params[i], e[0], "float32", f"params[{i}]")
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        plan.rebind("grads", [new_grads[0], torch.randn(5, device="cuda")])


def test_cpu_tensor_among_gpu_tensors_is_refused_before_any_write():
    params, grads, ms, vs, _ = adam_state([(10,), (20,)], seed=18)
    before = [p.clone() for p in params]
    grads[1] = grads[1].cpu()
    with pytest.raises(ValueError, match=r"grads\[1\].*cpu"):
        mtapply.adam_step(params, grads, ms, vs, lr=1e-2, step=1)
    for a, b in zip(params, before):
        assert torch.equal(a, b)


def test_tensor_above_two_to_the_31_elements():
    n = 2**31 + 1000
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * 2 * n + 2**30:
        pytest.skip("needs about 17 GB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(19)
    p = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    gr = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16) * 0.1
    v = torch.rand(n, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01
    idx = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, n - 2, n - 1], device="cuda")
    before = [t[idx].clone() for t in (p, gr, m, v)]
    expected = mtapply.reference.adam(*(to64(b) for b in before), lr=1e-2, step=1)
    mtapply.adam_step([p], [gr], [m], [v], lr=1e-2, step=1)
    assert_matches(p[idx], expected[0], "bfloat16", "params at the 2**31 boundary", 2.0)
    assert_matches(m[idx], expected[1], "bfloat16", "exp_avgs at the 2**31 boundary", 2.0)
    assert not torch.equal(p[idx], before[0])


def test_a_repeated_step_launches_again_and_follows_the_reference(monkeypatch):
    """A step given what the latest one was given (the same numbers, the same device arrays)
    launches the same kernels without packing their arguments again; a new lr is checked and
    written into the same launches' words; a rebind or another stream takes the whole first-step
    path. Each step against the float64 reference."""
    from mtapply._launch import KernelLaunch

    packs, first_steps = [], []  # argument words written: all of them, or one new number's
    set_args, set_number = KernelLaunch.set_args, KernelLaunch.set_number
    monkeypatch.setattr(KernelLaunch, "set_args",
                        lambda self, *a, **k: packs.append(1) or set_args(self, *a, **k))
    monkeypatch.setattr(KernelLaunch, "set_number",
                        lambda self, *a: packs.append(1) or set_number(self, *a))
    from mtapply import plan as plan_module

    rows = plan_module.Plan._rows
    monkeypatch.setattr(plan_module.Plan, "_rows",
                        lambda self, hyper: first_steps.append(1) or rows(self, hyper))
    params, grads, ms, vs, _ = adam_state([(1000,), (CHUNK + 3,), (0,), (5,)], seed=21)
    counter = torch.tensor([0.0], device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    side = torch.cuda.Stream()
    for t, (lr, rebind, on_side) in enumerate([(1e-2, False, False), (1e-2, False, False),
                                               (1e-2, False, False), (2e-2, False, False),
                                               (2e-2, True, False), (2e-2, False, True)], 1):
        if rebind:
            grads = [torch.randn_like(g) for g in grads]
            plan.rebind("grads", grads)
        expected = reference_step(params, grads, ms, vs, None, lr=lr, step=t, weight_decay=0.1)
        counter.fill_(t)
        before = len(packs)
        if on_side:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                plan.step(lr=lr, step=counter, weight_decay=0.1)
            torch.cuda.current_stream().wait_stream(side)
        else:
            plan.step(lr=lr, step=counter, weight_decay=0.1)
        assert (len(packs) == before) == (t in (2, 3)), t  # repeated at steps 2 and 3 only
        assert len(first_steps) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 3}[t], t  # 4: renumbered
        for i, e in enumerate(expected):
            assert_matches(params[i], e[0], "float32", f"step {t} params[{i}]")
            assert_matches(vs[i], e[2], "float32", f"step {t} exp_avg_sqs[{i}]")
    plan.step(lr=2e-2, step=counter, weight_decay=0.1)  # the latest step, on the current stream
    torch.cuda.synchronize()
    kept, seen = [p.clone() for p in params], len(first_steps)
    with pytest.raises(ValueError, match="lr"):  # a renumbered step checks its numbers
        plan.step(lr=-1.0, step=counter, weight_decay=0.1)
    torch.cuda.synchronize()
    assert len(first_steps) == seen and all(torch.equal(a, b) for a, b in zip(params, kept))


def test_a_repeated_step_with_per_tensor_values_follows_the_reference(monkeypatch):
    """Per-tensor values as a tuple (which cannot change in place) repeat by identity; a list
    is compared by value every step, so an edit in place is seen: new lrs, one value still per
    row, reach the rows' slots without packing the launches again."""
    from mtapply._launch import KernelLaunch

    packs = []
    set_args = KernelLaunch.set_args
    monkeypatch.setattr(KernelLaunch, "set_args",
                        lambda self, *a, **k: packs.append(1) or set_args(self, *a, **k))
    params, grads, ms, vs, _ = adam_state([(700,), (CHUNK + 5,), (9,)], seed=23)
    plan = mtapply.adam_plan(params, grads, ms, vs)
    counter = torch.tensor([0.0], device="cuda")
    lrs = (1e-2, 2e-2, 3e-2)
    as_list = [1e-2, 2e-2, 3e-2]
    for t, (lr, repeats) in enumerate([(lrs, False), (lrs, True), (as_list, True),
                                       (as_list, True)], 1):
        if t == 4:
            as_list[1] = 5e-2  # edited in place: read again
        expected = [reference_step([p], [g], [m], [v], None, lr=r, step=t)[0]
                    for p, g, m, v, r in zip(params, grads, ms, vs, lr)]
        counter.fill_(t)
        before = len(packs)
        plan.step(lr=lr, step=counter)
        assert (len(packs) == before) == repeats, t
        for i, e in enumerate(expected):
            assert_matches(params[i], e[0], "float32", f"step {t} params[{i}]")
