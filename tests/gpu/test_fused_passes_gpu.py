"""A rule whose first pass only sums over each tensor runs both passes in one launch
(kernels/walker.cuh, walk_fused): bit for bit what its two launches give, step after step."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtapply
from mtapply import rule
from mtapply._blocks import FUSED_LAG
from mtapply.rules._spec import SUMMING_CHUNK, SUMMING_CHUNK_16BIT

torch = pytest.importorskip("torch")
from _helpers import count_launches, to64  # noqa: E402


def shapes_around(chunk: int) -> list:
    """Tensors of one chunk, of none, of more chunks than the lag between a block's sums and its
    update (whose updates then wait for the tensor's last sums), and many small ones between."""
    return ([(1,), (0,), (chunk - 1,), (chunk + 3,), ((FUSED_LAG + 40) * chunk + 7,)]
            + [(int(k % 7) * 300 + 5,) for k in range(300)] + [(64, 3, 7, 7), (4 * chunk,)])


SHAPES = shapes_around(SUMMING_CHUNK)
SHAPES_16BIT = shapes_around(SUMMING_CHUNK_16BIT)  # where every slot is 16-bit, longer chunks
HYPER = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8)


def normalized_sgd():
    """A user's rule of per-tensor sums: each grad scaled to unit norm."""
    return rule("normalized_sgd", slots="param:rw grad:r", hyper=dict(lr=(None, "> 0")),
                sums={"g2": "grad * grad"}, finish="scale = where(g2 > 0, lr / sqrt(g2), 0)",
                update="param = param - scale * grad")


def _tensors(shapes, dtype, n_lists, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    return [[(torch.randn(s, generator=g, device="cuda") * 0.05).to(dt) for s in shapes]
            for _ in range(n_lists)]


def _twins(lists):
    return [[t.clone() for t in ts] for ts in lists]


def _two_passes(k):
    """A hook between the passes: the plan then launches them one by one."""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_lars_fused_equals_its_two_launches(dtype):
    fused = _tensors(SHAPES_16BIT if dtype == "bfloat16" else SHAPES, dtype, 3, seed=1)
    apart = _twins(fused)
    exclude = [len(p.shape) == 1 and p.numel() < 1000 for p in fused[0]]
    plans = [mtapply.lars_plan(*lists, exclude=exclude) for lists in (fused, apart)]
    for step in range(4):
        for a, b in zip(fused[1], apart[1]):
            a.copy_(torch.randn_like(a) * 0.01)
            b.copy_(a)
        assert count_launches(lambda: plans[0].step(**HYPER)) == 1
        assert count_launches(lambda: plans[1].step(after_pass=_two_passes, **HYPER)) == 2
        for name, x, y in (("params", fused[0], apart[0]), ("buffers", fused[2], apart[2])):
            for i, (a, b) in enumerate(zip(x, y)):
                assert torch.equal(a, b), f"{name}[{i}] differs at step {step + 1}"
        np.testing.assert_array_equal(plans[0].sums().get(), plans[1].sums().get())


def test_lamb_with_bfloat16_moments_fused_equals_its_two_launches():
    # float32 moments take the pair whose first pass stores them (two launches); 16-bit ones fuse
    params, grads = _tensors(SHAPES[:80], "float32", 2, seed=5)
    moments = _tensors(SHAPES[:80], "bfloat16", 2, seed=6)
    for v in moments[1]:
        v.abs_()
    fused = [params, grads, *moments]
    apart = _twins(fused)
    plans = [mtapply.lamb_plan(*lists) for lists in (fused, apart)]
    hyper = dict(lr=1e-2, weight_decay=0.01)
    for step in range(1, 4):
        assert count_launches(lambda: plans[0].step(step=step, **hyper)) == 1
        plans[1].step(step=step, after_pass=_two_passes, **hyper)
    for i, (a, b) in enumerate(zip(fused[0] + fused[2] + fused[3], apart[0] + apart[2] + apart[3])):
        assert torch.equal(a, b), f"tensor {i}"
    assert not torch.equal(fused[0][2], _tensors(SHAPES[:80], "float32", 1, seed=5)[0][2])


def test_a_users_rule_with_mixed_dtypes_and_unaligned_views():
    # two dtype groups (two fused launches, one after the other) and views that start one
    # element past an aligned address (the walker's element by element path)
    shapes = SHAPES[:40]
    lists = [_tensors(shapes, "float32", 2, seed=2)[k] + _tensors(shapes, "bfloat16", 2, seed=3)[k]
             for k in range(2)]

    def unaligned(lists):
        storage = [[torch.randn(t.numel() + 1, device="cuda").to(t.dtype) for t in ts] for ts in lists]
        return [[s[1:].view(t.shape).copy_(t) for s, t in zip(ss, ts)]
                for ss, ts in zip(storage, lists)]

    for fused, apart in ((lists, _twins(lists)), (unaligned(lists), unaligned(lists))):
        before = [to64(p) for p in fused[0]]
        sgd = normalized_sgd()
        plans = [sgd.plan(*ls) for ls in (fused, apart)]
        for _ in range(3):
            assert count_launches(lambda: plans[0].step(lr=1.0)) == 2  # one per dtype
            plans[1].step(lr=1.0, after_pass=_two_passes)
        for i, (a, b) in enumerate(zip(fused[0], apart[0])):
            assert torch.equal(a, b), f"params[{i}]"
            if a.numel():
                assert not np.array_equal(to64(a), before[i]), f"params[{i}] did not move"


def test_fused_steps_replay_in_a_graph_and_skip_on_found_inf():
    lists = _tensors(SHAPES[:60], "float32", 3, seed=4)
    twin = _twins(lists)
    found_inf = torch.zeros((), device="cuda")
    lr = torch.tensor([0.1], device="cuda")
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    plan = mtapply.lars_plan(*lists)
    plan.step(lr=lr, found_inf=found_inf, **hyper)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr, found_inf=found_inf, **hyper)
    for flag in (0.0, 1.0, 0.0, 0.0):
        found_inf.fill_(flag)
        graph.replay()
    plan_twin = mtapply.lars_plan(*twin)
    for _ in range(4):  # one eager step and three replays were not skipped
        plan_twin.step(lr=float(np.float32(0.1)), after_pass=_two_passes, **hyper)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(lists[0] + lists[2], twin[0] + twin[2])):
        assert torch.equal(a, b), f"tensor {i}"


