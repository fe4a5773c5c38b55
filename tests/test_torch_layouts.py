"""mtapply.torch steps every param layout torch.optim steps, on the CPU.

- channels_last (dense, not row-major) params are stepped in place, their states made in their
  layout: bit-identical to a row-major twin holding the same memory order (permuted);
- params that are not dense (a strided view) step through a dense stand-in copied back into
  them: bit-identical to a contiguous twin;
- complex params step as torch.optim steps them, as their real views: bit-identical to a twin
  that is the real view (LARS's and LAMB's norms are then those of the complex values);
- a grad laid out unlike its param (assigned by hand) is read in the param's layout;
each with flat_grads on and off, and against torch.optim where it has the optimizer.
"""
import pytest

torch = pytest.importorskip("torch")

import mtapply  # noqa: E402
import mtapply.torch as mt  # noqa: E402

RULE = mtapply.rule("sgdm", slots="param:rw grad:r buf:rw", hyper=dict(lr=(None, ">= 0")),
                    update="""
                        buf = 0.9 * buf + grad
                        param = param - lr * buf
                    """)
OPTIMIZERS = [
    (mt.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (mt.AdamW, dict(lr=1e-2)),
    (mt.Adam8bit, dict(lr=1e-2, min_8bit_size=1)),
    (mt.AdamW8bit, dict(lr=1e-2, min_8bit_size=1)),
    (mt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (mt.SGD, dict(lr=0.1)),
    (mt.LARS, dict(lr=0.1, weight_decay=1e-3)),
    (mt.LAMB, dict(lr=1e-2, max_grad_norm=1.0)),
    (mt.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
    (mt.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    (mt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    (mt.Adan, dict(lr=1e-2)),
    (mt.ScheduleFreeAdamW, dict(lr=1e-2, warmup_steps=2)),
    (mt.Adamax, dict(lr=1e-2)),
    (mt.Adadelta, dict(lr=0.5, weight_decay=0.01)),
    (mt.RAdam, dict(lr=1e-2)),
    (mt.NAdam, dict(lr=1e-2, weight_decay=0.01)),
    (lambda params, **kw: mt.optimizer(RULE, params, **kw), dict(lr=1e-2)),
    (mt.GaLoreAdamW, dict(lr=1e-2, weight_decay=0.01)),
]
IDS = [f"{getattr(make, '__name__', 'rule')}-{k}" for k, (make, _) in enumerate(OPTIMIZERS)]
FLAT = [False, True]
STEPS = 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _flat_supported(make, flat_grads):
    if flat_grads and make is mt.GaLoreAdamW:
        pytest.skip("GaLoreAdamW has no flat_grads")
    return {"flat_grads": True} if flat_grads else {}


def _train(make, options, params, grads, flat_grads):
    """STEPS steps, each param's grads given per step (`grads[t][k]`)."""
    opt = make(params, **options, **_flat_supported(make, flat_grads))
    for step_grads in grads:
        opt.zero_grad()
        for p, g in zip(params, step_grads):
            if flat_grads:
                p.grad.copy_(g)  # the optimizer's own view
            else:
                p.grad = g.clone(memory_format=torch.preserve_format)
        opt.step()
    return opt


def _randn(generator, *shape, device="cpu", **kwargs):
    """Draws on the CPU (the same values for every device), moved to `device`."""
    return torch.randn(*shape, generator=generator, **kwargs).to(device)


def _assert_twins(opt, twin_opt, params, twins, as_twin):
    """Params and every tensor state equal bit for bit, seen as the twin (`as_twin`)."""
    for p, q in zip(params, twins):
        assert torch.equal(as_twin(p.detach()), q.detach())
        assert opt.state[p].keys() == twin_opt.state[q].keys()
        for name, value in opt.state[p].items():
            other = twin_opt.state[q][name]
            if not torch.is_tensor(value):
                assert value == other, name
            elif value.shape == p.shape:
                assert torch.equal(as_twin(value), other), name
            else:  # a per-block scale, a step count, codes of a complex param's real view
                assert torch.equal(value, other), name


def _same_for_others(convert):
    """`convert` for tensors of the layout under test, the identity for the others."""
    def as_twin(t):
        return convert(t) if t.dim() == 4 or t.is_complex() or not t.is_contiguous() else t
    return as_twin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", FLAT)
@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_channels_last_params_step_in_place(make, options, flat_grads, device):
    g = torch.Generator().manual_seed(0)
    conv = _randn(g, 4, 3, 5, 6, device=device).to(memory_format=torch.channels_last)
    params = [torch.nn.Parameter(conv), torch.nn.Parameter(_randn(g, 7, device=device))]
    twins = [torch.nn.Parameter(params[0].detach().permute(0, 2, 3, 1).clone()),
             torch.nn.Parameter(params[1].detach().clone())]
    grads = [[_randn(g, 4, 3, 5, 6, device=device).to(memory_format=torch.channels_last),
              _randn(g, 7, device=device)] for _ in range(STEPS)]
    address, strides = params[0].data_ptr(), params[0].stride()
    opt = _train(make, options, params, grads, flat_grads)
    twin_opt = _train(make, options, twins,
                      [[a.permute(0, 2, 3, 1).contiguous(), b] for a, b in grads], flat_grads)
    assert params[0].data_ptr() == address and params[0].stride() == strides
    for name, value in opt.state[params[0]].items():
        if torch.is_tensor(value) and value.shape == params[0].shape:
            assert value.stride() == strides, name  # made in the param's layout
    _assert_twins(opt, twin_opt, params, twins, _same_for_others(lambda t: t.permute(0, 2, 3, 1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", FLAT)
@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_params_that_are_not_dense_step_through_a_copy(make, options, flat_grads, device):
    g = torch.Generator().manual_seed(1)
    storage = _randn(g, 6, 5, 2, device=device)
    params = [torch.nn.Parameter(storage[..., 0]),
              torch.nn.Parameter(_randn(g, 9, device=device)[::3])]
    assert not params[0].is_contiguous() and params[0].stride() == (10, 2)
    twins = [torch.nn.Parameter(p.detach().contiguous()) for p in params]
    grads = [[_randn(g, p.shape, device=device) for p in params] for _ in range(STEPS)]
    opt = _train(make, options, params, grads, flat_grads)
    twin_opt = _train(make, options, twins, grads, flat_grads)
    assert params[0].data_ptr() == storage.data_ptr()  # stepped where it is
    assert torch.equal(storage[..., 0], twins[0].detach())
    _assert_twins(opt, twin_opt, params, twins, lambda t: t.contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", FLAT)
@pytest.mark.parametrize("make,options", OPTIMIZERS, ids=IDS)
def test_complex_params_step_as_their_real_views(make, options, flat_grads, device):
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(_randn(g, 5, 4, dtype=torch.complex64, device=device)),
              torch.nn.Parameter(_randn(g, 3, dtype=torch.complex64, device=device)),
              torch.nn.Parameter(_randn(g, 4, device=device))]  # a real one among them
    twins = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone() if p.is_complex()
                                else p.detach().clone()) for p in params]
    grads = [[_randn(g, p.shape, dtype=p.dtype, device=device) for p in params]
             for _ in range(STEPS)]
    opt = _train(make, options, params, grads, flat_grads)
    twin_opt = _train(make, options, twins,
                      [[torch.view_as_real(x) if x.is_complex() else x for x in step]
                       for step in grads], flat_grads)
    _assert_twins(opt, twin_opt, params, twins,
                  lambda t: torch.view_as_real(t) if t.is_complex() else t)


@pytest.mark.parametrize("flat_grads", FLAT)
@pytest.mark.parametrize("kind", ["channels_last", "strided", "complex"])
@pytest.mark.parametrize("ours,theirs,options", [
    (mt.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (mt.AdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    (mt.Adagrad, torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
    (mt.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5)),
    (mt.Adamax, torch.optim.Adamax, dict(lr=1e-2, weight_decay=0.01)),
    (mt.Adadelta, torch.optim.Adadelta, dict(lr=0.5)),
    (mt.RAdam, torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    (mt.NAdam, torch.optim.NAdam, dict(lr=1e-2, momentum_decay=0.01)),
], ids=["Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "Adadelta", "RAdam", "NAdam"])
@pytest.mark.parametrize("device", DEVICES)
def test_layouts_step_as_torch_optim_steps_them(ours, theirs, options, kind, flat_grads, device):
    def made():
        g = torch.Generator().manual_seed(3)
        if kind == "channels_last":
            return [torch.nn.Parameter(_randn(g, 2, 3, 4, 5, device=device).to(
                memory_format=torch.channels_last))]
        if kind == "strided":
            return [torch.nn.Parameter(_randn(g, 6, 8, device=device)[:, 1::2])]
        return [torch.nn.Parameter(_randn(g, 6, 4, dtype=torch.complex64, device=device))]

    params, expected = made(), made()
    g = torch.Generator().manual_seed(4)
    grads = [[_randn(g, params[0].shape, dtype=params[0].dtype, device=device)]
             for _ in range(STEPS)]
    opt = _train(ours, options, params, grads, flat_grads)
    ref = _train(lambda p, **kw: theirs(p, foreach=False, **kw), options, expected, grads, False)
    torch.testing.assert_close(params[0].detach(), expected[0].detach())
    for name, value in ref.state[expected[0]].items():
        if torch.is_tensor(value) and value.shape == params[0].shape:
            torch.testing.assert_close(opt.state[params[0]][name], value, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,options", OPTIMIZERS[:-1], ids=IDS[:-1])
def test_a_grad_laid_out_unlike_its_param_is_read_in_the_param_layout(make, options, device):
    g = torch.Generator().manual_seed(5)
    conv = _randn(g, 2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    params, twins = [torch.nn.Parameter(conv)], [torch.nn.Parameter(conv.clone())]
    grads = [_randn(g, 2, 3, 4, 5, device=device) for _ in range(STEPS)]
    opt, twin_opt = make(params, **options), make(twins, **options)
    for t, grad in enumerate(grads):
        params[0].grad = grad.clone()  # row-major, unlike its param
        twins[0].grad = grad.to(memory_format=torch.channels_last)
        if t == 2:  # and back: the param's own layout again
            params[0].grad = twins[0].grad.clone()
        opt.step()
        twin_opt.step()
    assert torch.equal(params[0].detach(), twins[0].detach())


def test_adam8bit_keeps_codes_of_a_complex_param_as_its_real_view():
    p = torch.nn.Parameter(torch.randn(16, 20, dtype=torch.complex64))
    opt = mt.Adam8bit([p], lr=1e-2, min_8bit_size=1)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8
    assert opt.state[p]["exp_avg"].shape == (16, 20, 2)


def test_lamb_and_lars_take_the_norm_of_complex_values():
    """A complex param's trust ratio is that of |z|: the same as its real view's."""
    z = torch.randn(8, 3, dtype=torch.complex64)
    for make in (mt.LARS, mt.LAMB):
        p = torch.nn.Parameter(z.clone())
        q = torch.nn.Parameter(torch.view_as_real(z).clone())
        opt, ref = make([p], lr=0.1, weight_decay=0.01), make([q], lr=0.1, weight_decay=0.01)
        grad = torch.randn_like(z)
        p.grad, q.grad = grad, torch.view_as_real(grad).clone()
        opt.step()
        ref.step()
        assert torch.equal(torch.view_as_real(p.detach()), q.detach())
        assert torch.linalg.vector_norm(torch.view_as_real(z)) == torch.linalg.vector_norm(z)


def test_galore_projects_matrices_of_any_real_layout_and_refuses_complex_ones():
    g = torch.Generator().manual_seed(6)
    strided = torch.nn.Parameter(torch.randn(12, 16, generator=g)[:, ::2])
    twin = torch.nn.Parameter(strided.detach().contiguous())
    opt = mt.GaLoreAdamW([{"params": [strided], "rank": 3}], lr=1e-2)
    ref = mt.GaLoreAdamW([{"params": [twin], "rank": 3}], lr=1e-2)
    for _ in range(STEPS):
        grad = torch.randn(12, 8, generator=g)
        strided.grad, twin.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(strided.detach(), twin.detach())
    matrix = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="param group 0: param 0 is a complex matrix"):
        mt.GaLoreAdamW([{"params": [matrix], "rank": 2}], lr=1e-2)
