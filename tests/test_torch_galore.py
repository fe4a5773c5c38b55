"""mtapply.torch.GaLoreAdamW on the CPU: against the float64 definition
(reference.galore_adamw) with the projector refreshed every few steps, against galore-torch
where it is installed, a state_dict round trip, the moments' memory, and its checks."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from mtapply import reference  # noqa: E402
from mtapply.galore import projection_side  # noqa: E402
from mtapply.galore import projector as singular_vectors  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 50),
                               torch.nn.Tanh(), torch.nn.Linear(50, 6))


def _groups(model, **galore):
    matrices = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, torch.nn.Linear)]
    return [{"params": matrices, **galore}, {"params": biases}]


def _loss(model, k):
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(k))
    return model(x).square().mean()


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
def test_steps_follow_the_float64_definition(proj_type):
    model = _model()
    galore = dict(rank=4, update_proj_gap=3, scale=0.5, proj_type=proj_type)
    opt = mt.GaLoreAdamW(_groups(model, **galore), lr=1e-2, weight_decay=0.05)
    want = {id(p): [p.detach().double().numpy().copy(), None, None, None] for p in model.parameters()}
    for t in range(1, 9):
        opt.zero_grad()
        _loss(model, t).backward()
        grads = {id(p): p.grad.detach().clone() for p in model.parameters()}
        opt.step()
        for p in model.parameters():
            entry = want[id(p)]
            projector = None
            if p.dim() == 2:
                if (t - 1) % 3 == 0:
                    side = projection_side(p.shape, proj_type)
                    entry[3] = (side, singular_vectors(grads[id(p)], 4, side == "left").double().numpy())
                projector = entry[3]
            if entry[1] is None:
                shape = p.shape if projector is None else (
                    (4, p.shape[1]) if projector[0] == "left" else (p.shape[0], 4))
                entry[1], entry[2] = np.zeros(shape), np.zeros(shape)
            entry[0], entry[1], entry[2] = reference.galore_adamw(
                entry[0], grads[id(p)].double().numpy(), entry[1], entry[2], projector, lr=1e-2,
                step=t, weight_decay=0.05, scale=0.5 if projector else 1.0)
    for p in model.parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), want[id(p)][0], rtol=1e-4,
                                   atol=1e-5)
    first = opt.state[model[0].weight]
    assert first["exp_avg"].shape == ((24, 4) if projection_side((24, 40), proj_type) == "right"
                                      else (4, 40))


def test_matches_galore_torch():
    galore_torch = pytest.importorskip("galore_torch")
    ours_model, theirs_model = _model(), _model()
    galore = dict(rank=4, update_proj_gap=5, scale=0.25, proj_type="std")
    ours = mt.GaLoreAdamW(_groups(ours_model, **galore), lr=3e-3, weight_decay=0.01)
    theirs = galore_torch.GaLoreAdamW(_groups(theirs_model, **galore), lr=3e-3,
                                      weight_decay=0.01)
    for k in range(12):
        for model, opt in ((ours_model, ours), (theirs_model, theirs)):
            opt.zero_grad()
            _loss(model, k).backward()
            opt.step()
    for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_moment_memory():
    model = _model()
    opt = mt.GaLoreAdamW(_groups(model, rank=4, update_proj_gap=4), lr=1e-2)
    for k in range(3):
        opt.zero_grad()
        _loss(model, k).backward()
        opt.step()
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    twin = _model()
    twin.load_state_dict(saved_model)
    twin_opt = mt.GaLoreAdamW(_groups(twin, rank=4, update_proj_gap=4), lr=1e-2)
    twin_opt.load_state_dict(saved)
    for net, o in ((model, opt), (twin, twin_opt)):
        for k in range(3, 6):
            o.zero_grad()
            _loss(net, k).backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    w = model[2].weight  # 50 x 24: right projection keeps 50 x 4 moments
    state = opt.state[w]
    assert state["exp_avg"].shape == (50, 4) and state["ortho"].shape == (4, 24)
    assert state["exp_avg"].numel() * 2 < 0.4 * w.numel() * 2


def test_a_rank_above_the_smaller_side_keeps_the_whole_side():
    model = torch.nn.Linear(40, 6)  # a 6 x 40 weight at rank 10: left projection of all 6 rows
    opt = mt.GaLoreAdamW([{"params": [model.weight], "rank": 10}], lr=1e-2)
    model(torch.randn(4, 40)).square().mean().backward()
    opt.step()
    assert opt.state[model.weight]["ortho"].shape == (6, 6)
    assert opt.state[model.weight]["exp_avg"].shape == (6, 40)


def test_bad_groups_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        mt.GaLoreAdamW(_groups(model, rank=0))
    with pytest.raises(ValueError, match="proj_type 'full'"):
        mt.GaLoreAdamW(_groups(model, rank=4, proj_type="full"))
    with pytest.raises(ValueError, match="lr \\* weight_decay must be < 1"):
        mt.GaLoreAdamW(model.parameters(), lr=1.0, weight_decay=1.0)


def test_projected_steps_keep_one_bound_step():
    """The projected matrices step by a ProjectedStep bound to the optimizer's own buffers
    (its products and its Adam plan): the same one every step, projector refreshes included,
    and a fresh one for moments a load replaced."""
    model = _model()
    opt = mt.GaLoreAdamW(_groups(model, rank=4, update_proj_gap=2), lr=1e-2)
    seen = []
    for k in range(5):
        opt.zero_grad()
        _loss(model, k).backward()
        opt.step()
        seen.append(list(opt._steps._steps.values()))
    assert all(len(steps) == 1 and steps[0] is seen[0][0] for steps in seen)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.zero_grad()
    _loss(model, 5).backward()
    opt.step()
    (bound,) = opt._steps._steps.values()
    assert bound is not seen[0][0]


def _always_unbound(monkeypatch):
    monkeypatch.setattr("mtapply.torch_galore._BoundGroup.step", lambda self, group, version: False)


@pytest.mark.parametrize("deepcopied", [False, True])
def test_bound_group_steps_equal_the_steps_that_look_at_every_param(deepcopied, monkeypatch):
    """Steps between refreshes run a bound group step; the same run where every step looks at
    every param gives the same params and state: through a param without a grad for a step,
    a refresh, a state_dict load and (`deepcopied`) a deepcopy of model and optimizer."""
    runs = []
    for unbound in (False, True):
        if unbound:
            _always_unbound(monkeypatch)
        model = _model()
        opt = mt.GaLoreAdamW(_groups(model, rank=4, update_proj_gap=4, scale=0.5), lr=1e-2,
                             weight_decay=0.05)
        for k in range(12):
            if k == 9 and deepcopied:
                model, opt = copy.deepcopy((model, opt))  # torch's fields; bound steps anew
            opt.zero_grad()
            _loss(model, k).backward()
            if k == 5:
                model[2].weight.grad = None  # not stepped this time
            if k == 7:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            opt.step()
        runs.append((model, opt))
    (fast, fast_opt), (slow, slow_opt) = runs
    for p, q in zip(fast.parameters(), slow.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        a, b = fast_opt.state[p], slow_opt.state[q]
        assert a["step"] == b["step"] and torch.equal(a["exp_avg"], b["exp_avg"])
    assert fast_opt.state[fast[2].weight]["step"] == 11
    assert fast_opt.state[fast[0].weight]["step"] == 12


def test_a_step_between_refreshes_runs_the_bound_group_step(monkeypatch):
    model = _model()
    opt = mt.GaLoreAdamW(_groups(model, rank=4, update_proj_gap=100), lr=1e-2)
    calls = []
    unbound = type(opt)._unbound_step
    monkeypatch.setattr(type(opt), "_unbound_step",
                        lambda self, group: calls.append(1) or unbound(self, group))
    for k in range(4):
        opt.zero_grad()
        _loss(model, k).backward()
        opt.step()
    assert len(calls) == 2  # the first step of each group; the others ran bound
