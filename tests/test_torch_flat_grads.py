"""mtapply.torch with flat_grads=True: grads as views into flat buffers, O(1) host steps."""
import copy
import warnings

import pytest
from _one_rank import one_rank_mesh
from _torch_graphs import capture

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")
from mtapply import _torch_binding, _torch_optimizer  # noqa: E402
flat_grads = pytest.importorskip("mtapply._flat_grads")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OPTIMIZERS = [
    (mt.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (mt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (mt.LARS, None, dict(lr=0.1, weight_decay=1e-3)),
    (mt.LAMB, None, dict(lr=1e-2, max_grad_norm=0.5)),
    (mt.RAdam, torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    (mt.NAdam, torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
]
IDS = [cls.__name__ for cls, _, _ in OPTIMIZERS]
RTOL, ATOL = 1e-5, 1e-6


def _model(device, seed=1):
    """Two dtypes, two groups, and one frozen param (it has no grad and must not move)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                                torch.nn.LayerNorm(4)).to(device)
    model[3].bias.requires_grad_(False)
    return model


def _groups(model, lr):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": weights}, {"params": rest, "lr": lr / 2}]


def _batches(device, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(device))
            for _ in range(steps)]


def _step(model, opt, batch, zero=lambda model, opt: opt.zero_grad(set_to_none=False)):
    zero(model, opt)
    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    opt.step()


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


def _reference(cls, torch_cls, kw, device, batches):
    """The same training with grads zeroed in place, by torch.optim where it has the optimizer."""
    model = _model(device)
    opt = (torch_cls(_groups(model, kw["lr"]), foreach=False, **kw) if torch_cls
           else cls(_groups(model, kw["lr"]), **kw))
    for batch in batches:
        _step(model, opt, batch)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,torch_cls,kw", OPTIMIZERS, ids=IDS)
def test_trains_like_in_place_grads_and_steps_without_per_param_work(cls, torch_cls, kw, device,
                                                                      monkeypatch):
    batches = _batches(device, 12)
    reference = _reference(cls, torch_cls, kw, device, batches)
    model = _model(device)
    frozen = model[3].bias.detach().clone()
    monkeypatch.setattr(flat_grads, "CHECKED_PER_STEP", 2)  # read as the buffers are made
    opt = cls(_groups(model, kw["lr"]), flat_grads=True, **kw)
    for batch in batches[:3]:
        _step(model, opt, batch, zero=lambda model, opt: opt.zero_grad())  # set_to_none aside
    # from here on every step must take the O(1) path: the per-param paths would raise
    def per_param(*args, **kwargs):
        raise AssertionError("a per-param path ran")
    monkeypatch.setattr(_torch_optimizer.FusedOptimizer, "_prepare_group", per_param)
    monkeypatch.setattr(flat_grads.FlatGrads, "restore", per_param)
    for batch in batches[3:]:
        start = opt._flat._next
        _step(model, opt, batch, zero=lambda model, opt: opt.zero_grad())
        assert opt._flat._next == (start + 2) % len(opt._flat.entries)
    _assert_same(reference, model)
    assert torch.equal(model[3].bias, frozen) and model[3].bias.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_grads_are_views_of_one_buffer_per_dtype_and_zero_grad_keeps_them(device):
    model = _model(device).to(torch.float64)
    model[0].to(torch.float32)
    opt = mt.AdamW(model.parameters(), lr=1e-2, flat_grads=True)
    assert opt._flat is None and all(p.grad is None for p in model.parameters())  # as torch's
    opt.zero_grad()  # the views are made at the first zero_grad() or step()
    buffers = opt._flat.buffers
    assert sorted(map(str, (b.dtype for b in buffers))) == ["torch.float32", "torch.float64"]
    grads = {}
    for p in model.parameters():
        if p.requires_grad:
            base = next(b for b in buffers if b.dtype == p.dtype)
            start = p.grad.data_ptr() - base.data_ptr()
            assert 0 <= start and start + p.grad.nbytes <= base.nbytes and start % 256 == 0
            grads[p] = p.grad
    sum((p.double() ** 2).sum() for p in model.parameters()).backward()  # grads 2p, in the views
    assert all(torch.equal(g, 2 * p.detach()) for p, g in grads.items())
    opt.step()
    opt.zero_grad()  # set_to_none=True is the default: under flat_grads the views stay, zeroed
    assert all(p.grad is g and not g.any() for p, g in grads.items())
    assert model[3].bias.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_grads_set_to_none_by_the_model_are_noticed_the_same_step(device):
    """model.zero_grad() at every step (HF's Trainer) is a zeroing, taken without a warning."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    batches = _batches(device, 5)
    model = _model(device)
    opt = mt.AdamW(_groups(model, kw["lr"]), flat_grads=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in batches:  # model.zero_grad() sets every grad to None: backward makes new ones
            _step(model, opt, batch, zero=lambda model, opt: model.zero_grad())
    _assert_same(_reference(mt.AdamW, torch.optim.AdamW, kw, device, batches), model)
    assert all(any(p.grad.data_ptr() == b.data_ptr() or
                   b.data_ptr() < p.grad.data_ptr() < b.data_ptr() + b.nbytes for b in opt._flat.buffers)
               for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("change", ["assigned grad", "grad set to None", "replaced storage",
                                    "edited group"])
def test_a_change_behind_the_optimizer_is_reported_before_any_write(change, monkeypatch):
    monkeypatch.setattr(flat_grads, "CHECKED_PER_STEP", 2)
    model = _model("cpu")
    opt = mt.Adam(_groups(model, 1e-2), lr=1e-2, flat_grads=True)
    batches = _batches("cpu", 12)
    for batch in batches[:2]:
        _step(model, opt, batch)
    p = model[2].weight
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(batches[2][0]), batches[2][1]).backward()
    if change == "assigned grad":
        p.grad = p.grad.clone()
    elif change == "grad set to None":
        p.grad = None
    elif change == "replaced storage":
        p.data = p.data.clone()
    else:  # behind its list's back: the list's own edits are seen
        list.__setitem__(opt.param_groups[0]["params"], 1, torch.nn.Parameter(p.detach().clone()))
    with pytest.raises(RuntimeError, match=r"param \d+ of param group \d+ .*optimizer.zero_grad\(\)"):
        for batch in batches[3:]:  # the rotation reaches every param within 5 steps
            before = [q.detach().clone() for q in model.parameters()]
            states = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state.items()}
            opt.step()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    assert all(torch.equal(q, b) for q, b in zip(model.parameters(), before))
    assert all(torch.equal(opt.state[k][n], t) for k, s in states.items() for n, t in s.items())


def test_new_groups_deep_copies_and_checkpoints_keep_flat_grads():
    kw = dict(lr=1e-2)
    model = _model("cpu")
    groups = _groups(model, kw["lr"])
    opt = mt.Adam(groups[:1], flat_grads=True, **kw)
    opt.add_param_group(groups[1])
    batches = _batches("cpu", 8)
    for batch in batches[:4]:
        _step(model, opt, batch)
    assert all(p.grad is e.view for e in opt._flat.entries for p in [e.param] if e.view is not None)
    assert len(opt._flat.entries) == sum(1 for _ in model.parameters())
    twin_model = copy.deepcopy(model)
    twin = mt.Adam(_groups(twin_model, kw["lr"]), flat_grads=True, **kw)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # as torch.save and torch.load
    copied = copy.deepcopy(opt)
    assert copied._flat_grads
    for batch in batches[4:]:
        _step(model, opt, batch)
        _step(twin_model, twin, batch)
    _assert_same(model, twin_model)
    reference = _reference(mt.Adam, torch.optim.Adam, kw, "cpu", batches)
    _assert_same(reference, model)


def test_dtensor_params_are_refused_with_their_index():
    with one_rank_mesh() as mesh:
        from torch.distributed.tensor import distribute_tensor

        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh))
        with pytest.raises(ValueError, match="DTensor params \\(param 0 of param group 1\\)"):
            mt.SGD([{"params": [torch.nn.Parameter(torch.randn(3))]}, {"params": [sharded]}],
                   lr=0.1, flat_grads=True)


FROZEN_CASES = [
    (mt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (mt.Lion, None, dict(lr=1e-3, weight_decay=0.1)),
    (mt.AdamW8bit, None, dict(lr=1e-2, weight_decay=0.1)),
]
FROZEN_IDS = [cls.__name__ for cls, _, _ in FROZEN_CASES]
# (steps, the steps at which the last param is frozen, whether the flat buffers are made first)
SCHEDULES = {"frozen from the start": (7, range(0, 4), False),
             "frozen once the buffers exist": (7, range(0, 4), True),
             "frozen after 3 steps": (9, range(3, 6), False)}


def frozen_params(device, seed=3):
    """Two trainable params and the one to freeze, of 64 x 64: AdamW8bit keeps 8-bit moments
    from 4096 elements on."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device))
            for shape in [(64, 64), (64,), (64, 64)]]


def frozen_loss(params, k):
    """A loss of random non-zero grads, new ones at each step k (a frozen param takes none)."""
    g = torch.Generator().manual_seed(100 + k)
    total = 0.0
    for p in params:
        scale, shift = (torch.randn(p.shape, generator=g).to(p.device) for _ in range(2))
        total = total + (scale * p).square().mean() + (shift * p).sum()
    return total


def snapshot(opt, p) -> tuple:
    """p and its optimizer state (None where it has none), copied."""
    state = opt.state.get(p)
    return p.detach().clone(), None if state is None else {k: v.clone() for k, v in state.items()}


def assert_bit_identical(opt, p, taken: tuple, when: str):
    value, state = taken
    assert torch.equal(p, value), f"the frozen param moved {when}"
    now = opt.state.get(p)
    assert (now is None) == (state is None), f"the frozen param's state was made {when}"
    for name, tensor in (state or {}).items():
        assert torch.equal(now[name], tensor), f"its state {name!r} moved {when}"


def train_with_a_frozen_param(opt, params, steps, frozen, check=lambda k: None):
    """Steps `opt` over `params`; the last is frozen (requires_grad False) at the steps in
    `frozen`. `check(k)` runs after step k."""
    for k in range(steps):
        params[-1].requires_grad_(k not in frozen)
        opt.zero_grad()
        frozen_loss(params, k).backward()
        opt.step()
        check(k)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("cls,torch_cls,kw", FROZEN_CASES, ids=FROZEN_IDS)
def test_a_frozen_param_does_not_step_and_steps_again_once_unfrozen(cls, torch_cls, kw, schedule):
    check_frozen_schedule(cls, torch_cls, kw, schedule, "cpu")


def check_frozen_schedule(cls, torch_cls, kw, schedule, device):
    """With flat_grads, the frozen param and its state stay bit-identical while it is frozen,
    and the training is that of flat_grads=False and torch.optim, where it has no grad."""
    steps, frozen, buffers_first = SCHEDULES[schedule]
    params = frozen_params(device)
    start = [p.detach().clone() for p in params]
    opt = cls(params, flat_grads=True, **kw)
    if buffers_first:
        opt.zero_grad()  # every param takes its view
    taken = {"frozen": snapshot(opt, params[-1])}

    def check(k):
        if k + 1 == frozen.start:  # as the param is frozen for the next step
            taken["frozen"] = snapshot(opt, params[-1])
        elif k in frozen:
            assert_bit_identical(opt, params[-1], taken["frozen"], f"at step {k}")

    train_with_a_frozen_param(opt, params, steps, frozen, check)
    if cls is mt.AdamW8bit:
        assert opt.state[params[-1]]["exp_avg"].dtype == torch.uint8  # in 8 bits
    assert not torch.equal(params[-1], taken["frozen"][0])  # unfrozen: it steps again
    assert not any(map(torch.equal, params, start))
    makers = [lambda ps: cls(ps, **kw)]  # a grad of None for the frozen param
    if torch_cls is not None:
        makers.append(lambda ps: torch_cls(ps, foreach=False, **kw))
    for make in makers:
        twin_params = frozen_params(device)
        train_with_a_frozen_param(make(twin_params), twin_params, steps, frozen)
        for p, q in zip(params, twin_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_freezing_binds_once_and_the_steps_after_take_the_o1_path(monkeypatch):
    """A param frozen, and a group all frozen: one step binds again, the next ones launch
    the bound plans with no per-param work, and the frozen params stay as they were."""
    params, lone = frozen_params("cpu"), torch.nn.Parameter(torch.randn(32))
    everything = params + [lone]
    groups = [{"params": params}, {"params": [lone], "amsgrad": True}]  # not merged: two plans
    opt = mt.AdamW(groups, lr=1e-2, weight_decay=0.1, flat_grads=True)

    def step(k):
        opt.zero_grad()
        frozen_loss(everything, k).backward()
        opt.step()

    for k in range(3):
        step(k)
    params[-1].requires_grad_(False)
    lone.requires_grad_(False)
    taken = [snapshot(opt, p) for p in everything]

    def per_param(*args, **kwargs):
        raise AssertionError("a per-param path ran")

    for k in range(3, 8):
        step(k)
        for p, kept in zip(everything[2:], taken[2:]):
            assert_bit_identical(opt, p, kept, f"at step {k}")
        monkeypatch.setattr(_torch_optimizer.FusedOptimizer, "_prepare_group", per_param)
        monkeypatch.setattr(flat_grads.FlatGrads, "restore", per_param)
    assert not any(torch.equal(p, kept[0]) for p, kept in zip(everything[:2], taken))


@pytest.mark.parametrize("zeroing", ["optimizer.zero_grad()", "grads set to None"])
def test_a_frozen_param_may_drop_its_grad(zeroing, monkeypatch):
    """Frozen with its grad set to None (and every grad set to None at each step, as
    model.zero_grad() does): no error, it keeps no grad, and it steps again once unfrozen, as
    torch.optim.AdamW steps it."""
    monkeypatch.setattr(flat_grads, "CHECKED_PER_STEP", 2)  # the rotation reaches every param
    kw = dict(lr=1e-2, weight_decay=0.1)
    params, twin_params = frozen_params("cpu"), frozen_params("cpu")
    opt = mt.AdamW(params, flat_grads=True, **kw)
    twin = torch.optim.AdamW(twin_params, foreach=False, **kw)
    frozen = range(3, 6)
    for k in range(9):
        for ps, o in ((params, opt), (twin_params, twin)):
            ps[-1].requires_grad_(k not in frozen)
            if k == frozen.start:
                ps[-1].grad = None
            if zeroing == "optimizer.zero_grad()":
                o.zero_grad()
            else:
                for p in ps:
                    p.grad = None
            frozen_loss(ps, k).backward()
            o.step()
        if k + 1 == frozen.start:  # as the param is frozen for the next step
            taken = snapshot(opt, params[-1])
        elif k in frozen:
            assert_bit_identical(opt, params[-1], taken, f"at step {k}")
        assert (params[-1].grad is None) == (k in frozen)
    assert not torch.equal(params[-1], taken[0])
    for p, q in zip(params, twin_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_grad_scaler_and_a_cuda_graph_of_the_whole_step_with_flat_grads():
    kw = dict(lr=1e-2, weight_decay=0.1)
    batches = _batches("cuda", 6)
    model = _model("cuda")
    lr = torch.tensor(kw["lr"], device="cuda")
    opt = mt.AdamW(model.parameters(), lr=lr, weight_decay=0.1, flat_grads=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    x, y = batches[0]

    def train_step():
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    train_step()
    opt.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # skipped: nothing moves
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert float(opt.state[model[0].weight]["step"]) == 1.0

    graphed = mt.AdamW(model.parameters(), lr=lr, weight_decay=0.1, flat_grads=True)
    reference = copy.deepcopy(model)
    plain = torch.optim.AdamW(reference.parameters(), lr=kw["lr"], weight_decay=0.1, foreach=False)

    def plain_step(m, o):
        o.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()

    graph = capture(lambda: plain_step(model, graphed))
    for _ in range(3):
        plain_step(reference, plain)
    for _ in range(4):
        graph.replay()
        plain_step(reference, plain)
    torch.cuda.synchronize()
    _assert_same(reference, model)


@pytest.mark.gpu
def test_steps_that_repeat_the_latest_follow_torch_under_a_scheduler(monkeypatch):
    """Between the scheduler's lr changes (every third step; it sets the same lr in between) a
    step repeats the latest one's launches, and the run follows torch.optim.AdamW."""
    repeated = []
    repeat = _torch_binding.LatestStep.repeat
    monkeypatch.setattr(_torch_binding.LatestStep, "repeat",
                        lambda self, opt: repeated.append(repeat(self, opt)) or repeated[-1])
    batches = _batches("cuda", 12)
    models = [_model("cuda") for _ in range(2)]
    kw = dict(lr=1e-2, weight_decay=0.1)
    opts = [mt.AdamW(_groups(models[0], kw["lr"]), flat_grads=True, **kw),
            torch.optim.AdamW(_groups(models[1], kw["lr"]), foreach=False, **kw)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5 ** (k // 3)) for o in opts]
    for k, batch in enumerate(batches):
        for model, opt, scheduler in zip(models, opts, schedulers):
            _step(model, opt, batch, zero=lambda model, opt: opt.zero_grad())
            scheduler.step()
    _assert_same(models[1], models[0])
    assert repeated.count(True) >= 6  # two of every three steps, after the first ones
