"""Plans that count their steps (`Plan.count_steps`): the step's own launches read the counter
plus one and advance it, once per step over all launches and passes, unless found_inf is set."""
import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
from _helpers import adam_state  # noqa: E402

CHUNK = mtapply._source.CHUNK_ELEMENTS
SHAPES = [(1000,), (CHUNK * 3 + 7,), (0,), (5, 7), (CHUNK + 1,)]


def _mixed_adam_state(seed: int):
    """Params of two dtypes (two launch groups), with float32 states."""
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=seed)
    half = [p.to(torch.bfloat16) for p in params[:2]]
    return half + params[2:], [g.to(torch.bfloat16) for g in grads[:2]] + grads[2:], ms, vs


def _twins(lists):
    return [[t.clone() for t in ts] for ts in lists]


def _assert_equal(got: list, want: list) -> None:
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {k} differs"
        if a.numel():
            assert a.reshape(-1)[0] == b.reshape(-1)[0] and a.reshape(-1)[-1] == b.reshape(-1)[-1]


def test_counted_steps_equal_explicit_steps_over_launch_groups():
    lists = _mixed_adam_state(seed=1)
    twin = _twins(lists)
    counter = torch.tensor(2.0, device="cuda")  # two steps were taken before
    plan = mtapply.adam_plan(*lists, decoupled_weight_decay=True)
    plan.count_steps(counter)
    explicit = mtapply.adam_plan(*twin, decoupled_weight_decay=True)
    for t in range(3, 9):
        lr = 1e-2 if t < 6 else 5e-3  # a scheduled lr renumbers the repeat
        plan.step(lr=lr, weight_decay=0.1)
        explicit.step(lr=lr, step=t, weight_decay=0.1)
    assert plan._repeat is not None  # the later steps repeated the launches
    assert len(plan._cuda.launch_order()) == 2
    torch.cuda.synchronize()
    assert float(counter) == 8.0
    _assert_equal(lists[0], twin[0])
    _assert_equal(lists[2], twin[2])


def test_found_inf_skips_the_update_and_the_count():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=2)
    twin = _twins((params, grads, ms, vs))
    before = [p.clone() for p in params]
    counter = torch.zeros((), device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.count_steps(counter)
    for flag in (0.0, 1.0, 0.0, 1.0):
        found_inf.fill_(flag)
        plan.step(lr=1e-2, found_inf=found_inf)
    torch.cuda.synchronize()
    assert float(counter) == 2.0
    explicit = mtapply.adam_plan(*twin)
    for t in (1, 2):
        explicit.step(lr=1e-2, step=t)
    _assert_equal(params, twin[0])
    assert not any(torch.equal(a, b) for a, b in zip(params, before) if a.numel())


def test_a_two_pass_op_counts_once_per_step():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=3)
    twin = _twins((params, grads, ms, vs))
    counter = torch.zeros(1, device="cuda")
    plan = mtapply.lamb_plan(params, grads, ms, vs)
    plan.count_steps(counter)
    explicit = mtapply.lamb_plan(*twin)
    for t in range(1, 5):
        plan.step(lr=1e-2)
        explicit.step(lr=1e-2, step=t)
    torch.cuda.synchronize()
    assert float(counter) == 4.0
    _assert_equal(params, twin[0])


def test_per_tensor_rows_and_stochastic_rounding_read_the_count():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=4)
    params = [p.to(torch.bfloat16) for p in params]
    grads = [g.to(torch.bfloat16) for g in grads]
    twin = _twins((params, grads, ms, vs))
    lrs = [1e-2, 2e-2, 3e-2, 4e-2, 5e-2]
    counter = torch.zeros(1, device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs, stochastic_rounding=True)
    plan.count_steps(counter)
    explicit = mtapply.adam_plan(*twin, stochastic_rounding=True)
    for t in range(1, 5):
        plan.step(lr=lrs, seed=7)
        explicit.step(lr=lrs, step=t, seed=7)
    torch.cuda.synchronize()
    assert float(counter) == 4.0
    _assert_equal(params, twin[0])


