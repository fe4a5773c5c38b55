"""Stochastic rounding of bfloat16 params in Adam, AdamW and SGD, on the CPU: the params equal
the fp32 update rounded with mtapply.stochastic's bits (seed, step, the tensor's index), small
updates survive where round-to-nearest loses them, and misuse is refused."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
from mtapply import reference  # noqa: E402
from mtapply.stochastic import round_to_bfloat16_stochastic  # noqa: E402

SHAPES = [(1000,), (7, 9), (0,), (3,)]


def _bf16_bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _lists(seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    m = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    v = [torch.rand(s, generator=g) * 0.01 for s in SHAPES]
    return params, grads, m, v


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_params_are_the_fp32_update_rounded_with_the_seeds_bits(decoupled):
    params, grads, m, v = _lists(0)
    want = []
    for i, (p, g, a, b) in enumerate(zip(params, grads, m, v)):
        new, *_ = reference.adam(p.float().numpy(), g.float().numpy(), a.numpy(), b.numpy(),
                                 lr=1e-2, step=3, weight_decay=0.1, dtype=np.float32,
                                 decoupled_weight_decay=decoupled)
        want.append(round_to_bfloat16_stochastic(new, seed=2**40 + 5, step=3, tensor=i))
    mtapply.adam_step(params, grads, m, v, lr=1e-2, step=3, weight_decay=0.1, seed=2**40 + 5,
                      decoupled_weight_decay=decoupled, stochastic_rounding=True)
    for p, w in zip(params, want):
        np.testing.assert_array_equal(_bf16_bits(p), w)


def test_sgd_params_are_rounded_with_the_seeds_bits_and_repeat_per_seed():
    runs = {}
    for seed in (7, 7, 8):
        params, grads, buffers, _ = _lists(1)
        plan = mtapply.sgd_plan(params, grads, buffers, stochastic_rounding=True)
        for t in (1, 2):
            plan.step(lr=0.05, step=t, momentum=0.9, seed=seed)
        runs.setdefault(seed, []).append([_bf16_bits(p).copy() for p in params])
    for a, b in zip(*runs[7]):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(runs[7][0], runs[8][0]))
    params, grads, buffers, _ = _lists(1)
    p0, g0 = params[0].float().numpy(), grads[0].float().numpy()
    mtapply.sgd_step(params, grads, buffers, lr=0.05, step=1, momentum=0.9, seed=7,
                     stochastic_rounding=True)
    new, _ = reference.sgd(p0, g0, None, lr=0.05, step=1, momentum=0.9, dtype=np.float32)
    np.testing.assert_array_equal(_bf16_bits(params[0]),
                                  round_to_bfloat16_stochastic(new, seed=7, step=1, tensor=0))


def test_small_updates_survive_stochastic_rounding_and_vanish_when_rounded_to_nearest():
    """1.0 in bfloat16 has neighbours 2**-7 apart; an update of 1e-4 a step is lost by
    round-to-nearest every time, while stochastic rounding moves the params by it on average."""
    n, steps, lr = 4096, 200, 1e-4
    ones = torch.ones(n, dtype=torch.bfloat16)
    grads = [torch.ones(n, dtype=torch.bfloat16)]
    nearest, stochastic = [ones.clone()], [ones.clone()]
    for t in range(1, steps + 1):
        mtapply.sgd_step(nearest, grads, lr=lr, step=t)
        mtapply.sgd_step(stochastic, grads, lr=lr, step=t, stochastic_rounding=True)
    assert torch.equal(nearest[0], ones)
    drift = 1.0 - stochastic[0].float().mean().item()
    assert drift == pytest.approx(steps * lr, rel=0.1)


def test_misuse_is_refused_before_anything_is_written():
    p32 = [torch.ones(5)]
    with pytest.raises(TypeError, match=r"params\[0\] is float32: stochastic_rounding is for bfloat16"):
        mtapply.sgd_step(p32, [torch.ones(5)], lr=0.1, step=1, stochastic_rounding=True)
    assert torch.equal(p32[0], torch.ones(5))
    p16 = [torch.ones(5, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="pass no master_params"):
        mtapply.adam_plan(p16, [torch.ones(5)], [torch.zeros(5)], [torch.zeros(5)],
                          master_params=[torch.ones(5)], stochastic_rounding=True)
    with pytest.raises(TypeError, match="step is required with stochastic_rounding"):
        mtapply.sgd_step(p16, [torch.ones(5, dtype=torch.bfloat16)], lr=0.1,
                         stochastic_rounding=True)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        mtapply.sgd_step(p16, [torch.ones(5, dtype=torch.bfloat16)], lr=0.1, step=1, seed=-1,
                         stochastic_rounding=True)
    assert torch.equal(p16[0], torch.ones(5, dtype=torch.bfloat16))


def test_torch_adamw_with_stochastic_rounding_steps_like_the_functional_call():
    import mtapply.torch as mt

    model, twin = _bf16_twins(0)
    opt = mt.AdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, seed=3)
    params = [p.detach() for p in twin.parameters()]
    m = [torch.zeros_like(p) for p in params]  # bfloat16 moments, as the class keeps them
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, 5):
        _backward(model, twin, t)
        opt.step()
        mtapply.adam_step(params, [p.grad for p in twin.parameters()], m, v, lr=1e-3, step=t,
                          weight_decay=1e-2, decoupled_weight_decay=True, seed=3,
                          stochastic_rounding=True)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16  # as torch keeps it


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_torch_sgd_with_stochastic_rounding_steps_like_the_functional_call(momentum):
    import mtapply.torch as mt

    model, twin = _bf16_twins(1)
    opt = mt.SGD(model.parameters(), lr=0.05, momentum=momentum, stochastic_rounding=True, seed=9)
    params = [p.detach() for p in twin.parameters()]
    buffers = [torch.zeros_like(p) for p in params] if momentum else None
    for t in range(1, 5):
        _backward(model, twin, t)
        opt.step()
        mtapply.sgd_step(params, [p.grad for p in twin.parameters()], buffers, lr=0.05, step=t,
                         momentum=momentum, seed=9, stochastic_rounding=True)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert float(opt.state[model[0].weight]["step"]) == 4


def _bf16_twins(seed):
    """A small bfloat16 network and its copy."""
    import copy

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4)).to(torch.bfloat16)
    return model, copy.deepcopy(model)


def _backward(model, twin, t):
    """The same batch's grads in both networks."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
    for net in (model, twin):
        net.zero_grad()
        net(x).float().square().mean().backward()
