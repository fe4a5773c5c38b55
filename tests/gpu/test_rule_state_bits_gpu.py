"""Rules with 8-bit state on the GPU: the generic 8-bit walk (kernels/quantized.cuh) against the
rule's NumPy path between dequantizing and quantizing (rules with per-tensor sums too, LAMB's
over its 8-bit moments), over a list with a big tensor (first and
last elements checked), partial last blocks, views not 16-byte aligned, float32 state for small
params, bf16 params, non-finite values stored as zero, and device scalars in a CUDA graph."""
import numpy as np
import pytest

from mtapply import _optax_rules, quantization
from mtapply.rules import library

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
from _helpers import on_gpu_at  # noqa: E402

SHAPES = [(1 << 20 | 3,), (5000,), (70, 80), (10,), (256 * 20 + 7,), (0,), (4095,), (3, 999)]
RULES = {"lion": (library.lion, (), dict(lr=1e-3, weight_decay=0.1)),
         # per-tensor norms summed on the chunk walker, then the 8-bit walk's update
         "lars": (_optax_rules.lars, (), dict(lr=0.1, momentum=0.9, weight_decay=1e-4,
                                              trust_coefficient=0.01)),
         "adam": (library.adam, ("exp_avg_sq",), dict(lr=1e-2, weight_decay=0.1)),
         "adan": (library.adan, ("n",), dict(lr=1e-2, weight_decay=0.02)),
         # per-tensor sums over the 8-bit moments: the first pass on the 8-bit walk too
         "lamb": (library.lamb, ("exp_avg_sq",), dict(lr=1e-2, weight_decay=0.01))}


def _random_state(rule, params, rng):
    """Every state list at random values (never zeros), 8-bit where `state` makes codes."""
    columns = [list(c) for c in rule.state(params)]
    names = rule.slots[2:]
    for k, p in enumerate(params):
        for j, slot in enumerate(names[:len(names) - len(rule.eight_bit)]):
            values = rng.standard_normal(p.shape).astype(np.float32) * 0.1
            if slot in rule.unsigned:
                values = np.abs(values)
            if columns[j][k].dtype == np.uint8:
                codes, scales = quantization.quantize_blockwise(values, slot not in rule.unsigned)
                columns[j][k] = codes.reshape(p.shape)
                columns[names.index(f"{slot}_absmax")][k] = scales
            else:
                columns[j][k] = values
    return columns


def _compare(rule, gpu, host, lr, where):
    params, state = gpu
    want_params, want_state = host
    for k, (p, w) in enumerate(zip(params, want_params)):
        got = p.float().cpu().numpy()
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=lr * 0.2, err_msg=f"{where} params[{k}]")
        if got.size:
            assert np.isclose(got, w, rtol=1e-5, atol=1e-6).mean() >= 0.999, f"{where} params[{k}]"
            for end in (0, -1):
                assert got.reshape(-1)[end] == pytest.approx(w.reshape(-1)[end], rel=1e-5, abs=lr * 0.2)
    for name, column, want_column in zip(rule.slots[2:], state, want_state):
        for k, (x, w) in enumerate(zip(column, want_column)):
            got = x.cpu().numpy()
            if got.dtype == np.uint8:  # a value on a midpoint may take the neighbouring code
                diff = np.abs(got.astype(int) - w.astype(int))
                assert diff.max(initial=0) <= 1 and (got.size == 0 or (diff == 0).mean() >= 0.999), (name, k)
            else:
                np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-7, err_msg=f"{where} {name}[{k}]")


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("name", list(RULES))
def test_the_8_bit_walk_follows_the_numpy_path(name, offset):
    make, unsigned, hyper = RULES[name]
    rule = make().with_state_bits(8, unsigned=unsigned)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    state = _random_state(rule, params, rng)
    host = ([p.copy() for p in params], [[x.copy() for x in c] for c in state])
    # each step from equal inputs: a code on a midpoint may round either way, and where it is
    # its block's largest, the block's scale and many small codes move with it in later steps
    for t in range(1, 4):
        gpu = (on_gpu_at(host[0], offset), [on_gpu_at(c, offset) for c in host[1]])
        before = gpu[0][0].clone()
        grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        rule.step(gpu[0], on_gpu_at(grads, offset), *gpu[1], step=t, **hyper)
        rule.step(host[0], grads, *host[1], step=t, **hyper)
        torch.cuda.synchronize()
        assert not torch.equal(gpu[0][0], before)
        _compare(rule, gpu, host, hyper["lr"], f"{name} offset {offset} step {t}")


