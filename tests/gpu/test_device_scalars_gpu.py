"""Device scalars on the GPU: a value out of the range its op declares (a NaN lr, a step of 0,
-1 or 1.5, an inf grad_scale, ...) is found by every block of every launch of the step before it
writes: nothing is written, a counting plan does not count, and `plan.invalid` is raised (read
without a sync). The same cases as tests/test_device_scalars.py (the CPU's), on CUDA tensors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import mtapply
from mtapply.plan import Plan
from mtapply.ops import AdamSpec

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
from test_device_scalars import BAD, CASES, GRAD_SCALE, VALID, bad_cases  # noqa: E402

NAN, INF = math.nan, math.inf
CHUNK = mtapply._source.CHUNK_ELEMENTS
# several blocks per tensor (all must agree), an empty tensor, and an odd size
SHAPES = [(5,), (3 * CHUNK + 7,), (0,), (CHUNK,), (300, 7)]


def cuda_lists(spec, seed: int, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    if spec.name == "adam8bit":
        params = [np.float32(rng.standard_normal(s)) for s in shapes]
        state = mtapply.adam8bit_state(params, threshold=1)
        names = ("exp_avgs", "exp_avg_sqs", "exp_avg_absmax", "exp_avg_sq_absmax")
        host = dict(params=params, grads=[np.float32(rng.standard_normal(s)) for s in shapes],
                    **dict(zip(names, state.lists())))
    else:
        host = {slot: [np.float32(np.abs(rng.standard_normal(s)) + 0.5) for s in shapes]
                for slot in spec.slots}
    return {slot: [torch.from_numpy(a).cuda() for a in column] for slot, column in host.items()}


def snapshot(tensors: dict) -> list:
    torch.cuda.synchronize()
    # float64 holds every value of these dtypes (bfloat16 and 8-bit states too) exactly
    return [t.cpu().double().numpy().tobytes() for column in tensors.values() for t in column]


def device(value) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device="cuda")


def plan_of(op: str, seed: int = 0):
    spec, good, names = CASES[op]
    tensors = cuda_lists(spec, seed)
    return Plan(spec, tensors), tensors, dict(good), names


@pytest.mark.parametrize("op,name,value", list(bad_cases()))
def test_a_device_value_out_of_range_writes_nothing_and_raises_the_flag(op, name, value):
    plan, tensors, good, _ = plan_of(op)
    before = snapshot(tensors)
    bad = device(value)
    plan.step(**dict(good, **{name: bad}))
    flag = plan.invalid
    assert isinstance(flag, cupy.ndarray) and flag.dtype == cupy.float32 and flag.shape == (1,)
    assert snapshot(tensors) == before, "a step with an invalid device value wrote"
    assert float(flag[0]) == 1.0
    assert torch.from_dlpack(flag).item() == 1.0  # torch reads it in place
    plan.clear_invalid()
    bad.fill_(good.get(name, VALID[CASES[op][0].scalar_range(name)]))  # valid now: it runs
    plan.step(**dict(good, **{name: bad}))
    assert snapshot(tensors) != before and float(plan.invalid[0]) == 0.0


@pytest.mark.parametrize("value", BAD[GRAD_SCALE])
@pytest.mark.parametrize("op", ["adam", "lamb", "lion", "adam8bit"])
def test_grad_scale_out_of_range(op, value):
    plan, tensors, good, _ = plan_of(op, 1)
    before = snapshot(tensors)
    plan.step(grad_scale=device(value), **good)
    assert snapshot(tensors) == before and float(plan.invalid[0]) == 1.0


@pytest.mark.parametrize("op", ["adam", "sgd", "lamb", "lion"])
@pytest.mark.parametrize("count", [NAN, -1.0, 0.5, INF])
def test_a_counter_that_holds_no_step_count_skips_and_is_not_advanced(op, count):
    plan, tensors, good, _ = plan_of(op, 2)
    counter = device(count)
    plan.count_steps(counter)
    before = snapshot(tensors)
    plan.step(**{k: v for k, v in good.items() if k != "step"})
    assert snapshot(tensors) == before and float(plan.invalid[0]) == 1.0
    assert counter.cpu().numpy().tobytes() == np.float32([count]).tobytes()


@pytest.mark.parametrize("bad", ["lr", "grad_scale"])
def test_a_counting_plan_does_not_count_a_skipped_step(bad):
    plan, tensors, good, _ = plan_of("adam", 3)
    counter = device(0.0)
    plan.count_steps(counter)
    plan.step(lr=1e-2)
    invalid = dict(lr=device(NAN)) if bad == "lr" else dict(lr=1e-2, grad_scale=device(0.0))
    before = snapshot(tensors)
    plan.step(**invalid)
    assert counter.item() == 1.0 and snapshot(tensors) == before
    plan.step(lr=1e-2)
    assert counter.item() == 2.0


def test_one_tensors_invalid_row_skips_every_group():
    """Per-tensor device lrs (rows), in groups of two dtypes (two launches): one tensor's NaN lr
    leaves every tensor of every group as it was."""
    spec = AdamSpec()
    tensors = cuda_lists(spec, 4)
    for slot in tensors:  # the last two params in bfloat16 with their grads: another group
        if slot in ("params", "grads"):
            tensors[slot][3:] = [t.to(torch.bfloat16) for t in tensors[slot][3:]]
    plan = Plan(spec, tensors)
    lrs = [device(1e-2), device(1e-3), device(1e-2), device(1e-3), device(NAN)]
    before = snapshot(tensors)
    plan.step(step=2.0, lr=lrs)
    assert snapshot(tensors) == before and float(plan.invalid[0]) == 1.0
    plan.clear_invalid()
    lrs[4].fill_(1e-3)
    plan.step(step=2.0, lr=lrs)
    assert snapshot(tensors) != before and float(plan.invalid[0]) == 0.0


def test_merged_param_groups_with_a_nan_tensor_lr_step_nothing():
    """The torch adapter steps param groups as one plan whose rows read each group's lr; a
    group's tensor lr of NaN skips the step (torch.optim would write NaN everywhere)."""
    import mtapply.torch as mtt

    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (10, 5000, 3)]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = torch.tensor(1e-2, device="cuda")
    opt = mtt.LAMB([{"params": params[:2], "lr": lr}, {"params": params[2:], "lr": 1e-3}])
    before = [p.detach().clone() for p in params]
    lr.fill_(float("nan"))
    opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, before):
        assert torch.equal(a.detach(), b)


