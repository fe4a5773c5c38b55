"""mtapply.torch's compiled check that a group is as its plans were bound (`Bound.holds`, one scan
in csrc/torch_describe.cpp instead of torch's accessors per param) and its compiled version
bump: every change the Python path notices is noticed, and steps equal the Python path's."""
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from mtapply import _native  # noqa: E402
from mtapply._torch_binding import Bound  # noqa: E402

if _native.library("torch_describe") is None:  # built here if it can be
    pytest.skip("mtapply's compiled torch library cannot be built here", allow_module_level=True)


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(5000,), (10,), (7, 9)]]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        if p.grad is None or p.grad.shape != g.shape:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)  # in place: the grads stay where they were bound


CHANGES = {
    "nothing": lambda params: None,
    "a new grad": lambda params: setattr(params[0], "grad", params[0].grad.clone()),
    "a grad set to None": lambda params: setattr(params[1], "grad", None),
    "new storage": lambda params: setattr(params[2], "data", params[2].data.clone()),
    "a strided grad": lambda params: setattr(params[2], "grad",
                                             params[2].grad.t().contiguous().t()),
    "a bfloat16 param": lambda params: setattr(params[1], "data", params[1].data.bfloat16()),
}


def _scenario(name, make):
    params = _params()
    opt = make(params)
    checks = []
    for t in range(5):  # (SGD with momentum binds at its second step: the first makes buffers)
        _set_grads(params, _grads(params, t))
        if t == 3:
            CHANGES[name](params)
        bound = opt._bound.get(0)
        checks.append(bound is not None and bound.holds(opt.param_groups[0]["params"]))
        try:
            opt.step()
        except (TypeError, ValueError) as error:  # refused, as the Python path refuses it
            return params, checks, type(error)
    return [p.detach().clone() for p in params], checks, None


@pytest.mark.parametrize("make", [lambda ps: mt.Lion(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: mt.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: mt.Adam(ps, lr=1e-2)], ids=["Lion", "SGD", "Adam"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_the_compiled_check_steps_as_the_python_path(change, make, monkeypatch):
    got, checks, refused = _scenario(change, make)
    assert checks[2], "an unchanged group is found as bound"
    if change != "nothing":
        assert not checks[3], f"{change} is noticed"
    monkeypatch.setattr(Bound, "holds", lambda self, params: False)  # the Python path alone
    want, _, refused_too = _scenario(change, make)
    assert refused == refused_too
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_compiled_bump_moves_every_param_version_once_per_step():
    params = _params()
    opt = mt.Lion(params, lr=1e-2)
    _set_grads(params, _grads(params, 0))
    opt.step()
    before = [p._version for p in params]
    opt.step()
    assert [p._version for p in params] == [v + 1 for v in before]
    loss = (params[0] * 2).sum()  # saves nothing of params[0]: a step may follow
    opt.step()
    loss.backward()
    saved = (params[0] * params[0]).sum()  # saves params[0]
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_a_grad_whose_storage_is_replaced_is_followed(name):
    """`p.grad.data = other`: the same grad object at another address (both paths)."""
    ours = [torch.nn.Parameter(torch.ones(4))]
    theirs = [torch.nn.Parameter(torch.ones(4))]
    opt = getattr(mt, name)(ours, lr=0.5)
    ref = getattr(torch.optim, name)(theirs, lr=0.5)
    for step in range(3):
        for params, o in ((ours, opt), (theirs, ref)):
            if step == 0:
                params[0].grad = torch.ones(4)
            else:
                params[0].grad.data = torch.full((4,), -1.0 * step)
            o.step()
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-7)
