"""mtapply.torch with a param group per tensor (per-layer learning rates, decay masks, betas):
against torch.optim on the same groups, with a scheduler whose factor differs per group, a
group added mid-run, and a state_dict round trip (CPU and GPU)."""
import copy

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")
from mtapply import _torch_binding  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PAIRS = [(torch.optim.Adam, mt.Adam), (torch.optim.AdamW, mt.AdamW), (torch.optim.SGD, mt.SGD)]


def _model(device):
    torch.manual_seed(3)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(12, 12), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(12, 3)).to(device)


def _per_tensor_groups(params, cls):
    """One group per tensor, every hyperparameter the optimizer has varying across groups."""
    groups = []
    for k, p in enumerate(params):
        group = {"params": [p], "lr": 1e-2 * (1 + k % 5) / 3,
                 "weight_decay": 0.0 if p.dim() == 1 else 1e-2 * (1 + k % 3)}
        if cls in (torch.optim.SGD, mt.SGD):
            group.update(momentum=(0.0, 0.5, 0.9)[k % 3], nesterov=k % 3 == 2)
        else:
            group.update(betas=(0.8 + 0.05 * (k % 3), 0.99 + 0.004 * (k % 2)), eps=10.0 ** -(6 + k % 3))
        groups.append(group)
    return groups