def test_sgd_with_stochastic_rounding_counts():
    g = torch.Generator(device="cuda").manual_seed(5)
    params = [torch.randn(s, generator=g, device="cuda").to(torch.bfloat16) for s in SHAPES]
    grads = [torch.randn(s, generator=g, device="cuda").to(torch.bfloat16) for s in SHAPES]
    bufs = [torch.randn(s, generator=g, device="cuda") for s in SHAPES]
    twin = _twins((params, grads, bufs))
    counter = torch.ones(1, device="cuda")
    plan = mtapply.sgd_plan(params, grads, bufs, stochastic_rounding=True)
    plan.count_steps(counter)
    explicit = mtapply.sgd_plan(*twin, stochastic_rounding=True)
    for t in range(2, 6):
        plan.step(lr=1e-2, momentum=0.9, seed=3)
        explicit.step(lr=1e-2, momentum=0.9, step=t, seed=3)
    torch.cuda.synchronize()
    assert float(counter) == 5.0
    _assert_equal(params, twin[0])


def test_a_plan_with_nothing_to_launch_still_counts():
    params, grads, ms, vs, _ = adam_state([(0,), (0,)], seed=6)
    counter = torch.zeros(1, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.count_steps(counter)
    for flag in (0.0, 1.0, 0.0):
        found_inf.fill_(flag)
        plan.step(lr=1e-2, found_inf=found_inf)
    torch.cuda.synchronize()
    assert float(counter) == 2.0


def test_counted_steps_replay_in_a_cuda_graph():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=8)
    twin = _twins((params, grads, ms, vs))
    counter = torch.zeros(1, device="cuda")
    lr = torch.full((1,), 1e-2, device="cuda")
    plan = mtapply.adam_plan(params, grads, ms, vs)
    plan.count_steps(counter)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.step(lr=lr)  # warm-up: compiles and uploads
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr)
    for _ in range(4):
        graph.replay()
    explicit = mtapply.adam_plan(*twin)
    for t in range(1, 6):
        explicit.step(lr=float(np.float32(1e-2)), step=t)
    torch.cuda.synchronize()
    assert float(counter) == 5.0
    _assert_equal(params, twin[0])


def test_bad_counters_and_steps_are_refused_before_any_write():
    params, grads, ms, vs, _ = adam_state(SHAPES, seed=9)
    before = [p.clone() for p in params]
    plan = mtapply.adam_plan(params, grads, ms, vs)
    with pytest.raises(ValueError, match="counter must be a writable one-element float32"):
        plan.count_steps(torch.zeros(1, device="cuda", dtype=torch.float64))
    with pytest.raises(ValueError, match="counter must be a writable one-element float32"):
        plan.count_steps(torch.zeros(2, device="cuda"))
    counter = torch.zeros(1, device="cuda")
    plan.count_steps(counter)
    with pytest.raises(ValueError, match="step: this plan counts its steps"):
        plan.step(lr=1e-2, step=3)
    with pytest.raises(ValueError, match="lr"):
        plan.step(lr=-1.0)
    torch.cuda.synchronize()
    assert float(counter) == 0.0
    _assert_equal(params, before)


def test_a_plan_without_tensors_counts_in_a_device_counter():
    counter = torch.zeros(1, device="cuda")
    plan = mtapply.adam_plan([], [], [], [])
    plan.count_steps(counter)
    for _ in range(3):
        plan.step(lr=1e-2)
    plan.step(lr=1e-2, found_inf=1.0)
    torch.cuda.synchronize()
    assert float(counter) == 3.0


@pytest.mark.parametrize("flat_grads", [False, True])
def test_a_torch_param_without_elements_counts_its_steps(flat_grads):
    """Its plan launches nothing, so an add advances its count: a repeated flat_grads step
    takes the whole path for it."""
    mt = pytest.importorskip("mtapply.torch")
    empty = torch.nn.Parameter(torch.empty(0, device="cuda"))
    full = torch.nn.Parameter(torch.randn(300, device="cuda"))
    opt = mt.AdamW([{"params": [empty]}, {"params": [full], "amsgrad": True}], lr=1e-2,
                   flat_grads=flat_grads)
    if flat_grads:
        opt.zero_grad()  # the flat buffers' views become the grads here
    for p in (empty, full):
        p.grad = torch.ones_like(p) if not flat_grads else p.grad.fill_(1.0)
    for _ in range(4):
        for buffer in (opt._flat.buffers if flat_grads else ()):
            torch.autograd.graph.increment_version(buffer)  # as backward's writes do
        opt.step()
    torch.cuda.synchronize()
    assert float(opt.state[empty]["step"]) == 4.0 and float(opt.state[full]["step"]) == 4.0
