"""A step of mtapply.torch is whole or nothing: every param group's options are checked before
any group launches (a bad value in the last group leaves the first one's params and states
bit-identical), whichever way the groups step (merged into one plan, one plan per group, with
flat_grads); rule-based optimizers check each hyperparameter against its rule's range at
construction and after a group edit; GaLoreAdamW checks before step counts, projectors or
params move, naming the option as the user gave it; ScheduleFreeAdamW counts its steps with
flat_grads as without."""
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
import mtapply.torch as mt  # noqa: E402
from mtapply.rules import library  # noqa: E402

LION = mtapply.rule("lion_ranged", slots="param:rw grad:r exp_avg:rw",
                    hyper=dict(lr=(None, ">= 0"), beta1=(0.9, "[0, 1)"), beta2=(0.99, "[0, 1)"),
                               weight_decay=(0.0, ">= 0")),
                    update="""
                        c = beta1 * exp_avg + (1 - beta1) * grad
                        param = param * (1 - lr * weight_decay) - lr * sign(c)
                        exp_avg = beta2 * exp_avg + (1 - beta2) * grad
                    """)
UNRANGED = mtapply.rule("sgd_unranged", slots="param:rw grad:r",
                        hyper=dict(lr=None), update="param = param - lr * grad")


def _rule(rule):
    def make(groups, **options):
        return mt.optimizer(rule, groups, **options)
    make.__name__ = f"optimizer({rule.name})"
    return make


# (maker, options, a bad edit of group 1, what the message names)
CASES = [
    (mt.Adam, dict(lr=1e-2), {"betas": (1.5, 0.999)}, r"betas\[0\] must be \[0\.0, 1\.0\)"),
    (mt.AdamW, dict(lr=1e-2, amsgrad=True), {"eps": -1.0}, "eps must be >= 0.0, got -1.0"),
    (mt.Adam8bit, dict(lr=1e-2, min_8bit_size=1), {"weight_decay": -0.1}, "weight_decay"),
    (mt.AdamW8bit, dict(lr=1e-2), {"betas": (0.9, 1.0)}, r"betas\[1\] must be"),
    (mt.SGD, dict(lr=0.1, momentum=0.9), {"dampening": 2.0}, r"dampening must be \[0\.0, 1\.0\]"),
    (mt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), {"dampening": 0.5}, "nesterov=True needs"),
    (mt.LARS, dict(lr=0.1), {"trust_coefficient": -1.0}, "trust_coefficient must be >= 0.0"),
    (mt.LAMB, dict(lr=1e-2), {"max_grad_norm": -1.0}, "max_grad_norm must be >= 0.0"),
    (mt.Adagrad, dict(lr=0.1), {"lr_decay": -1.0}, "lr_decay must be >= 0"),
    (mt.RMSprop, dict(lr=1e-2, momentum=0.5), {"alpha": -0.5}, "alpha must be >= 0"),
    (mt.RMSprop, dict(lr=1e-2), {"momentum": -0.5}, "momentum must be >= 0"),
    (mt.Lion, dict(lr=1e-3), {"betas": (1.5, 0.99)}, r"betas\[0\] must be \[0, 1\)"),
    (mt.Adan, dict(lr=1e-2), {"eps": -1.0}, "eps must be >= 0"),
    (mt.ScheduleFreeAdamW, dict(lr=1e-2), {"betas": (0.0, 0.999)}, r"betas\[0\] must be \(0"),
    (mt.ScheduleFreeAdamW, dict(lr=1e-2), {"warmup_steps": -2}, "warmup_steps must be >= 0"),
    (_rule(LION), dict(lr=1e-3), {"beta1": 1.5}, r"beta1 must be \[0, 1\), got 1\.5"),
    (_rule(UNRANGED), dict(lr=1e-2), {"lr": float("inf")}, "lr must be a finite number"),
]
IDS = [f"{make.__name__}-{next(iter(edit))}" for make, _, edit, _ in CASES]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device))
            for shape in ((6, 4), (4,), (3, 5), (5,))]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for p in params])


def _assert_unchanged(opt, params, snapshot):
    values, states = snapshot
    for p, value, state in zip(params, values, states):
        assert torch.equal(p.detach(), value)
        assert opt.state[p].keys() == state.keys()
        for name, kept in state.items():
            now = opt.state[p][name]
            assert torch.equal(now, kept) if torch.is_tensor(kept) else now == kept, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["merged", "a plan per group", "flat_grads"])
