"""mtapply.torch: drop-in torch.optim optimizers, against torch.optim itself (CPU and GPU)."""
import copy

import numpy as np
import pytest
from _torch_graphs import capture

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PAIRS = [
    (torch.optim.Adam, mt.Adam, dict(lr=1e-2)),
    (torch.optim.Adam, mt.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (torch.optim.AdamW, mt.AdamW, dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, mt.SGD, dict(lr=0.1)),
]
IDS = [f"{m.__name__}-{i}" for i, (_, m, _) in enumerate(PAIRS)]
# torch's single-tensor loop and mtapply round a few operations differently (fp32)
RTOL, ATOL = 1e-5, 1e-6


def _model(device, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                               torch.nn.LayerNorm(4)).to(device)


def _groups(model, kw):
    """Two param groups with different hyperparameters: weights, and the rest at half lr."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": weights}, {"params": rest, "lr": kw["lr"] / 2}]


def _train(model, opt, device, steps, seed=0, skip_param=None, set_to_none=True):
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        x = torch.randn(16, 8, generator=g).to(device)
        y = torch.randint(0, 4, (16,), generator=g).to(device)
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if skip_param is not None and t % 3 == 1:
            skip_param(model).grad = None  # no grad this step: the param is not updated
        opt.step()


def _assert_same(a, b, what=""):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=f"{what} {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_cls,mt_cls,kw", PAIRS, ids=IDS)
def test_trains_like_torch_optim(torch_cls, mt_cls, kw, device):
    a, b = _model(device), _model(device)
    oa = torch_cls(_groups(a, kw), foreach=False, **kw)
    ob = mt_cls(_groups(b, kw), **kw)
    assert ob.defaults == oa.defaults or set(ob.defaults) >= set(oa.defaults) - {"foreach"}
    skip = lambda m: m[2].bias  # noqa: E731
    _train(a, oa, device, 12, skip_param=skip)
    _train(b, ob, device, 12, skip_param=skip)
    _assert_same(a, b)
    for p, q in zip(a.parameters(), b.parameters()):
        for key, value in oa.state[p].items():
            torch.testing.assert_close(ob.state[q][key].float().cpu(), value.float().cpu(),
                                       rtol=RTOL, atol=ATOL, msg=key)
        assert set(oa.state[p]) == set(ob.state[q])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_cls,mt_cls,kw", PAIRS[1:4], ids=IDS[1:4])
def test_state_dict_moves_both_ways_and_training_continues_identically(torch_cls, mt_cls, kw, device):
    a, b = _model(device), _model(device)
    oa, ob = torch_cls(_groups(a, kw), foreach=False, **kw), mt_cls(_groups(b, kw), **kw)
    _train(a, oa, device, 10)
    _train(b, ob, device, 10)
    # torch checkpoint -> mtapply, and mtapply checkpoint -> torch, through torch.save semantics
    a2, b2 = copy.deepcopy(a), copy.deepcopy(b)
    ob2 = mt_cls(_groups(a2, kw), **kw)
    ob2.load_state_dict(copy.deepcopy(oa.state_dict()))
    oa2 = torch_cls(_groups(b2, kw), foreach=False, **kw)
    oa2.load_state_dict(copy.deepcopy(ob.state_dict()))
    for model, opt in ((a, oa), (b, ob), (a2, ob2), (b2, oa2)):
        _train(model, opt, device, 5, seed=1)
    _assert_same(a, a2, "torch -> mtapply")
    _assert_same(b, b2, "mtapply -> torch")
    _assert_same(a, b, "both")


@pytest.mark.parametrize("device", DEVICES)
def test_lr_scheduler_and_grads_kept_in_place(device):
    a, b = _model(device), _model(device)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = mt.AdamW(b.parameters(), lr=1e-2)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    for _ in range(6):
        _train(a, oa, device, 1, set_to_none=False)
        _train(b, ob, device, 1, set_to_none=False)
        sa.step()
        sb.step()
    grads = [p.grad.data_ptr() for p in b.parameters()]
    _train(b, ob, device, 1, set_to_none=False)
    assert [p.grad.data_ptr() for p in b.parameters()] == grads  # zeroed in place, not replaced
    _train(a, oa, device, 1, set_to_none=False)
    _assert_same(a, b)
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"] == 1e-2 / 8


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_skips_a_step_with_inf_grads(device):
    model = _model(device)
    opt = mt.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    g = torch.Generator().manual_seed(0)
    for t in range(4):
        x = torch.randn(16, 8, generator=g).to(device)
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if t == 2:
            model[0].weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            states = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if t == 2:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            assert all(torch.equal(opt.state[p]["exp_avg"], s) for p, s in zip(model.parameters(), states))
            assert float(opt.state[model[0].weight]["step"]) == 2.0
    assert float(opt.state[model[0].weight]["step"]) == 3.0  # 3 steps taken, 1 skipped
    assert scaler.get_scale() == 2.0**9  # the inf halved the scale once


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_training_step_matches_eager(device):
    a, b = _model(device), _model(device)
    oa, ob = mt.AdamW(a.parameters(), lr=1e-2), mt.AdamW(b.parameters(), lr=1e-2)

    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(train_step, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(device)
        train_step(a, oa, x, y)
        compiled(b, ob, x, y)
    _assert_same(a, b)
    assert float(ob.state[b[0].weight]["step"]) == 4.0


def test_lars_and_lamb_optimizers_match_the_functional_api():
    import mtapply

    torch.manual_seed(0)
    params = [torch.randn(s) for s in ((5, 3), (7,), (300,))]
    grads = [torch.randn_like(p) for p in params]
    for cls, kw in ((mt.LARS, dict(lr=0.1, weight_decay=1e-3, trust_coefficient=0.01)),
                    (mt.LAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0))):
        mine = [p.clone().requires_grad_() for p in params]
        opt = cls(mine, **kw)
        ref = [p.clone() for p in params]
        states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        for t in range(1, 4):
            for p, g in zip(mine, grads):
                p.grad = g * t
            opt.step()
            step_grads = [g * t for g in grads]
            if cls is mt.LARS:
                mtapply.lars_step(ref, step_grads, states[0], momentum=0.9, **kw)
            else:
                total = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in step_grads)))
                mtapply.lamb_step(ref, step_grads, states[0], states[1], step=t,
                                  global_grad_norm=total, **kw)
        for p, q in zip(mine, ref):
            torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6, msg=cls.__name__)


def test_bad_arguments_raise_like_torch_optim():
    params = _model("cpu").parameters()
    with pytest.raises(ValueError, match="Invalid learning rate"):
        mt.Adam(params, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        mt.AdamW(_model("cpu").parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Nesterov"):
        mt.SGD(_model("cpu").parameters(), lr=0.1, nesterov=True)


@pytest.mark.gpu
def test_a_whole_training_step_replays_in_a_cuda_graph():
    a, b = _model("cuda"), _model("cuda")
    lr = torch.tensor(1e-2, device="cuda")
    oa = mt.AdamW(a.parameters(), lr=1e-2)
    ob = mt.AdamW(b.parameters(), lr=lr, capturable=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 4, (16,), device="cuda")

    def train_step(model, opt):
        opt.zero_grad(set_to_none=False)  # grads zeroed in place: their addresses stay fixed
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    graph = capture(lambda: train_step(b, ob))
    for _ in range(3):
        train_step(a, oa)
    for k in range(4):
        lr.fill_(1e-2 / (k + 1))  # a scheduler's update keeps the tensor's address
        oa.param_groups[0]["lr"] = 1e-2 / (k + 1)
        graph.replay()
        train_step(a, oa)
    torch.cuda.synchronize()
    _assert_same(a, b)
    assert float(ob.state[b[0].weight]["step"]) == 7.0


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_sharing_memory_with_a_written_tensor_is_refused(device):
    model = _model(device)
    opt = mt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, device, 2)
    weight = model[0].weight
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    weight.grad = opt.state[weight]["momentum_buffer"].view_as(weight)  # aliases a written state
    with pytest.raises(ValueError, match="share memory"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    weight.grad = torch.randn_like(weight)
    opt.step()  # the optimizer keeps working after the error
    assert not torch.equal(weight, before[0])


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_param_storage_is_followed(device):
    # `p.data = ...` (model.half(), EMA swaps, vector_to_parameters) frees the old storage
    a, b = _model(device), _model(device)
    oa, ob = torch.optim.Adam(a.parameters(), lr=1e-2, foreach=False), mt.Adam(b.parameters(), lr=1e-2)
    _train(a, oa, device, 2)
    _train(b, ob, device, 2)
    for model in (a, b):
        for p in model.parameters():
            p.data = p.data.clone() * 0.5
    _train(a, oa, device, 3, seed=2)
    _train(b, ob, device, 3, seed=2)
    _assert_same(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_the_optimizer_keeps_no_grad_alive(device):
    import gc
    import weakref

    model = _model(device)
    opt = mt.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        _train(model, opt, device, 1)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad()  # set_to_none: torch drops the grads, and so must mtapply
        gc.collect()
        assert all(ref() is None for ref in grads)


def test_a_first_step_overflow_is_skipped_without_error():
    model = _model("cpu")
    opt = mt.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    model[0].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert float(opt.state[model[0].weight]["step"]) == 0.0


def test_a_deep_copied_optimizer_keeps_working():
    model = _model("cpu")
    for opt in (mt.AdamW(model.parameters(), lr=1e-2), mt.LAMB(model.parameters(), lr=1e-2)):
        _train(model, opt, "cpu", 2)
        twin_model = copy.deepcopy(model)
        twin = type(opt)(twin_model.parameters(), lr=1e-2)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        clone = copy.deepcopy(opt)  # copies of the params, states and groups
        copies = [p for g in clone.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in copies]
        for p in copies:
            p.grad = torch.randn_like(p)
        clone.step()
        assert not any(torch.equal(p, q) for p, q in zip(copies, before) if p.numel() > 1)
        _train(model, opt, "cpu", 2, seed=3)
        _train(twin_model, twin, "cpu", 2, seed=3)
        _assert_same(model, twin_model)


def test_lamb_clips_by_the_global_norm_of_moving_grads():
    import mtapply

    torch.manual_seed(0)
    params = [torch.randn(s) for s in ((5, 3), (7,), (300,))]
    mine = [p.clone().requires_grad_() for p in params]
    opt = mt.LAMB(mine, lr=1e-2, max_grad_norm=0.5)
    ref, m, v = [p.clone() for p in params], [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for t in range(1, 5):
        grads = [torch.randn_like(p) * t for p in params]  # fresh tensors every step
        for p, g in zip(mine, grads):
            p.grad = g.clone()
        opt.step()
        total = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
        mtapply.lamb_step(ref, grads, m, v, lr=1e-2, step=t, max_grad_norm=0.5, global_grad_norm=total)
    for p, q in zip(mine, ref):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)


def test_lars_refuses_bad_arguments():
    with pytest.raises(ValueError, match="Invalid momentum"):
        mt.LARS(_model("cpu").parameters(), momentum=-0.1)