def _steps(model, opt, scheduler, device, first, last):
    for t in range(first, last):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 12, generator=g).to(device)
        y = torch.randint(0, 3, (8,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _scheduled_steps(reference, ours, device, steps) -> tuple:
    """`steps` steps of both (model, optimizer) pairs under LambdaLR, a factor per group; the
    models then agree. Returns the schedulers."""
    schedulers = []
    for model, opt in (reference, ours):
        factors = [lambda t, k=k: 1.0 / (1 + t * (1 + k % 4) / 10)
                   for k in range(len(opt.param_groups))]
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(opt, factors))
        _steps(model, opt, schedulers[-1], device, 0, steps)
    _assert_same(reference[0], ours[0])
    return tuple(schedulers)


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_cls,mt_cls", PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_a_group_per_tensor_trains_like_torch_optim(torch_cls, mt_cls, device):
    a, b = _model(device), _model(device)
    params_a, params_b = list(a.parameters()), list(b.parameters())
    # the last layer joins later, as add_param_group
    oa = torch_cls(_per_tensor_groups(params_a[:-2], torch_cls), lr=1.0, foreach=False)
    ob = mt_cls(_per_tensor_groups(params_b[:-2], mt_cls), lr=1.0)
    _scheduled_steps((a, oa), (b, ob), device, 4)
    for opt, params, cls in ((oa, params_a, torch_cls), (ob, params_b, mt_cls)):
        for group in _per_tensor_groups(params, cls)[-2:]:
            opt.add_param_group(group)
    _steps(a, oa, None, device, 4, 8)
    _steps(b, ob, None, device, 4, 8)
    _assert_same(a, b)
    assert len(ob.param_groups) == len(params_b)


@pytest.mark.parametrize("device", DEVICES)
def test_per_group_state_dict_round_trip(device):
    a, b = _model(device), _model(device)
    oa = mt.AdamW(_per_tensor_groups(list(a.parameters()), mt.AdamW), lr=1.0)
    _steps(a, oa, None, device, 0, 3)
    b.load_state_dict(a.state_dict())
    ob = mt.AdamW(_per_tensor_groups(list(b.parameters()), mt.AdamW), lr=1.0)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert [g["lr"] for g in ob.param_groups] == [g["lr"] for g in oa.param_groups]
    _steps(a, oa, None, device, 3, 6)
    _steps(b, ob, None, device, 3, 6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_adam_groups_step_as_one_plan_until_they_cannot():
    """Groups of equal compile options share one plan (one launch set), its tensors reading
    their group's hyperparameters (an lr tensor too); another compile option steps per group."""
    model = _model("cpu")
    params = list(model.parameters())
    opt = mt.AdamW(_per_tensor_groups(params, mt.AdamW), lr=1.0)
    _steps(model, opt, None, "cpu", 0, 2)
    assert list(opt._bound) == ["merged"] and len(opt._bound["merged"].parts) == 1
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    _steps(model, opt, None, "cpu", 2, 3)
    assert list(opt._bound) == ["merged"]
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[1]["amsgrad"] = True
    _steps(model, opt, None, "cpu", 3, 4)
    assert "merged" not in opt._bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", [False, True])
def test_every_option_set_between_steps_takes_effect(device, flat_grads):
    """A merged step reads nothing per group while nothing changed: whatever is set in a
    group, by a scheduler or by hand (lr alone, betas, decay, a replaced list), is seen."""
    a, b = _model(device), _model(device)
    oa = torch.optim.AdamW(_per_tensor_groups(list(a.parameters()), torch.optim.AdamW), lr=1.0,
                           foreach=False)
    ob = mt.AdamW(_per_tensor_groups(list(b.parameters()), mt.AdamW), lr=1.0,
                  flat_grads=flat_grads)
    changes = [
        lambda opt: [g.__setitem__("lr", g["lr"] * 0.5) for g in opt.param_groups],
        lambda opt: opt.param_groups[3].__setitem__("lr", 0.3),
        lambda opt: opt.param_groups[2].__setitem__("betas", (0.5, 0.9)),
        lambda opt: opt.param_groups[1].update(weight_decay=0.3, eps=1e-3),
        lambda opt: setattr(opt, "param_groups", list(opt.param_groups)),
        lambda opt: opt.param_groups[0].__setitem__("lr", 0.2),
        lambda opt: [g.__setitem__("lr", 0.01) for g in opt.param_groups],  # all equal
        lambda opt: opt.param_groups[4].__setitem__("lr", 0.05),
    ]
    for t, change in enumerate(changes):
        for model, opt in ((a, oa), (b, ob)):
            change(opt)
            _steps(model, opt, None, device, t, t + 1)
        _assert_same(a, b)
    assert list(ob._bound) == ["merged"]


def test_load_state_dict_pickle_and_deepcopy_keep_the_optimizer_working():
    model = _model("cpu")
    opt = mt.AdamW(_per_tensor_groups(list(model.parameters()), mt.AdamW), lr=1.0,
                   flat_grads=True)
    _steps(model, opt, None, "cpu", 0, 2)
    opt.load_state_dict(opt.state_dict())
    assert opt._flat_grads
    twin_model = copy.deepcopy(model)
    twin = mt.AdamW(_per_tensor_groups(list(twin_model.parameters()), mt.AdamW), lr=1.0,
                    flat_grads=True)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    copied = copy.deepcopy(opt)
    assert copied._flat_grads and type(copied.param_groups[0]) is type(opt.param_groups[0])
    for optimizer in (opt, twin):
        optimizer.param_groups[2]["lr"] = 0.7
    _steps(model, opt, None, "cpu", 2, 4)
    _steps(twin_model, twin, None, "cpu", 2, 4)
    _assert_same(model, twin_model)


@pytest.mark.parametrize("flat_grads", [False, True])
def test_a_param_appended_to_a_group_in_place_is_stepped(flat_grads):
    a, b = _model("cpu"), _model("cpu")
    params_a, params_b = list(a.parameters()), list(b.parameters())
    oa = torch.optim.AdamW(_per_tensor_groups(params_a[:-1], torch.optim.AdamW), lr=1.0,
                           foreach=False)
    ob = mt.AdamW(_per_tensor_groups(params_b[:-1], mt.AdamW), lr=1.0, flat_grads=flat_grads)
    _steps(a, oa, None, "cpu", 0, 2)
    _steps(b, ob, None, "cpu", 0, 2)
    oa.param_groups[0]["params"].append(params_a[-1])
    ob.param_groups[0]["params"].append(params_b[-1])
    _steps(a, oa, None, "cpu", 2, 4)
    _steps(b, ob, None, "cpu", 2, 4)
    _assert_same(a, b)
    # then removed from one group and put in another's place in place: seen at the next step
    for opt in (oa, ob):
        moved = opt.param_groups[0]["params"].pop()
        opt.param_groups[3]["params"] += [moved]
        opt.param_groups[1]["params"][0], opt.param_groups[2]["params"][0] = (
            opt.param_groups[2]["params"][0], opt.param_groups[1]["params"][0])
    _steps(a, oa, None, "cpu", 4, 6)
    _steps(b, ob, None, "cpu", 4, 6)
    _assert_same(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_groups_with_momentum_step_as_one_plan_like_torch(device, nesterov):
    """SGD groups of equal compile options (momentum in all, or in none) step as one plan,
    each tensor with its group's lr, momentum, dampening and decay; a group added mid-run takes
    its first-step momentum with its own options, as torch.optim.SGD."""
    def groups(params):
        return [{"params": [p], "lr": 1e-2 * (1 + k % 5) / 3, "momentum": (0.5, 0.9, 0.8)[k % 3],
                 "dampening": 0.0 if nesterov else (0.0, 0.1, 0.3)[k % 3], "nesterov": nesterov,
                 "weight_decay": 0.0 if p.dim() == 1 else 1e-2 * (1 + k % 3)}
                for k, p in enumerate(params)]

    a, b = _model(device), _model(device)
    params_a, params_b = list(a.parameters()), list(b.parameters())
    oa = torch.optim.SGD(groups(params_a)[:-2], lr=1.0, foreach=False)
    ob = mt.SGD(groups(params_b)[:-2], lr=1.0)
    _scheduled_steps((a, oa), (b, ob), device, 4)
    assert list(ob._bound) == ["merged"] and len(ob._bound["merged"].parts) == 1
    for opt, params in ((oa, params_a), (ob, params_b)):
        for group in groups(params)[-2:]:
            opt.add_param_group(group)
    _steps(a, oa, None, device, 4, 8)
    _steps(b, ob, None, device, 4, 8)
    _assert_same(a, b)
    assert list(ob._bound) == ["merged"]
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(oa.state[p]["momentum_buffer"], ob.state[q]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


RULE_PAIRS = [(torch.optim.Adagrad, mt.Adagrad, {"lr_decay": 1e-3, "eps": 1e-10}),
              (torch.optim.RMSprop, mt.RMSprop, {"alpha": 0.95, "momentum": 0.5})]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_cls,mt_cls,options", RULE_PAIRS,
                         ids=[c.__name__ for c, _, _ in RULE_PAIRS])
def test_rule_optimizer_groups_step_as_one_plan_like_torch(torch_cls, mt_cls, options, device):
    """A rule-run optimizer (Adagrad, RMSprop) with a group per tensor steps as one plan, each
    tensor with its group's lr and decay, under a scheduler; a tensor option steps alone."""
    def groups(params):
        return [{"params": [p], "lr": 1e-2 * (1 + k % 5) / 3,
                 "weight_decay": 0.0 if p.dim() == 1 else 1e-2 * (1 + k % 3)}
                for k, p in enumerate(params)]

    a, b = _model(device), _model(device)
    oa = torch_cls(groups(list(a.parameters())), foreach=False, **options)
    ob = mt_cls(groups(list(b.parameters())), **options)
    sa, sb = _scheduled_steps((a, oa), (b, ob), device, 5)
    assert list(ob._bound) == ["merged"] and len(ob._bound["merged"].parts) == 1
    ob.param_groups[0]["weight_decay"] = torch.tensor(0.0, device=device)
    oa.param_groups[0]["weight_decay"] = 0.0
    _steps(a, oa, sa, device, 5, 6)
    _steps(b, ob, sb, device, 5, 6)
    _assert_same(a, b)
    assert "merged" not in ob._bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", [False, True])
def test_lr_tensors_per_group_step_as_one_plan_and_follow_their_values(device, flat_grads):
    """Each group's lr a float32 tensor on the params' device (as a CUDA graph needs): the
    groups still step as one plan, each tensor's row reading its group's tensor, and values
    written into the tensors in place are taken with no rebinding and, on a GPU, no host
    synchronisation; against torch.optim.AdamW given those lrs as numbers."""
    a, b = _model(device), _model(device)
    oa = torch.optim.AdamW(_per_tensor_groups(list(a.parameters()), torch.optim.AdamW), lr=1.0,
                           foreach=False)
    groups = _per_tensor_groups(list(b.parameters()), mt.AdamW)
    for group in groups:
        group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
    ob = mt.AdamW(groups, lr=1.0, flat_grads=flat_grads)
    for t in range(5):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 12, generator=g).to(device)
        y = torch.randint(0, 3, (8,), generator=g).to(device)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        oa.step()
        checked = device == "cuda" and t >= 2  # bound by then: a step is its launches
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            ob.step()
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode("default")
        for theirs, ours in zip(oa.param_groups, ob.param_groups):
            theirs["lr"] *= 0.7
            ours["lr"].mul_(0.7)
    assert list(ob._bound) == ["merged"] and len(ob._bound["merged"].parts) == 1
    _assert_same(a, b)


@pytest.mark.gpu
def test_a_cuda_graph_of_a_step_over_groups_with_lr_tensors_launches_once():
    """A whole training step over a group per tensor, each group's lr a CUDA tensor, captured
    in a CUDA graph: the optimizer's part of a replay is one launch set (the merged plan and
    its step counter), lrs changed in place between replays are taken; against
    torch.optim.AdamW given the same lrs as numbers."""
    from _torch_graphs import capture

    a, b = _model("cuda"), _model("cuda")
    oa = torch.optim.AdamW(_per_tensor_groups(list(a.parameters()), torch.optim.AdamW), lr=1.0,
                           foreach=False)
    groups = _per_tensor_groups(list(b.parameters()), mt.AdamW)
    for group in groups:
        group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device="cuda")
    ob = mt.AdamW(groups, lr=1.0, flat_grads=True)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(8, 12, generator=g).cuda(), torch.randint(0, 3, (8,), generator=g).cuda()

    def step(model, opt):
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    launches = []
    original = _torch_binding.LatestStep.repeat
    _torch_binding.LatestStep.repeat = lambda self, opt: launches.append(len(self.repeats)) or original(
        self, opt)
    try:
        graph = capture(lambda: step(b, ob))
    finally:
        _torch_binding.LatestStep.repeat = original
    assert launches[-1] == 1 and list(ob._bound) == ["merged"]
    for _ in range(3):  # the warm-up steps (a capture runs nothing)
        step(a, oa)
    for _ in range(3):
        for theirs, ours in zip(oa.param_groups, ob.param_groups):
            theirs["lr"] *= 0.8
            ours["lr"].mul_(0.8)
        graph.replay()
        step(a, oa)
    torch.cuda.synchronize()
    _assert_same(a, b)


def test_numbers_set_beside_an_lr_tensor_leave_the_tensor_read():
    """Some groups' lrs numbers (set by hand between steps), one group's a tensor (changed in
    place): both are taken, as torch.optim.AdamW takes the same values as numbers."""
    a, b = _model("cpu"), _model("cpu")
    oa = torch.optim.AdamW(_per_tensor_groups(list(a.parameters()), torch.optim.AdamW), lr=1.0,
                           foreach=False)
    groups = _per_tensor_groups(list(b.parameters()), mt.AdamW)
    groups[1]["lr"] = torch.tensor(groups[1]["lr"], dtype=torch.float32)
    ob = mt.AdamW(groups, lr=1.0)
    for t in range(4):
        _steps(a, oa, None, "cpu", t, t + 1)
        _steps(b, ob, None, "cpu", t, t + 1)
        for k, (theirs, ours) in enumerate(zip(oa.param_groups, ob.param_groups)):
            theirs["lr"] *= 0.5
            if k == 1:
                ours["lr"].mul_(0.5)
            else:
                ours["lr"] = ours["lr"] * 0.5
    assert list(ob._bound) == ["merged"]
    _assert_same(a, b)


def test_lrs_set_as_numbers_are_read_without_merging_the_groups_again(monkeypatch):
    model = _model("cpu")
    opt = mt.AdamW(_per_tensor_groups(list(model.parameters()), mt.AdamW), lr=1.0)
    _steps(model, opt, None, "cpu", 0, 1)
    merged = []
    original = mt.AdamW._merged_hyper
    monkeypatch.setattr(mt.AdamW, "_merged_hyper",
                        lambda self, *args: merged.append(1) or original(self, *args))
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.5
    _steps(model, opt, None, "cpu", 1, 2)
    assert merged == []
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    _steps(model, opt, None, "cpu", 2, 3)
    assert merged == [1]


def _layerwise_groups(params, cls):
    """A group per tensor for LAMB or LARS, their options varying across groups."""
    groups = []
    for k, p in enumerate(params):
        group = {"params": [p], "lr": 1e-2 * (1 + k % 5) / 3,
                 "weight_decay": 0.0 if p.dim() == 1 else 1e-2 * (1 + k % 3)}
        if cls is mt.LAMB:
            group.update(betas=(0.8 + 0.05 * (k % 3), 0.99), eps=10.0 ** -(5 + k % 3),
                         max_grad_norm=(0.0, 0.5, 1.0)[k % 3], grad_averaging=k % 4 != 1)
        else:
            group.update(momentum=(0.0, 0.5, 0.9)[k % 3], trust_coefficient=0.01 * (1 + k % 2),
                         exclude=p.dim() == 1)
        groups.append(group)
    return groups


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", [False, True])
@pytest.mark.parametrize("cls", [mt.LAMB, mt.LARS], ids=["LAMB", "LARS"])
def test_lamb_and_lars_groups_step_as_one_plan_like_group_by_group(cls, flat_grads, device):
    """Each tensor reads its group's options from its row (LARS: its group's exclude flag, a
    per-tensor flag of the one plan; LAMB: the global norm clips the groups that ask for it);
    the same steps taken group by group agree, through a scheduler and an exclude flag set."""
    unmerged = type("Unmerged", (cls,), {"_merges_groups": False})
    runs = []
    for make in (cls, unmerged):
        model = _model(device)
        opt = make(_layerwise_groups(list(model.parameters()), cls), lr=1.0,
                   flat_grads=flat_grads)
        factors = [lambda t, k=k: 1.0 / (1 + t * (1 + k % 4) / 10)
                   for k in range(len(opt.param_groups))]
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factors)
        _steps(model, opt, scheduler, device, 0, 4)
        if cls is mt.LARS:
            opt.param_groups[0]["exclude"] = True
        else:
            opt.param_groups[1]["max_grad_norm"] = 0.25
        _steps(model, opt, scheduler, device, 4, 7)
        runs.append((model, opt))
    (model, opt), (reference, reference_opt) = runs
    assert list(opt._bound) == ["merged"] and len(opt._bound["merged"].parts) == 1
    assert "merged" not in reference_opt._bound
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                     _model(device).parameters()))


def test_merged_lamb_reads_the_global_norm_of_each_step():
    """The norm LAMB clips by lives in one tensor from step to step, whichever grads it is
    taken over (flat buffers, or grads found outside them and copied back): the merged plan
    reads the current one."""
    results = []
    for flat_grads in (True, False):
        model = _model("cpu")
        params = list(model.parameters())
        opt = mt.LAMB([{"params": params[::2], "weight_decay": 0.01},
                       {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2,
                      max_grad_norm=1.0, flat_grads=flat_grads)
        for t in range(5):
            g = torch.Generator().manual_seed(t)
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
            if t == 1 and flat_grads:
                model.zero_grad()  # the grads go elsewhere this step, and are copied back
            else:
                opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y) * (1 + 10 * t)
            loss.backward()
            opt.step()
        assert list(opt._bound) == ["merged"]
        results.append(model)
    _assert_same(*results)
