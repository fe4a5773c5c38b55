"""8-bit Adam on the GPU: the kernel against the NumPy path (which equals reference.adam8bit),
over a list with a big tensor (first and last elements checked), partial last blocks, fp32
moments for small tensors, empty tensors, AMP, device scalars in a CUDA graph and the one-call
path."""
import sys
from pathlib import Path

import numpy as np
import pytest

import mtapply
from mtapply import quantization

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the CPU tests' helpers
from test_adam8bit import _draw, _quantized_state  # noqa: E402

SHAPES = [(1 << 20 | 3,), (5000,), (70, 80), (10,), (256 * 20 + 7,), (0,), (4096,), (4095,), (3, 999)]


def _to_cuda(arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in arrays]


def _assert_close_states(gpu, host, where, lr):
    """Codes equal but for rare neighbours: fma contractions in the kernel may move a value
    across a midpoint. A param then differs by about lr times a code step."""
    params, state = gpu
    want_params, want_state = host
    for k, (p, w) in enumerate(zip(params, want_params)):
        got = p.cpu().numpy()
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=lr * 0.2, err_msg=f"{where} params[{k}]")
        if got.size:
            close = np.isclose(got, w, rtol=1e-5, atol=1e-6)
            assert close.mean() >= 0.999, f"{where} params[{k}]: {close.mean()}"
            for end in (0, -1):
                assert got.reshape(-1)[end] == pytest.approx(w.reshape(-1)[end], rel=1e-5, abs=lr * 0.2)
    for name, column, want_column in zip(("m", "v", "m scale", "v scale"), state, want_state):
        for k, (x, w) in enumerate(zip(column, want_column)):
            got = x.cpu().numpy()
            if got.dtype == np.uint8:
                diff = np.abs(got.astype(int) - w.astype(int))
                assert diff.max(initial=0) <= 1, (name, k)
                assert got.size == 0 or (diff == 0).mean() >= 0.999, (name, k)
            else:
                np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-7, err_msg=f"{name}[{k}]")


@pytest.mark.parametrize("decoupled", [False, True])
def test_kernel_matches_the_numpy_path(decoupled):
    rng = np.random.default_rng(0)
    params = _draw(rng, SHAPES)
    state = _quantized_state(rng, params)
    gpu_params = _to_cuda(params)
    gpu_state = [_to_cuda(column) for column in state.lists()]
    before = gpu_params[0].clone()
    plan = mtapply.adam8bit_plan(gpu_params, _to_cuda(params), *gpu_state,
                                 decoupled_weight_decay=decoupled)
    for t in range(1, 6):
        grads = _draw(rng, SHAPES)
        plan.rebind("grads", _to_cuda(grads))
        plan.step(lr=1e-3, step=t, weight_decay=0.01)
        mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-3, step=t, weight_decay=0.01,
                              decoupled_weight_decay=decoupled)
    torch.cuda.synchronize()
    assert gpu_state[0][0].dtype == torch.uint8 and gpu_state[0][3].dtype == torch.float32
    assert (gpu_params[0][[0, -1]] != before[[0, -1]]).all()
    _assert_close_states((gpu_params, gpu_state), (params, state.lists()), "plan", 1e-3)


def test_a_nan_grad_loses_only_its_own_element_as_on_the_cpu():
    """A NaN grad makes its param element NaN (as torch.optim) and is stored as the zero code;
    its block's scale and other codes are those of the NumPy path, every other param finite."""
    rng = np.random.default_rng(5)
    shapes = [(256 * 40,)]
    params = _draw(rng, shapes)
    state = _quantized_state(rng, params)
    grads = _draw(rng, shapes)
    bad = 256 * 3 + 17
    grads[0][bad] = np.nan
    gpu_params, gpu_grads = _to_cuda(params), _to_cuda(grads)
    gpu_state = [_to_cuda(column) for column in state.lists()]
    mtapply.adam8bit_step(gpu_params, gpu_grads, *gpu_state, lr=1e-3, step=1)
    mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-3, step=1)
    torch.cuda.synchronize()
    got_m, want_m = gpu_state[0][0].cpu().numpy(), state.lists()[0][0]
    got_scale, want_scale = gpu_state[2][0].cpu().numpy(), state.lists()[2][0]
    assert np.isfinite(got_scale).all() and np.isfinite(want_scale).all()
    np.testing.assert_allclose(got_scale, want_scale, rtol=1e-6)
    zero = int(np.flatnonzero(quantization.dynamic_map(True) == 0)[0])
    assert got_m[bad] == want_m[bad] == zero
    np.testing.assert_array_equal(got_m[256 * 3:256 * 4], want_m[256 * 3:256 * 4])
    got_p = gpu_params[0].cpu().numpy()
    assert np.flatnonzero(~np.isfinite(got_p)).tolist() == [bad]
    np.testing.assert_allclose(np.delete(got_p, bad), np.delete(params[0], bad), rtol=1e-5, atol=2e-4)


def test_unaligned_tensors_take_the_scalar_path():
    rng = np.random.default_rng(1)
    n = 256 * 30 + 5
    params = _draw(rng, [(n,)])
    state = _quantized_state(rng, params)
    grads = _draw(rng, [(n,)])
    storage = torch.zeros(n + 1, device="cuda")
    storage[1:] = torch.from_numpy(params[0]).cuda()
    p = storage[1:]  # 4 bytes past a 16-byte boundary
    codes = torch.zeros(n + 1, dtype=torch.uint8, device="cuda")
    codes[1:] = torch.from_numpy(state.exp_avgs[0]).cuda()
    gpu_state = [[codes[1:]]] + [_to_cuda(column) for column in state.lists()[1:]]
    mtapply.adam8bit_step([p], _to_cuda(grads), *gpu_state, lr=1e-3, step=1)
    mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-3, step=1)
    torch.cuda.synchronize()
    _assert_close_states(([p], gpu_state), (params, state.lists()), "unaligned", 1e-3)


