"""A tensor lr wherever torch.optim takes one, on the CPU (the GPU cases: a CPU lr with CUDA
params, an lr on another GPU, in tests/gpu/test_torch_tensor_lr_gpu.py): a one-element tensor
of any floating dtype steps as its value does, followed when a scheduler fills it in place; a
tensor of several elements is refused by every optimizer with torch's message, when made and
when set in a group (then before anything is written)."""
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
import mtapply.torch as mt  # noqa: E402

RULE = mtapply.rule("plain_sgd", slots="param:rw grad:r", hyper=dict(lr=(None, ">= 0")),
                    update="param = param - lr * grad")
OPTIMIZERS = [
    (mt.Adam, {}), (mt.AdamW, {}), (mt.Adam8bit, dict(min_8bit_size=1)), (mt.AdamW8bit, {}),
    (mt.SGD, dict(momentum=0.9)), (mt.LARS, {}), (mt.LAMB, {}), (mt.Adagrad, {}),
    (mt.RMSprop, {}), (mt.Lion, {}), (mt.Adan, {}), (mt.ScheduleFreeAdamW, {}),
    (mt.Adamax, {}), (mt.Adadelta, {}), (mt.RAdam, dict(decoupled_weight_decay=True)),
    (mt.NAdam, {}),
    (lambda params, **kw: mt.optimizer(RULE, params, **kw), {}), (mt.GaLoreAdamW, {}),
]
IDS = [f"{getattr(make, '__name__', 'rule')}" for make, _ in OPTIMIZERS]


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 4), (4,), (3,))]


def _steps(opt, params, lr_of_step, steps=5):
    for t in range(steps):
        lr_of_step(opt, t)
        g = torch.Generator().manual_seed(10 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_a_tensor_of_several_elements_is_refused_as_torch_refuses_it(make, options):
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
        make(None, lr=torch.tensor([1e-3, 1e-3]), **options)  # before the params are read
    params = _params()
    opt = make([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, **options)
    _steps(opt, params, lambda opt, t: None, steps=1)
    opt.param_groups[1]["lr"] = torch.tensor([1e-3, 1e-3])
    kept = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="param group 1: Tensor lr must be 1-element"):
        opt.step()
    assert all(torch.equal(p.detach(), k) for p, k in zip(params, kept))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_a_tensor_lr_filled_in_place_steps_as_its_value(make, options, dtype):
    """As LR schedulers step a tensor lr: fill_ between steps, the tensor kept."""
    schedule = [1e-2, 5e-3, 5e-3, 2e-3, 1e-3]
    params, twins = _params(), _params()
    lr = torch.tensor(schedule[0], dtype=dtype)
    opt = make([{"params": params[:2]}, {"params": params[2:], "lr": lr}], lr=lr, **options)
    ref = make([{"params": twins[:2]}, {"params": twins[2:], "lr": schedule[0]}],
               lr=schedule[0], **options)

    def fill(opt, t):
        lr.fill_(schedule[t])

    def set_numbers(opt, t):
        for group in opt.param_groups:
            group["lr"] = float(torch.tensor(schedule[t], dtype=dtype))

    _steps(opt, params, fill)
    _steps(ref, twins, set_numbers)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["lr"] is lr  # the user's tensor stays the group's lr


@pytest.mark.parametrize("make,options", OPTIMIZERS[:-1], ids=IDS[:-1])
def test_a_tensor_lr_filled_with_a_bad_value_is_refused_before_any_group_steps(make, options):
    """Filled in place there is no group edit to notice: the value is checked at each step."""
    params = _params()
    lr = torch.tensor(1e-2)
    opt = make([{"params": params[:2]}, {"params": params[2:], "lr": lr}], lr=1e-2, **options)
    opt._merges_groups = False  # group 0 would step first
    _steps(opt, params, lambda opt, t: None, steps=1)
    lr.fill_(-1.0)
    kept = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"lr must be >= 0, got -1\.0"):
        opt.step()
    assert all(torch.equal(p.detach(), k) for p, k in zip(params, kept))