SPECIAL = [0, 1, 3, 4, 5] + [n for chunk in (SUMMING_CHUNK, SUMMING_CHUNK_16BIT)
                             for n in (chunk - 1, chunk, chunk + 1, 3 * chunk + 4)]


@st.composite
def drawn_lists(draw):
    """Up to 600 sizes (at most 2**22 elements in all) and each one's offset into its buffer."""
    budget, sizes = 2**22, []
    for _ in range(draw(st.integers(0, 600))):
        n = draw(st.sampled_from(SPECIAL) if draw(st.booleans()) else st.integers(0, 2**20))
        n = min(n, budget)
        budget -= n
        sizes.append(n)
    aligned = draw(st.booleans())
    return sizes, [0 if aligned else draw(st.integers(0, 3)) for _ in sizes]


def _views(sizes, offsets, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(n + off + 1, generator=g, device="cuda") * 0.05).to(getattr(torch, dtype))
            [off:off + n] for n, off in zip(sizes, offsets)]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(lists=drawn_lists(), dtype=st.sampled_from(["float32", "bfloat16"]),
       mode=st.sampled_from(["memcpy", "unified"]), seed=st.integers(0, 2**16))
def test_drawn_lists_fused_equal_their_two_launches(lists, dtype, mode, seed):
    sizes, offsets = lists
    fused, apart = ([_views(sizes, offsets, dtype, seed + k) for k in range(3)] for _ in range(2))
    plans = [mtapply.lars_plan(*ls, table_mode=mode) for ls in (fused, apart)]
    for _ in range(2):
        plans[0].step(**HYPER)
        plans[1].step(after_pass=_two_passes, **HYPER)
    for i, (a, b) in enumerate(zip(fused[0] + fused[2], apart[0] + apart[2])):
        assert torch.equal(a, b), f"tensor {i} of {len(sizes)}"
