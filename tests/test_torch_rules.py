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
    with pytest.raises(ValueError, match="param group 0: beta1 must be a finite number, got nan"):
        mt.optimizer(rule, params, lr=0.1, beta1=float("nan"))
    opt = mt.optimizer(rule, params, lr=0.1)
    opt.param_groups[0]["beta1"] = float("nan")  # a group edit is checked at the next step
    for p in params:
        p.grad = torch.ones_like(p)
    kept = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="beta1 must be"):
        opt.step()
    for p, k in zip(params, kept):
        np.testing.assert_array_equal(p.detach().numpy(), k.numpy())


def _pair(make_ours, make_theirs, steps=12, seed=3, scheduler=True):
    ours, theirs = _model(seed), _model(seed)
    opt, ref = make_ours(ours.parameters()), make_theirs(theirs.parameters())
    sched = (lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5)) if scheduler else \
        (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0))
    _train(ours, opt, sched(opt), steps)
    _train(theirs, ref, sched(ref), steps)
    return ours, theirs, opt, ref


@pytest.mark.parametrize("options", [dict(), dict(lr_decay=0.01, weight_decay=0.05),
                                     dict(initial_accumulator_value=0.3, eps=1e-6),
                                     dict(maximize=True, weight_decay=0.01)],
                         ids=["defaults", "decay", "initial", "maximize"])
def test_adagrad_matches_torch_optim(options):
    ours, theirs, opt, ref = _pair(lambda p: mt.Adagrad(p, lr=0.05, **options),
                                   lambda p: torch.optim.Adagrad(p, lr=0.05, foreach=False,
                                                                 **options))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[a]["sum"], ref.state[b]["sum"], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centered"])
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["no-momentum", "momentum"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_rmsprop_matches_torch_optim(centered, momentum, maximize):
    options = dict(lr=1e-3, alpha=0.9, weight_decay=0.01, momentum=momentum, centered=centered,
                   maximize=maximize)
    ours, theirs, opt, ref = _pair(lambda p: mt.RMSprop(p, **options),
                                   lambda p: torch.optim.RMSprop(p, foreach=False, **options))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key in ref.state[b]:
            torch.testing.assert_close(opt.state[a][key].reshape(ref.state[b][key].shape),
                                       ref.state[b][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(), dict(weight_decay=0.05, eps=1e-3),
                                     dict(maximize=True, weight_decay=0.01)],
                         ids=["defaults", "decay", "maximize"])
@pytest.mark.parametrize("name,lr", [("Adamax", 2e-2), ("Adadelta", 0.5), ("RAdam", 1e-2),
                                     ("NAdam", 1e-2)])
def test_adamax_adadelta_radam_and_nadam_match_torch_optim(name, lr, options):
    ours, theirs, opt, ref = _pair(lambda p: getattr(mt, name)(p, lr=lr, **options),
                                   lambda p: getattr(torch.optim, name)(p, lr=lr, foreach=False,
                                                                        **options))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        assert set(opt.state[a]) == set(ref.state[b])
        for key in ref.state[b]:
            torch.testing.assert_close(opt.state[a][key].reshape(ref.state[b][key].shape),
                                       ref.state[b][key].to(opt.state[a][key].dtype),
                                       rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_radam_with_decoupled_weight_decay_matches_torch_optim(maximize):
    options = dict(lr=1e-2, betas=(0.85, 0.995), weight_decay=0.1, decoupled_weight_decay=True,
                   maximize=maximize)
    ours, theirs, opt, ref = _pair(lambda p: mt.RAdam(p, **options),
                                   lambda p: torch.optim.RAdam(p, foreach=False, **options),
                                   steps=16)
    assert opt.param_groups[0]["decoupled_weight_decay"]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"],
                                   rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("name,options", [("Adamax", dict(betas=(0.8, 0.99), weight_decay=0.01)),
                                          ("Adadelta", dict(rho=0.8, weight_decay=0.01)),
                                          ("RAdam", dict(betas=(0.8, 0.99), weight_decay=0.01,
                                                         decoupled_weight_decay=True)),
                                          ("NAdam", dict(betas=(0.8, 0.99), weight_decay=0.01,
                                                         momentum_decay=0.01))])
def test_adamax_adadelta_radam_and_nadam_checkpoints_move_both_ways(name, options):
    a, b = _model(6), _model(6)
    ref = getattr(torch.optim, name)(a.parameters(), lr=0.1, **options)
    _train(a, ref, torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0), 3)
    b.load_state_dict(a.state_dict())
    ours = getattr(mt, name)(b.parameters(), lr=1.0)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert ours.param_groups[0]["lr"] == 0.1 and ours.param_groups[0]["weight_decay"] == 0.01
    _train(a, ref, torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0), 3, seed=9)
    _train(b, ours, torch.optim.lr_scheduler.LambdaLR(ours, lambda k: 1.0), 3, seed=9)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    back = getattr(torch.optim, name)(a.parameters(), lr=1.0)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert set(back.state[next(a.parameters())]) == set(ref.state[next(a.parameters())])


