"""Stochastic rounding for rules (`stochastic_rounding=True` on a rule's step and plan, and on
every rule-run mtapply.torch optimizer): bfloat16 params are the float32 update rounded with
mtapply.stochastic's bits (seed, step, the tensor's index), on the CPU and on a GPU (against the
CPU path's bits), 8-bit states included; the step is required, and misuse is refused before
anything is written."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from mtapply.rules import library  # noqa: E402
from mtapply.stochastic import round_to_bfloat16_stochastic  # noqa: E402

SHAPES = [(1000,), (7, 9), (0,), (3,), (256 * 20 + 7,)]
SEED = 2**40 + 5


def _bits(t) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _lists(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in SHAPES]
    m = [(torch.randn(s, generator=g) * 0.1).to(device) for s in SHAPES]
    return params, grads, m


def test_lion_params_are_the_float32_update_rounded_with_the_seeds_bits():
    params, grads, m = _lists(0)
    want = []
    for i, (p, g, b) in enumerate(zip(params, grads, m)):
        p32, g32, b32 = p.float().numpy(), g.float().numpy(), b.numpy()
        c = np.float32(0.9) * b32 + np.float32(0.1) * g32
        new = p32 - np.float32(1e-2) * (np.sign(c) + np.float32(0.1) * p32)
        want.append(round_to_bfloat16_stochastic(new.astype(np.float32), seed=SEED, step=3,
                                                 tensor=i))
    library.lion().step(params, grads, m, lr=1e-2, weight_decay=0.1, step=3, seed=SEED,
                        stochastic_rounding=True)
    for p, w in zip(params, want):
        np.testing.assert_array_equal(_bits(p), w)


def test_the_bits_follow_the_seed_and_the_step():
    runs = {}
    for seed, step in ((7, 1), (7, 1), (8, 1), (7, 2)):
        params, grads, m = _lists(1)
        library.lion().step(params, grads, m, lr=1e-3, step=step, seed=seed,
                            stochastic_rounding=True)
        runs.setdefault((seed, step), []).append(_bits(params[0]).copy())
    np.testing.assert_array_equal(*runs[(7, 1)])
    assert not np.array_equal(runs[(7, 1)][0], runs[(8, 1)][0])
    assert not np.array_equal(runs[(7, 1)][0], runs[(7, 2)][0])


def test_misuse_is_refused_before_anything_is_written():
    params, grads, m = _lists(2)
    before = [p.clone() for p in params]
    lion = library.lion()
    with pytest.raises(TypeError, match="needs step=.*stochastic_rounding draws other bits"):
        lion.step(params, grads, m, lr=1e-3, stochastic_rounding=True)
    floats = [p.float() for p in params]
    with pytest.raises(TypeError, match="params\\[0\\] is float32: stochastic_rounding is for "
                                        "bfloat16"):
        lion.step(floats, grads, m, lr=1e-3, step=1, stochastic_rounding=True)
    with pytest.raises(ValueError, match="seed must be an integer"):
        lion.step(params, grads, m, lr=1e-3, step=1, seed=-1, stochastic_rounding=True)
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_torch_lion_rounds_as_the_functional_rule():
    params = [torch.nn.Parameter(p) for p in _lists(3)[0]]
    twins = [p.detach().clone() for p in params]
    moments = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]  # (the params' dtype)
    opt = mt.Lion(params, lr=1e-2, weight_decay=0.1, stochastic_rounding=True, seed=SEED)
    g = torch.Generator().manual_seed(4)
    for t in range(1, 4):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
        library.lion().step(twins, grads, moments, lr=1e-2, weight_decay=0.1, step=t, seed=SEED,
                            stochastic_rounding=True)
    for p, q in zip(params, twins):
        np.testing.assert_array_equal(_bits(p), _bits(q))


@pytest.mark.parametrize("name", ["NAdam", "Adagrad", "Adan"])
def test_torch_options_round_otherwise_and_go_round_a_state_dict(name):
    def make(params, stochastic):
        return getattr(mt, name)(params, lr=1e-2, stochastic_rounding=stochastic, seed=SEED)

    params = [torch.nn.Parameter(p) for p in _lists(6)[0]]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    rounded, nearest = make(params, True), make(plain, False)
    for p, q in zip(params, plain):
        p.grad = torch.full(p.shape, 1e-3).to(torch.bfloat16)
        q.grad = p.grad.clone()
    rounded.step()
    nearest.step()
    # a first step of lr 1e-2 is a few bfloat16 units: rounding it otherwise shows
    assert any(not np.array_equal(_bits(p), _bits(q)) for p, q in zip(params, plain)
               if p.numel())
    saved = rounded.state_dict()
    assert saved["param_groups"][0]["stochastic_rounding"] is True
    assert saved["param_groups"][0]["seed"] == SEED
    again = make([torch.nn.Parameter(p.detach().clone()) for p in params], False)
    again.load_state_dict(saved)
    assert again.param_groups[0]["stochastic_rounding"] and again.param_groups[0]["seed"] == SEED


@pytest.mark.parametrize("eight_bit", [False, True])
@pytest.mark.gpu
def test_kernel_rounds_with_the_cpu_paths_bits(eight_bit):
    rule = library.lion().with_state_bits(8) if eight_bit else library.lion()
    runs = []
    for device in ("cuda", "cpu"):
        params, grads, m = _lists(5, device)
        state = rule.state(params) if eight_bit else (m,)
        for t in range(1, 4):
            rule.step(params, grads, *state, lr=1e-3, weight_decay=0.1, step=t, seed=SEED,
                      stochastic_rounding=True)
        runs.append(params)
    torch.cuda.synchronize()
    for k, (a, b) in enumerate(zip(*runs)):
        x, y = _bits(a).astype(np.int32), _bits(b).astype(np.int32)
        if not x.size:
            continue
        # equal but for values an fma moved across a rounding threshold (one unit a step)
        assert np.abs(x - y).max() <= 3, k
        assert np.mean(x == y) >= 0.9999, k
        assert x[0] == y[0] and x[-1] == y[-1], k


@pytest.mark.parametrize("eight_bit", [False, True])
def test_stochastic_rule_kernels_compile(eight_bit):
    pytest.importorskip("cuda.bindings.nvrtc", reason="kernels cannot be compiled offline")
    from mtapply import _source

    rule = library.adan().with_state_bits(8, unsigned="n") if eight_bit else library.adan()
    spec = rule.spec(stochastic_rounding=True)
    states = ("uint8",) * 4 + ("float32",) * 4 if eight_bit else ("float32",) * 4
    dtypes = ("bfloat16", "bfloat16") + states
    source = spec.source(dtypes)
    assert "rounding.init(a.seed_lo, a.seed_hi" in source and "STOCHASTIC 1" in source
    assert _source.compile_offline(source, "sm_90", spec.compile_options(dtypes))[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", ["seed", "seed_lo", "seed_hi", "sr_tensor_array"])
def test_the_step_options_of_stochastic_rounding_are_no_hyperparameter_names(name):
    import mtapply

    with pytest.raises(ValueError, match=f"hyper: '{name}' is already a slot or a reserved"):
        mtapply.rule("r", slots="param:rw grad:r", hyper={"lr": None, name: 0.5},
                     update="param = param - lr * grad")