@pytest.mark.parametrize("make,options,edit,match", CASES, ids=IDS)
def test_a_bad_option_in_the_last_group_raises_before_any_group_steps(make, options, edit,
                                                                       match, layout, device):
    params = _params(device=device)
    opt = make([{"params": params[:2]}, {"params": params[2:]}], **options,
               **({"flat_grads": True} if layout == "flat_grads" else {}))
    if layout == "a plan per group":
        opt._merges_groups = False  # as groups of differing compile options step
    for t in range(2):  # states, step counts and plans made; the latest step may repeat
        opt.zero_grad()
        _grads(params, t) if layout != "flat_grads" else _flat_grads(params, t)
        opt.step()
    opt.zero_grad()
    _grads(params, 2) if layout != "flat_grads" else _flat_grads(params, 2)
    good = {key: opt.param_groups[1][key] for key in edit}
    opt.param_groups[1].update(edit)
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match=f"param group 1: {match}"):
        opt.step()
    _assert_unchanged(opt, params, snapshot)
    opt.param_groups[1].update(good)  # the same optimizer steps again once the value is fixed
    opt.step()
    assert not torch.equal(params[0].detach(), snapshot[0][0])


def _flat_grads(params, seed):
    """Grads written into the grads the optimizer holds (flat_grads: its views)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=g).to(p.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,options", [(make, options) for make, options, _, _ in CASES[:14]],
                         ids=IDS[:14])
def test_a_negative_lr_set_by_a_scheduler_raises_naming_its_group(make, options, device):
    """Numbers set as lrs alone are checked without looking at the other options."""
    params = _params(device=device)
    opt = make([{"params": params[:2]}, {"params": params[2:]}], **options)
    opt._merges_groups = False
    _grads(params, 0)
    opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[1]["lr"] = -1e-3
    snapshot = _snapshot(opt, params)
    with pytest.raises(ValueError, match="param group 1: lr"):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


@pytest.mark.parametrize("make,options,bad,match", [
    (_rule(LION), dict(lr=1e-3), {"beta2": 1.0}, r"param group 0: beta2 must be \[0, 1\)"),
    (_rule(LION), dict(lr=-1e-3), {}, r"param group 0: lr must be >= 0, got -0\.001"),
    (_rule(UNRANGED), dict(lr=float("nan")), {}, "param group 0: lr must be a finite number, got nan"),
    (mt.Lion, dict(lr=1e-3, betas=(0.9, 1.5)), {}, "Invalid beta parameter at index 1"),
    (mt.Adan, dict(lr=-1.0), {}, "Invalid learning rate"),
])
def test_rule_based_optimizers_check_their_options_when_made(make, options, bad, match):
    with pytest.raises(ValueError, match=match):
        make(_params(), **options, **bad)


def test_every_rule_hyperparameter_is_checked_against_its_range_after_an_edit():
    """Each shipped rule's hyperparameter, set out of its range in a group, is refused at the
    next step before anything is written."""
    cases = [(mt.Adagrad, "eps", -1.0), (mt.Adagrad, "weight_decay", -1.0),
             (mt.RMSprop, "eps", -1.0), (mt.RMSprop, "weight_decay", -1.0),
             (mt.Adan, "weight_decay", -1.0), (mt.Adan, "lr", -1.0),
             (mt.Lion, "weight_decay", -1.0), (mt.ScheduleFreeAdamW, "eps", -1.0)]
    for make, name, value in cases:
        params = _params()
        opt = make(params, lr=1e-2)
        _grads(params, 0)
        opt.step()
        opt.param_groups[0][name] = value
        snapshot = _snapshot(opt, params)
        with pytest.raises(ValueError, match=f"param group 0: {name} must be"):
            opt.step()
        _assert_unchanged(opt, params, snapshot)


def test_galore_checks_every_group_before_anything_moves():
    matrices, vectors = _params()[::2], _params()[1::2]
    opt = mt.GaLoreAdamW([{"params": matrices, "rank": 2, "update_proj_gap": 2},
                          {"params": vectors}], lr=1e-2)
    for t in range(2):
        _grads(matrices + vectors, t)
        opt.step()
    _grads(matrices + vectors, 2)  # step 3 refreshes the projectors: nothing may move
    for edit, match in (({"eps": -18.0}, "param group 1: eps must be >= 0.0, got -18.0"),
                        ({"betas": (0.9, 1.0)}, r"param group 1: betas\[1\] must be"),
                        ({"lr": torch.tensor([1e-2, 1e-3])},
                         "param group 1: Tensor lr must be 1-element"),
                        ({"weight_decay": 200.0}, "param group 1: lr \\* weight_decay must be < 1")):
        good = {key: opt.param_groups[1][key] for key in edit}
        opt.param_groups[1].update(edit)
        snapshot = _snapshot(opt, matrices + vectors)
        orthos = [opt.state[p]["ortho"].clone() for p in matrices]
        with pytest.raises(ValueError, match=match):
            opt.step()
        _assert_unchanged(opt, matrices + vectors, snapshot)
        assert all(torch.equal(opt.state[p]["ortho"], o) for p, o in zip(matrices, orthos))
        assert all(opt.state[p]["step"] == 2 for p in matrices + vectors)
        opt.param_groups[1].update(good)
    opt.param_groups[0]["rank"] = 0
    with pytest.raises(ValueError, match="param group 0: rank must be a positive integer"):
        opt.step()


GROUP_OPTIONS = [(mt.AdamW, {}, dict(amsgrad=True)), (mt.NAdam, {}, {}),
                 (mt.SGD, dict(momentum=0.9), dict(momentum=0.9, nesterov=True)),
                 (mt.RMSprop, {}, dict(centered=True)), (mt.Lion, {}, {})]


@pytest.mark.parametrize("make,first,second", GROUP_OPTIONS,
                         ids=[make.__name__ for make, _, _ in GROUP_OPTIONS])
@pytest.mark.parametrize("bad,match", [
    ("shape", r"param 0 \(param group 1\) has shape \(20,\) but its grad \(4, 5\)"),
    ("complex", r"param 0 \(param group 1\) is torch.complex64 but its grad torch.float32"),
])
def test_a_grad_the_step_cannot_read_is_refused_before_anything_is_made(make, first, second,
                                                                        bad, match):
    """A param replaced through .data (its old grad kept) in the last group: refused naming
    it, no param written and no state made, in groups that step as one plan or apart."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(4, 5, generator=g))
    opt = make([dict(params=[a], **first), dict(params=[b], **second)], lr=1e-2)
    a.grad, b.grad = torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    b.data = torch.randn(20) if bad == "shape" else torch.randn(4, 5, dtype=torch.complex64)
    before = a.detach().clone(), b.detach().clone()
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert not opt.state
    b.grad = torch.randn_like(b)  # given a grad of its own: the step goes on
    opt.step()
    assert not torch.equal(a, before[0]) and not torch.equal(b, before[1])