def test_amp_skip_and_unscale_and_a_graph_with_device_scalars():
    rng = np.random.default_rng(2)
    shapes = [(8192,), (300,)]
    params = _draw(rng, shapes)
    state = _quantized_state(rng, params)
    gpu_params = _to_cuda(params)
    gpu_state = [_to_cuda(column) for column in state.lists()]
    grads = _draw(rng, shapes)
    scaled = _to_cuda([g * 1024 for g in grads])
    plan = mtapply.adam8bit_plan(gpu_params, scaled, *gpu_state)
    saved = [x.clone() for x in gpu_params + [y for c in gpu_state for y in c]]
    plan.step(lr=1e-3, step=1, grad_scale=1024.0, found_inf=torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    for x, y in zip(gpu_params + [y for c in gpu_state for y in c], saved):
        assert torch.equal(x, y)  # found_inf: nothing written
    lr, step = torch.full((1,), 1e-3, device="cuda"), torch.ones(1, device="cuda")
    scale = torch.full((1,), 1024.0, device="cuda")
    plan.step(lr=lr, step=step, grad_scale=scale)  # warm up outside the capture
    mtapply.adam8bit_step(params, grads, *state.lists(), lr=1e-3, step=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr, step=step, grad_scale=scale)
    for t, value in ((2, 2e-3), (3, 5e-4)):
        lr.fill_(value)
        step.fill_(t)
        graph.replay()
        mtapply.adam8bit_step(params, grads, *state.lists(), lr=value, step=t)
    torch.cuda.synchronize()
    _assert_close_states((gpu_params, gpu_state), (params, state.lists()), "graph", 2e-3)


def test_one_call_reuses_its_plan_on_the_same_tensors():
    from mtapply import _calls

    rng = np.random.default_rng(3)
    params = _draw(rng, [(9000,), (12,)])
    state = _quantized_state(rng, params)
    gpu_params = _to_cuda(params)
    gpu_state = [_to_cuda(column) for column in state.lists()]
    grads = _to_cuda(_draw(rng, [(9000,), (12,)]))
    _calls.forget()
    plans = []
    for t in range(1, 4):
        mtapply.adam8bit_step(gpu_params, grads, *gpu_state, lr=1e-3, step=t)
        mtapply.adam8bit_step(params, [g.cpu().numpy() for g in grads], *state.lists(), lr=1e-3,
                              step=t)
        plans.append({id(r.plan) for k, v in _calls._recent.items() if k[2] == "torch" for r in v})
    torch.cuda.synchronize()
    # one plan (its launches: the 8-bit tensor and the small fp32 one), bound once
    assert len(plans[0]) == 1 and plans[0] == plans[1] == plans[2]
    _assert_close_states((gpu_params, gpu_state), (params, state.lists()), "one-call", 1e-3)


def test_torch_adamw8bit_on_cuda_follows_the_cpu_class():
    import copy

    import mtapply.torch as mt

    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 10))
    gpu_model = copy.deepcopy(cpu_model).cuda()
    opts = [mt.AdamW8bit(m.parameters(), lr=1e-3) for m in (cpu_model, gpu_model)]
    for k in range(6):
        # the CPU model's grads feed both: a GPU backward rounds differently (its matmul kernel
        # is the library's choice), and one 8-bit code at a rounding edge would then differ
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(k))
        cpu_model.zero_grad()
        cpu_model(x).square().mean().backward()
        for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
            b.grad = a.grad.cuda()
        for opt in opts:
            opt.step()
    assert opts[1].state[gpu_model[0].weight]["exp_avg"].dtype == torch.uint8
    for a, b in zip(cpu_model.parameters(), gpu_model.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_params_on_the_gpu_follow_the_cpu_path(stochastic):
    rng = np.random.default_rng(5)
    shapes = [(1 << 20 | 3,), (5000,), (300,)]
    values = _draw(rng, shapes)
    state = _quantized_state(rng, values)
    cpu = [torch.from_numpy(v).to(torch.bfloat16) for v in values]
    gpu = [p.cuda() for p in cpu]
    gpu_state = [_to_cuda(column) for column in state.lists()]
    for t in range(1, 4):
        grads = [torch.from_numpy(g).to(torch.bfloat16) for g in _draw(rng, shapes)]
        mtapply.adam8bit_step(gpu, [g.cuda() for g in grads], *gpu_state, lr=1e-3, step=t,
                              seed=21, stochastic_rounding=stochastic)
        mtapply.adam8bit_step(cpu, grads, *state.lists(), lr=1e-3, step=t, seed=21,
                              stochastic_rounding=stochastic)
    torch.cuda.synchronize()
    for k, (a, b) in enumerate(zip(gpu, cpu)):
        x, y = a.cpu().view(torch.int16).int(), b.view(torch.int16).int()
        assert (x - y).abs().max().item() <= 1, k
        assert (x == y).float().mean().item() >= 0.999, k
        assert x[0] == y[0] and x[-1] == y[-1], k
