"""A user-written rule as a torch.optim.Optimizer (`mtapply.torch.optimizer`) on the CPU:
param groups, LR schedulers and state_dict against torch.optim.Adagrad written as a rule."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
import mtapply.torch as mt  # noqa: E402
from test_rules import ADAGRAD, LION  # noqa: E402


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _train(model, opt, scheduler, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        scheduler.step()


def test_adagrad_rule_as_an_optimizer_matches_torch_with_groups_and_a_scheduler():
    rule = mtapply.rule("adagrad", **ADAGRAD)
    ours, theirs = _model(0), _model(0)
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.05},  # noqa: E731
                        {"params": m[2].parameters(), "weight_decay": 0.01}]
    opt = mt.optimizer(rule, groups(ours), lr=0.1, lr_decay=0.001)
    ref = torch.optim.Adagrad(groups(theirs), lr=0.1, lr_decay=0.001)
    _train(ours, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), 10)
    _train(theirs, ref, torch.optim.lr_scheduler.StepLR(ref, 3, 0.5), 10)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(opt.state[a]["state_sum"], ref.state[b]["sum"], rtol=2e-6,
                                   atol=1e-7)
        assert float(opt.state[a]["step"]) == 10


def test_state_dict_round_trip_continues_the_same_run():
    rule = mtapply.rule("lion", **LION)
    a, b = _model(1), _model(1)
    opt_a = mt.optimizer(rule, a.parameters(), lr=1e-2, weight_decay=0.1)
    _train(a, opt_a, torch.optim.lr_scheduler.LambdaLR(opt_a, lambda k: 1.0), 3)
    b.load_state_dict(a.state_dict())
    opt_b = mt.optimizer(rule, b.parameters(), lr=1.0)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a file: not shared
    assert opt_b.param_groups[0]["lr"] == 1e-2 and opt_b.param_groups[0]["weight_decay"] == 0.1
    _train(a, opt_a, torch.optim.lr_scheduler.LambdaLR(opt_a, lambda k: 1.0), 4, seed=5)
    _train(b, opt_b, torch.optim.lr_scheduler.LambdaLR(opt_b, lambda k: 1.0), 4, seed=5)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_required_and_unknown_hyperparameters():
    rule = mtapply.rule("lion", **LION)
    params = list(_model(2).parameters())
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        mt.optimizer(rule, params)
    with pytest.raises(TypeError, match="no hyperparameter 'momentum'"):
        mt.optimizer(rule, params, lr=0.1, momentum=0.9)
    opt = mt.optimizer(rule, params, lr=0.1, beta1=float("nan"))
    for p in params:
        p.grad = torch.ones_like(p)
    kept = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="beta1 must be"):
        opt.step()
    for p, k in zip(params, kept):
        np.testing.assert_array_equal(p.detach().numpy(), k.numpy())