def test_a_tensor_option_other_than_lr_is_read_on_the_host_or_refused():
    """torch.optim.AdamW takes a tensor weight_decay: a CPU one is read as a number at each
    step (as the number it holds); one on a device is refused naming its group."""
    results = []
    for weight_decay in (torch.tensor(0.5, dtype=torch.float64), 0.5):
        params = _params()
        opt = mt.AdamW([{"params": params[:2], "amsgrad": True},
                        {"params": params[2:], "weight_decay": weight_decay}], lr=1e-2)
        for t in range(4):
            _grads(params, t)
            opt.step()
            if t == 1 and torch.is_tensor(weight_decay):
                weight_decay.fill_(0.25)  # read again at the next step
            elif t == 1:
                opt.param_groups[1]["weight_decay"] = 0.25
        results.append(params)
    for p, q in zip(*results):
        assert torch.equal(p, q)
    params = _params()
    message = ("param group 1: weight_decay is a tensor on meta, but AdamW reads only lr and "
               "step on the device: give weight_decay as a number or a CPU tensor")
    on_device = torch.tensor(0.5, device="meta")
    with pytest.raises(TypeError, match=message):
        mt.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": on_device}])
    opt = mt.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    _grads(params, 0)
    opt.param_groups[1]["weight_decay"] = on_device
    with pytest.raises(TypeError, match=message):
        opt.step()
    assert not opt.state and torch.equal(params[0], _params()[0])


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_schedule_free_counts_its_steps_with_flat_grads(warmup_steps):
    """Its per-group running values (steps, max lr, weight sum) advance at every step on the
    flat_grads path too, as without it: the same params, states and checkpoint."""
    results = []
    for flat_grads in (False, True):
        params = _params()
        opt = mt.ScheduleFreeAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}],
                                   lr=1e-2, warmup_steps=warmup_steps, flat_grads=flat_grads)
        for t in range(6):
            opt.zero_grad()
            _flat_grads(params, t) if flat_grads else _grads(params, t)
            opt.step()
        results.append((params, opt))
    (params, opt), (flat_params, flat_opt) = results
    for group in flat_opt.param_groups:
        assert group["k"] == 6
    for key in ("k", "lr_max", "weight_sum"):
        assert [g[key] for g in flat_opt.param_groups] == [g[key] for g in opt.param_groups], key
    for p, q in zip(params, flat_params):
        assert torch.equal(p.detach(), q.detach())
        for name in ("z", "nu"):
            assert torch.equal(opt.state[p][name], flat_opt.state[q][name])
    saved = flat_opt.state_dict()["param_groups"]
    assert [g["k"] for g in saved] == [6, 6]
    assert library.schedule_free_adamw().ranges["ck"] == "[0, 1]"
