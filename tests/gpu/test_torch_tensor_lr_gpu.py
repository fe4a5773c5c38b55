"""A tensor lr wherever torch.optim takes one, with CUDA params: a 0-d CPU tensor (as torch's
own tests give tensor lrs), a float64 tensor on the params' GPU, a tensor on another GPU; each
filled in place between steps as LR schedulers fill it, stepped as its value, and with no host
synchronisation in steady state (torch's sync debug mode raises on any torch op that waits).
"""
import pytest

import mtapply

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")

RULE = mtapply.rule("plain_sgd", slots="param:rw grad:r", hyper=dict(lr=(None, ">= 0")),
                    update="param = param - lr * grad")
OPTIMIZERS = [
    (mt.Adam, {}), (mt.AdamW, dict(amsgrad=True)), (mt.Adam8bit, dict(min_8bit_size=1)),
    (mt.AdamW8bit, {}), (mt.SGD, dict(momentum=0.9)), (mt.LARS, {}), (mt.LAMB, {}),
    (mt.Adagrad, {}), (mt.RMSprop, {}), (mt.Lion, {}), (mt.Adan, {}),
    (mt.ScheduleFreeAdamW, {}), (lambda params, **kw: mt.optimizer(RULE, params, **kw), {}),
    (mt.Adamax, {}), (mt.Adadelta, {}), (mt.RAdam, {}), (mt.NAdam, {}),
    (mt.GaLoreAdamW, {}),
]
IDS = [getattr(make, "__name__", "rule") for make, _ in OPTIMIZERS]
SCHEDULE = [1e-2, 5e-3, 5e-3, 2e-3, 1e-3, 1e-3]


def _params(device="cuda"):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device))
            for s in ((64, 33), (33,), (7,))]


def _run(make, options, lr, layout, check_sync):
    """Steps over the schedule, `lr` a tensor filled in place (or None: number lrs set)."""
    params = _params()
    first = SCHEDULE[0] if lr is None else lr
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": first}]
    flat = {"flat_grads": True} if layout == "flat_grads" else {}
    opt = make(groups, lr=first, **options, **flat)
    if layout == "a plan per group":
        opt._merges_groups = False
    if flat:
        opt.zero_grad()  # the grads' views are made here
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g).to("cuda") for p in params] for _ in SCHEDULE]
    torch.cuda.synchronize()
    for t, step_grads in enumerate(grads):
        if lr is None:
            for group in opt.param_groups:
                group["lr"] = float(torch.tensor(SCHEDULE[t], dtype=torch.float32))
        else:
            lr.fill_(SCHEDULE[t])
        for p, grad in zip(params, step_grads):
            if flat:
                p.grad.copy_(grad)
            else:
                p.grad = grad
        if check_sync and t >= 2:  # steady state: plans bound, slots made
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return params


def _assert_same(params, expected):
    for p, q in zip(params, expected):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["merged", "a plan per group", "flat_grads"])
@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_a_cpu_tensor_lr_with_cuda_params(make, options, layout):
    if layout == "flat_grads" and make is mt.GaLoreAdamW:
        pytest.skip("GaLoreAdamW has no flat_grads")
    lr = torch.tensor(SCHEDULE[0])  # on the CPU
    # GaLore reads its lr on the host for its GEMMs: a CPU tensor costs no sync there either,
    # but its projector refreshes (an SVD) wait for the device: not checked here
    params = _run(make, options, lr, layout, check_sync=make is not mt.GaLoreAdamW)
    _assert_same(params, _run(make, options, None, layout, check_sync=False))


@pytest.mark.parametrize("make,options", OPTIMIZERS[:-1], ids=IDS[:-1])
def test_a_float64_tensor_lr_on_the_params_gpu(make, options):
    lr = torch.tensor(SCHEDULE[0], dtype=torch.float64, device="cuda")
    # ScheduleFreeAdamW reads a tensor lr on the host (its weights are host numbers): a sync
    params = _run(make, options, lr, "merged", check_sync=make is not mt.ScheduleFreeAdamW)
    _assert_same(params, _run(make, options, None, "merged", check_sync=False))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("make,options", OPTIMIZERS[:-1], ids=IDS[:-1])
def test_a_tensor_lr_on_another_gpu(make, options):
    lr = torch.tensor(SCHEDULE[0], device="cuda:1")
    params = _run(make, options, lr, "a plan per group",
                  check_sync=make is not mt.ScheduleFreeAdamW)  # (its host read: see above)
    _assert_same(params, _run(make, options, None, "a plan per group", check_sync=False))


def test_a_negative_cpu_tensor_lr_is_refused_before_anything_is_written():
    params = _params()
    lr = torch.tensor(1e-2)
    opt = mt.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": lr}], lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    lr.fill_(-1.0)  # in place: no group edit to notice, the value is read at each step
    kept = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"lr must be >= 0, got -1\.0"):
        opt.step()
    assert all(torch.equal(p.detach(), k) for p, k in zip(params, kept))