def test_bf16_params_with_8_bit_state():
    rule = library.adam(decoupled_weight_decay=True).with_state_bits(8, unsigned="exp_avg_sq")
    rng = np.random.default_rng(1)
    shapes = [(70, 80), (5000,), (100,)]
    params = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", torch.bfloat16)
              for s in shapes]
    host_params = [p.float().cpu().numpy() for p in params]
    state = rule.state(params)
    host_state = [[x.cpu().numpy().copy() for x in c] for c in state]
    grads = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes]
    host_grads = [g.float().cpu().numpy() for g in grads]
    rule.step(params, grads, *state, lr=1e-2, step=1, weight_decay=0.1)
    rule.step(host_params, host_grads, *host_state, lr=1e-2, step=1, weight_decay=0.1)
    torch.cuda.synchronize()
    for k, (p, w) in enumerate(zip(params, host_params)):
        want = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(p.float().cpu().numpy(), want, rtol=1e-2, atol=1e-2, err_msg=str(k))


def test_non_finite_values_are_stored_as_zero_as_the_format_says():
    rule = library.lion().with_state_bits(8)
    params = [torch.randn(4096, device="cuda")]
    grads = [torch.randn(4096, device="cuda")]
    grads[0][300] = float("nan")
    grads[0][700] = float("inf")  # Lion's sign makes its step finite; its state is zero
    state = rule.state(params)
    host = ([params[0].cpu().numpy().copy()], [[x.cpu().numpy().copy() for x in c] for c in state])
    rule.step(params, grads, *state, lr=1e-3, step=1)
    rule.step(*host[:1], [grads[0].cpu().numpy()], *host[1], lr=1e-3, step=1)
    torch.cuda.synchronize()
    codes, scales = state[0][0].cpu().numpy(), state[1][0].cpu().numpy()
    assert np.isfinite(scales).all()
    np.testing.assert_allclose(scales, host[1][1][0], rtol=1e-6)
    zero = int(np.flatnonzero(quantization.dynamic_map(True) == 0)[0])
    assert codes[300] == codes[700] == zero
    np.testing.assert_array_equal(codes, host[1][0][0])
    got = params[0].cpu().numpy()
    assert np.flatnonzero(~np.isfinite(got)).tolist() == [300]


def test_device_scalars_in_a_cuda_graph():
    rule = library.lion().with_state_bits(8)
    params = [torch.randn(s, device="cuda") for s in [(5000,), (300,)]]
    grads = [torch.randn_like(p) for p in params]
    state = rule.state(params)
    twin = ([p.clone() for p in params], [[x.clone() for x in c] for c in state])
    lr = torch.full((1,), 2.0 ** -10, device="cuda")  # exact in float32, as the twin's numbers
    plan = rule.plan(params, grads, *state)
    plan.step(lr=lr, step=1)  # compile and upload outside the capture
    rule.step(twin[0], grads, *twin[1], lr=2.0 ** -10, step=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        plan.step(lr=lr, step=2)
    lr.fill_(2.0 ** -9)
    graph.replay()
    rule.step(twin[0], grads, *twin[1], lr=2.0 ** -9, step=2)
    torch.cuda.synchronize()
    for a, b in zip(params + [x for c in state for x in c], twin[0] + [x for c in twin[1] for x in c]):
        assert torch.equal(a, b)