@pytest.mark.parametrize("make,message", [
    (lambda p: mt.Adamax(p, betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
    (lambda p: mt.Adamax(p, eps=-1.0), "Invalid epsilon value"),
    (lambda p: mt.Adadelta(p, rho=1.5), "Invalid rho value"),
    (lambda p: mt.Adadelta(p, lr=-1.0), "Invalid learning rate"),
    (lambda p: mt.RAdam(p, betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
    (lambda p: mt.RAdam(p, weight_decay=-0.1), "Invalid weight_decay value"),
    (lambda p: mt.NAdam(p, momentum_decay=-0.1), "Invalid momentum_decay value")])
def test_adamax_adadelta_radam_and_nadam_refuse_torchs_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make(_model(0).parameters())


def test_checkpoints_move_between_torch_optim_and_mtapply():
    a, b = _model(4), _model(4)
    ref = torch.optim.RMSprop(a.parameters(), lr=1e-3, momentum=0.9, centered=True)
    _train(a, ref, torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0), 3)
    b.load_state_dict(a.state_dict())
    ours = mt.RMSprop(b.parameters(), lr=1.0)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert ours.param_groups[0]["centered"] and ours.param_groups[0]["momentum"] == 0.9
    _train(a, ref, torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0), 3, seed=9)
    _train(b, ours, torch.optim.lr_scheduler.LambdaLR(ours, lambda k: 1.0), 3, seed=9)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    back = torch.optim.RMSprop(a.parameters(), lr=1.0)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert set(back.state[next(a.parameters())]) == {"step", "square_avg", "grad_avg",
                                                     "momentum_buffer"}


def test_lion_follows_its_float64_definition():
    model = _model(5)
    opt = mt.Lion(model.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    want = [p.detach().double().clone() for p in model.parameters()]
    moments = [torch.zeros_like(w) for w in want]
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        for i, p in enumerate(model.parameters()):
            grad = p.grad.double()
            c = 0.8 * moments[i] + 0.2 * grad
            want[i] = want[i] * (1 - 1e-4) - 1e-3 * torch.sign(c)
            moments[i] = 0.95 * moments[i] + 0.05 * grad
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-7)
            w.copy_(p.detach().double())  # no drift: each step from the float32 params
    for p, m in zip(model.parameters(), moments):
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-5, atol=1e-7)


def _torch_beside_optax(make_opt, tx, seed):
    """Steps a torch optimizer (`make_opt(params)`) and an optax transformation `tx` on the
    same params and grads, six steps; asserts equal params; returns (opt, its params, tx's
    state, tx's params)."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (7,)]]
    grads_seq = [[rng.standard_normal(p.shape).astype(np.float32) for p in params]
                 for _ in range(6)]
    ours = [torch.tensor(p, requires_grad=True) for p in params]
    opt = make_opt(ours)
    jparams = [jax.numpy.asarray(p) for p in params]
    state = tx.init(jparams)
    for grads in grads_seq:
        for p, g in zip(ours, grads):
            p.grad = torch.tensor(g)
        opt.step()
        updates, state = tx.update([jax.numpy.asarray(g) for g in grads], state, jparams)
        jparams = [p + u for p, u in zip(jparams, updates)]
    for p, q in zip(ours, jparams):
        np.testing.assert_allclose(p.detach().numpy(), np.asarray(q), rtol=1e-5, atol=1e-6)
    return opt, ours, state, jparams


def test_adan_class_follows_the_optax_rule_through_torch():
    """mtapply.torch.Adan and mtapply.optax.adan run one rule: equal steps on equal data."""
    mtx = pytest.importorskip("mtapply.optax")
    _torch_beside_optax(lambda p: mt.Adan(p, lr=1e-2, betas=(0.9, 0.8, 0.95), weight_decay=0.02),
                        mtx.adan(1e-2, b1=0.9, b2=0.8, b3=0.95, weight_decay=0.02), seed=6)


@pytest.mark.parametrize("hyper", [dict(lr=1e-2),
                                   dict(lr=3e-2, warmup_steps=3, betas=(0.8, 0.99),
                                        weight_decay=0.05, weight_lr_power=1.0)],
                         ids=["constant", "warmup"])
def test_schedule_free_adamw_follows_mtapply_optax_and_swaps_for_eval(hyper):
    """mtapply.torch.ScheduleFreeAdamW and mtapply.optax.schedule_free_adamw (which follows
    optax.contrib's) step alike; eval() puts the average in the params and train() takes
    them back."""
    mtx = pytest.importorskip("mtapply.optax")
    b1, b2 = hyper.get("betas", (0.9, 0.999))
    tx = mtx.schedule_free_adamw(hyper["lr"], warmup_steps=hyper.get("warmup_steps"), b1=b1,
                                 b2=b2, weight_decay=hyper.get("weight_decay", 0.0),
                                 weight_lr_power=hyper.get("weight_lr_power", 2.0))
    opt, ours, state, jparams = _torch_beside_optax(
        lambda p: mt.ScheduleFreeAdamW(p, **hyper), tx, seed=7)
    trained = [p.detach().clone() for p in ours]
    opt.eval()
    for p, q in zip(ours, mtx.schedule_free_eval_params(state, jparams)):
        np.testing.assert_allclose(p.detach().numpy(), np.asarray(q), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step()
    opt.train()
    for p, q in zip(ours, trained):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-5)


def test_schedule_free_groups_without_grads_keep_their_weights():
    model = _model(8)
    opt = mt.ScheduleFreeAdamW([{"params": model[0].parameters()},
                                {"params": model[2].parameters()}], lr=1e-2)
    for p in model[2].parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.param_groups[1]["k"] == 1 and opt.param_groups[1]["weight_sum"] > 0
    assert opt.param_groups[0]["k"] == 0 and opt.param_groups[0]["weight_sum"] == 0


def _two_groups(params):
    params = list(params)  # the first layer's weight and bias, then the second's
    return [{"params": params[:2], "momentum_decay": 0.02},
            {"params": params[2:], "betas": (0.7, 0.99)}]


def test_nadam_keeps_one_mu_product_per_group_as_torch_optim_does():
    ours, theirs, opt, ref = _pair(lambda p: mt.NAdam(_two_groups(p), lr=1e-2),
                                   lambda p: torch.optim.NAdam(_two_groups(p), lr=1e-2,
                                                               foreach=False))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[a]["mu_product"], ref.state[b]["mu_product"],
                                   rtol=1e-6, atol=0)
    first, last = list(ours.parameters())[0], list(ours.parameters())[-1]
    assert opt.state[first]["mu_product"].item() != opt.state[last]["mu_product"].item()
    saved = opt.state_dict()["state"][0]["mu_product"]
    assert saved.device.type == "cpu" and saved.dtype == torch.float32 and saved.dim() == 0
    twin = copy.deepcopy(opt)  # a copy steps on from the same mu_product
    assert twin.state[list(twin.state)[0]]["mu_product"].item() == opt.state[first][
        "mu_product"].item()


def _skipping_run(make, dtype, steps=6, missed=(1, 2)):
    """Two params; the second has no grad at the `missed` steps."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(6, generator=g, dtype=dtype)) for _ in range(2))
    opt = make([a, b])
    for t in range(steps):
        grads = [torch.randn(6, generator=g, dtype=dtype) for _ in range(2)]
        a.grad, b.grad = grads[0], None if t in missed else grads[1]
        opt.step()
    return opt, a, b


def test_nadam_params_that_miss_steps_keep_their_own_mu_product():
    """A param without a grad at some steps keeps its mu_product (torch.optim.NAdam's is per
    param), while the others' advance."""
    ours = _skipping_run(lambda p: mt.NAdam(p, lr=0.1), torch.float64)
    theirs = _skipping_run(lambda p: torch.optim.NAdam(p, lr=0.1, foreach=False), torch.float64)
    for p, q in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)  # (torch's mu_product is float32)
        torch.testing.assert_close(ours[0].state[p]["mu_product"].float(),
                                   theirs[0].state[q]["mu_product"], rtol=1e-6, atol=0)
    a, b = ours[1:]
    assert ours[0].state[a]["mu_product"].item() != ours[0].state[b]["mu_product"].item()


def test_rules_with_scalar_state_step_complex128_params():
    """A complex128 param steps as its float64 real view, its scalar state float64."""
    results = []
    for make in (mt.NAdam, lambda p, **o: torch.optim.NAdam(p, foreach=False, **o)):
        g = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.complex128))
        opt = make([p], lr=1e-2)
        for _ in range(4):
            p.grad = torch.randn(3, 4, generator=g, dtype=torch.complex128)
            opt.step()
        results.append(p.detach())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=0)


def test_nadam_refuses_a_group_whose_params_hold_different_mu_products():
    model = _model(2)
    ref = torch.optim.NAdam(model.parameters(), lr=1e-2)
    _train(model, ref, torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0), 2)
    saved = copy.deepcopy(ref.state_dict())
    saved["state"][1]["mu_product"] = saved["state"][1]["mu_product"] * 0.5
    ours = mt.NAdam(model.parameters(), lr=1e-2)
    ours.load_state_dict(saved)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="keeps one 'mu_product' for params of one group"):
        _train(model, ours, torch.optim.lr_scheduler.LambdaLR(ours, lambda k: 1.0), 1)
    for p, p0 in zip(model.parameters(), before):
        torch.testing.assert_close(p, p0, rtol=0, atol=0)