def test_the_flag_is_read_without_a_sync_and_stays_set_until_cleared():
    plan, tensors, good, _ = plan_of("adam", 5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan.step(**dict(good, lr=device(NAN)))
        seen = torch.empty(1, device="cuda")
        seen.copy_(torch.from_dlpack(plan.invalid))  # ordered after the step, on its stream
        plan.step(**good)  # a valid step does not clear it
    stream.synchronize()
    assert seen.item() == 1.0 and float(plan.invalid[0]) == 1.0
    with torch.cuda.stream(stream):
        plan.clear_invalid()
    stream.synchronize()
    assert float(plan.invalid[0]) == 0.0


def test_the_one_call_api_skips_too():
    spec, good, _ = CASES["adam"]
    tensors = cuda_lists(spec, 6)
    before = snapshot(tensors)
    mtapply.adam_step(tensors["params"], tensors["grads"], tensors["exp_avgs"],
                      tensors["exp_avg_sqs"], lr=device(NAN), step=2.0)
    mtapply.adam_step(tensors["params"], tensors["grads"], tensors["exp_avgs"],
                      tensors["exp_avg_sqs"], lr=1e-2, step=device(1.5))
    assert snapshot(tensors) == before


def test_host_numbers_are_refused_before_any_launch():
    plan, tensors, good, _ = plan_of("adam", 7)
    before = snapshot(tensors)
    for bad in (dict(lr=INF), dict(lr=NAN), dict(step=1.5), dict(step=0), dict(step=-1)):
        with pytest.raises(ValueError):
            plan.step(**dict(good, **bad))
    with pytest.raises(ValueError, match="grad_scale must be finite and > 0, got inf"):
        plan.step(grad_scale=INF, **good)
    assert snapshot(tensors) == before and float(plan.invalid[0]) == 0.0


def test_rules_with_keyword_names_take_device_values_on_the_gpu():
    """Hyperparameters named like C++ keywords or address words compile and run on the GPU as
    on the CPU, as numbers and as device values (a NaN one skipping the step)."""
    from test_rules import AWKWARD

    rule = mtapply.rule("awkward", **AWKWARD)
    rng = np.random.default_rng(8)
    host = [[np.float32(rng.standard_normal(n)) for n in (5, 3 * CHUNK + 1)] for _ in range(4)]
    on_gpu = [[torch.from_numpy(a.copy()).cuda() for a in column] for column in host]
    hyper = dict(lr=0.01, int=-1.0, x_ptr=2.0, y_out=0.5, z_array=4.0, default=0.5)
    rule.step(*host, **hyper)
    rule.step(*on_gpu, **dict(hyper, x_ptr=device(2.0), int=device(-1.0)))
    for a, b in zip(host[0] + host[2], on_gpu[0] + on_gpu[2]):
        np.testing.assert_allclose(b.cpu().numpy(), a, rtol=2e-5, atol=1e-6)
    before = [t.cpu().numpy().tobytes() for t in on_gpu[0]]
    plan = rule.plan(*on_gpu)
    plan.step(**dict(hyper, y_out=device(NAN)))
    assert [t.cpu().numpy().tobytes() for t in on_gpu[0]] == before
    assert float(plan.invalid[0]) == 1.0


def test_group_lrs_are_checked_as_the_kernels_read_them_in_float32():
    """Merged param groups keep number lrs in float32 device slots that the kernels do not
    check again: an lr finite in double but not in float32 is refused before any write."""
    import mtapply.torch as mtt

    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (10, 7)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = mtt.AdamW([{"params": params[:1], "lr": 1e-3}, {"params": params[1:], "lr": 2e-3}])
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["lr"] = 1e39  # finite as a Python float, inf as a float32
    with pytest.raises(ValueError, match="lr of param group 1 must be finite and >= 0, got inf"):
        opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, before):
        assert torch.equal(a.detach(), b)
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()  # the same optimizer keeps working
    torch.cuda.synchronize()
    assert not torch.equal(params[1].detach(), before[1])


def test_a_plan_dropped_while_a_graph_is_captured_leaves_the_capture_whole():
    """A plan's device memory goes back to the pool once its stream's work has run; a plan
    dropped (a garbage collection) while a CUDA graph is captured queries no event (which would
    break the capture), and the graph replays as the eager steps ran."""
    import gc

    plan, tensors, good, _ = plan_of("adam", 7)
    other, _, _, _ = plan_of("adam", 8)
    other.step(**dict(good, step=1.0))
    plan.step(**dict(good, step=1.0))  # tables uploaded before the capture
    lr = device(good["lr"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    gc.collect()  # earlier tests' garbage (their CuPy streams, say) is not this test's subject
    with torch.cuda.graph(graph, stream=stream):
        plan.step(**dict(good, lr=lr, step=2.0))
        del other
        gc.collect()
    torch.cuda.synchronize()
    expected, expected_tensors, _, _ = plan_of("adam", 7)
    expected.step(**dict(good, step=1.0))
    graph.replay()
    expected.step(**dict(good, step=2.0))
    torch.cuda.synchronize()
    assert snapshot(tensors) == snapshot(expected_tensors)
