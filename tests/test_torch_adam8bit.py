"""mtapply.torch.Adam8bit and AdamW8bit on the CPU: the same steps as the functional 8-bit
path, param groups and a scheduler, a state_dict round trip, flat grads, and their checks."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
import mtapply.torch as mt  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Tanh(), torch.nn.Linear(100, 10))


def _batch(k):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(k))


def _train(model, opt, steps, scheduler=None, start=0):
    for k in range(start, start + steps):
        opt.zero_grad()
        model(_batch(k)).square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("cls,options,decoupled", [
    (mt.AdamW8bit, dict(lr=1e-2), True),
    (mt.Adam8bit, dict(lr=1e-2, weight_decay=0.1, maximize=True), False),
    (mt.Adam8bit, dict(lr=5e-3, betas=(0.8, 0.99), decoupled_weight_decay=True, weight_decay=0.05),
     True),
])
def test_steps_equal_the_functional_path(cls, options, decoupled):
    model, twin = _model(), _model()
    opt = cls(model.parameters(), **options)
    params = [p.detach() for p in twin.parameters()]
    state = mtapply.adam8bit_state(params)
    beta1, beta2 = options.get("betas", (0.9, 0.999))
    weight_decay = options.get("weight_decay", 1e-2 if cls is mt.AdamW8bit else 0.0)
    for t in range(1, 6):
        for m in (model, twin):
            m.zero_grad()
            m(_batch(t)).square().mean().backward()
        opt.step()
        mtapply.adam8bit_step(params, [p.grad for p in twin.parameters()], *state.lists(),
                              lr=options["lr"], step=t, beta1=beta1, beta2=beta2,
                              weight_decay=weight_decay, decoupled_weight_decay=decoupled,
                              maximize=options.get("maximize", False))
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    first = opt.state[model[0].weight]
    assert first["exp_avg"].dtype == torch.uint8 and first["exp_avg_absmax"].shape == (25,)
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.float32  # 1,000 elements
    assert float(first["step"]) == 5


def test_groups_scheduler_and_min_8bit_size():
    model, twin = _model(), _model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 1e-2},  # noqa: E731
                        {"params": m[2].parameters(), "weight_decay": 0.0}]
    opt = mt.AdamW8bit(groups(model), lr=3e-3, min_8bit_size=1000)
    ref = mt.AdamW8bit(groups(twin), lr=3e-3, min_8bit_size=1000)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    _train(model, opt, 5, scheduler)
    _train(twin, ref, 5, ref_scheduler)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.uint8  # 1,000 >= min_8bit_size
    assert opt.state[model[2].bias]["exp_avg"].dtype == torch.float32
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="min_8bit_size"):
        mt.AdamW8bit(model.parameters(), min_8bit_size=0)


def test_state_dict_round_trip_continues_the_same_run():
    model = _model()
    opt = mt.AdamW8bit(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8
    _train(model, opt, 3, start=3)
    resumed = _model(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_opt = mt.AdamW8bit(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(saved)
    _train(resumed, resumed_opt, 3, start=3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        assert torch.equal(opt.state[model[0].weight][key], resumed_opt.state[resumed[0].weight][key])


def test_flat_grads_step_like_plain_grads():
    model, twin = _model(), _model()
    opt = mt.AdamW8bit(model.parameters(), lr=1e-2, flat_grads=True)
    ref = mt.AdamW8bit(twin.parameters(), lr=1e-2)
    _train(model, opt, 4)
    _train(twin, ref, 4)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_bf16_model_with_stochastic_rounding_steps_like_the_functional_call():
    model, twin = _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    opt = mt.AdamW8bit(model.parameters(), lr=1e-2, stochastic_rounding=True, seed=5)
    params = [p.detach() for p in twin.parameters()]
    state = mtapply.adam8bit_state(params)
    for t in range(1, 4):
        x = _batch(t).to(torch.bfloat16)
        for m in (model, twin):
            m.zero_grad()
            m(x).float().square().mean().backward()
        opt.step()
        mtapply.adam8bit_step(params, [p.grad for p in twin.parameters()], *state.lists(),
                              lr=1e-2, step=t, weight_decay=1e-2, decoupled_weight_decay=True,
                              seed=5, stochastic_rounding=True)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8


def test_float64_params_are_refused_with_8bit_moments():
    p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.float64))
    opt = mt.AdamW8bit([p])
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="8-bit moments take params of float32, bfloat16, float16"):
        opt.step()
    assert torch.equal(p, torch.zeros_like(p))


def test_eight_bit_state_is_a_quarter_of_fp32():
    model = torch.nn.Linear(1024, 512)
    opt = mt.AdamW8bit(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    state = opt.state[model.weight]
    nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")
    assert nbytes / model.weight.numel() <= 2.1
    assert np.isfinite(model.weight.detach().numpy()).all()


def test_grad_scaler_steps_like_unscaled_grads_and_skips_infs():
    model, twin = _model(), _model()
    opt = mt.AdamW8bit(model.parameters(), lr=1e-2)
    ref = mt.AdamW8bit(twin.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for k in range(4):
        opt.zero_grad()
        scaler.scale(model(_batch(k)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        ref.zero_grad()
        twin(_batch(k)).square().mean().backward()
        ref.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)  # a power-of-two scale divides out exactly
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(model(_batch(9)).square().mean() * float("inf")).backward()
    scaler.step(opt)  # found an inf: the step is skipped
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
