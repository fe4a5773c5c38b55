"""The functional GaLore (mtapply.galore) on NumPy arrays and torch CPU tensors: against the
float64 definition with projector refreshes, against mtapply.torch.GaLoreAdamW, its state's
memory and its checks."""
import numpy as np
import pytest

import mtapply
from mtapply import reference
from mtapply.galore import galore_adamw_step, galore_state, projector

SHAPES = [(30, 20), (12, 50), (7,), (20, 20)]


def _draw(rng, scale=1.0):
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in SHAPES]


def test_numpy_steps_follow_the_float64_definition():
    rng = np.random.default_rng(0)
    params = _draw(rng)
    state = galore_state(params, rank=4, update_proj_gap=3, scale=0.5)
    want = [[p.astype(np.float64), None, None, None] for p in params]
    for t in range(1, 8):
        grads = _draw(rng)
        galore_adamw_step(params, grads, state, lr=1e-2, step=t, weight_decay=0.05)
        for k, (entry, grad, projection) in enumerate(zip(want, grads, state.projections)):
            side = None
            if projection is not None:
                side = "left" if projection.left else "right"
                if (t - 1) % 3 == 0:
                    entry[3] = (side, projector(grad, 4, projection.left).astype(np.float64))
            if entry[1] is None:
                entry[1] = np.zeros(state.exp_avgs[k].shape)
                entry[2] = np.zeros(state.exp_avgs[k].shape)
            entry[0], entry[1], entry[2] = reference.galore_adamw(
                entry[0], grad, entry[1], entry[2], entry[3] if side else None, lr=1e-2, step=t,
                weight_decay=0.05, scale=0.5 if side else 1.0)
    for k, (got, entry) in enumerate(zip(params, want)):
        np.testing.assert_allclose(got, entry[0], rtol=1e-4, atol=1e-5, err_msg=f"params[{k}]")
    assert state.exp_avgs[0].shape == (30, 4) and state.exp_avgs[1].shape == (4, 50)
    assert state.exp_avgs[2].shape == (7,)


def test_torch_tensors_step_like_the_torch_optimizer():
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    g = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    twins = [torch.nn.Parameter(p.clone()) for p in params]
    state = mtapply.galore_state(params, rank=4, update_proj_gap=2)
    opt = mt.GaLoreAdamW([{"params": [t for t in twins if t.dim() == 2], "rank": 4,
                           "update_proj_gap": 2}, {"params": [t for t in twins if t.dim() != 2]}],
                         lr=3e-3, weight_decay=0.01)
    for t in range(1, 6):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        mtapply.galore_adamw_step(params, grads, state, lr=3e-3, step=t, weight_decay=0.01)
        for twin, grad in zip(twins, grads):
            twin.grad = grad
        opt.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b.detach())


def test_state_memory_and_checks():
    params = [np.zeros((1024, 512), np.float32), np.zeros(512, np.float32)]
    state = galore_state(params, rank=16)
    galore_adamw_step(params, [np.ones((1024, 512), np.float32), np.ones(512, np.float32)],
                      state, lr=1e-3, step=1)
    # rank-16 moments of the 1024 x 512 matrix, its 16 x 512 projector, the bias's moments
    assert state.nbytes() == 4 * (2 * 1024 * 16 + 16 * 512 + 2 * 512)
    with pytest.raises(ValueError, match="params has 2 tensors, grads 1"):
        galore_adamw_step(params, [np.ones(512, np.float32)], state, lr=1e-3, step=2)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        galore_state(params, rank=0)
    with pytest.raises(ValueError, match="proj_type 'full'"):
        galore_state(params, rank=4, proj_type="full")
    with pytest.raises(TypeError, match="GaLore takes torch tensors, CuPy or NumPy arrays"):
        galore_state([[[1.0, 2.0]]], rank=1)


def test_a_grad_of_another_shape_or_dtype_is_refused_before_anything_is_written():
    rng = np.random.default_rng(3)
    params = _draw(rng)
    state = galore_state(params, rank=4)
    before = [p.copy() for p in params]
    for k, bad in ((0, np.ones((20, 30), np.float32)), (2, np.ones(7, np.float64))):
        grads = _draw(rng)
        grads[k] = bad
        with pytest.raises(ValueError, match=rf"grads\[{k}\] is .* but params\[{k}\] is"):
            galore_adamw_step(params, grads, state, lr=1e-2, step=1)
    assert all(np.array_equal(a, b) for a, b in zip(params, before))
    assert all(p is None or p.ortho is None for p in state.projections)  # no refresh ran
