"""SGD specifics that the common registry tests do not sweep: momentum 0 without buffers,
dampening, torch's first-step semantics, and the option combinations SGD refuses."""
import itertools

import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")

SHAPES = [(0,), (5,), (3, 7), (1200,), (1,), (0,)]
CASES = [dict(momentum=m, dampening=d, weight_decay=wd, nesterov=n, maximize=mx)
         for m, d, wd, n, mx in itertools.product((0.0, 0.9), (0.0, 0.25), (0.0, 0.05), (False, True),
                                                  (False, True))
         if not (n and (m == 0 or d != 0))]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_matches_torch_sgd_over_ten_steps(opts):
    params = [torch.randn(s) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.SGD(theirs, lr=0.05, foreach=False, **opts)
    # garbage buffers: torch's first step replaces them with the gradient
    buffers = [torch.randn_like(p) for p in params] if opts["momentum"] else None
    for step in range(1, 11):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        optimizer.step()
        mtapply.sgd_step(params, grads, buffers, lr=0.05, step=step, **opts)
        for i, p in enumerate(theirs):
            torch.testing.assert_close(params[i], p.detach(), rtol=1.3e-6, atol=1e-5)
            if buffers is not None and p.numel():
                torch.testing.assert_close(buffers[i], optimizer.state[p]["momentum_buffer"],
                                           rtol=1.3e-6, atol=1e-5)


def test_momentum_zero_needs_no_buffers_nor_step():
    params = [np.random.default_rng(1).standard_normal(50).astype(np.float32)]
    grads = [np.random.default_rng(2).standard_normal(50).astype(np.float32)]
    expected = params[0] - np.float32(0.1) * grads[0]
    mtapply.sgd_step(params, grads, lr=0.1)
    np.testing.assert_allclose(params[0], expected, rtol=1e-6)


def test_buffers_are_left_alone_when_momentum_is_zero():
    params, grads = [np.ones(8, np.float32)], [np.full(8, 0.5, np.float32)]
    buffers = [np.full(8, 3.0, np.float32)]
    mtapply.sgd_step(params, grads, buffers, lr=0.1, step=4, momentum=0.0)
    np.testing.assert_array_equal(buffers[0], 3.0)
    np.testing.assert_allclose(params[0], 0.95)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(momentum=0.9, step=1), ValueError, "momentum_buffers"),  # no buffers
    (dict(momentum=0.9, buffers=True), TypeError, "step is required"),
    (dict(momentum=0.9, step=1, buffers=True, nesterov=True, dampening=0.1), ValueError, "nesterov"),
    (dict(momentum=0.0, step=1, buffers=True, nesterov=True), ValueError, "nesterov"),
    (dict(nesterov=True), ValueError, "nesterov"),  # no buffers at all
])
def test_refused_combinations_change_nothing(kwargs, error, match):
    params, grads = [np.ones(8, np.float32)], [np.full(8, 0.5, np.float32)]
    buffers = [np.full(8, 3.0, np.float32)] if kwargs.pop("buffers", False) else None
    with pytest.raises(error, match=match):
        mtapply.sgd_step(params, grads, buffers, lr=0.1, **kwargs)
    np.testing.assert_array_equal(params[0], 1.0)
    if buffers:
        np.testing.assert_array_equal(buffers[0], 3.0)


def test_plan_reuses_buffers_across_steps_like_torch():
    params = [torch.randn(100)]
    theirs = [torch.nn.Parameter(params[0].clone())]
    optimizer = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, dampening=0.1, foreach=False)
    grads, buffers = [torch.zeros(100)], [torch.zeros(100)]
    plan = mtapply.sgd_plan(params, grads, buffers)
    for step in range(1, 6):
        grads[0].copy_(torch.randn(100))
        theirs[0].grad = grads[0].clone()
        optimizer.step()
        plan.step(lr=0.1, step=step, momentum=0.9, dampening=0.1)
    torch.testing.assert_close(params[0], theirs[0].detach(), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("buffers,nesterov,maximize", [(False, False, False), (False, False, True),
                                                       (True, False, False), (True, True, True)])
def test_sgd_is_the_library_rule(buffers, nesterov, maximize):
    """sgd_step runs the declaration mtapply.rules.library.sgd: the rule's own step gives the
    same bits."""
    from mtapply.rules import library

    rng = np.random.default_rng(3)
    params = [rng.standard_normal(s).astype(np.float32) for s in ((40,), (3, 5))]
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    moms = [rng.standard_normal(p.shape).astype(np.float32) for p in params] if buffers else None
    ours_p = [p.copy() for p in params]
    ours_b = [b.copy() for b in moms] if buffers else None
    hyper = dict(lr=0.05, weight_decay=0.01)
    if buffers:
        hyper.update(momentum=0.9, dampening=0.0 if nesterov else 0.2)
    for step in (1, 2, 3):
        mtapply.sgd_step(ours_p, grads, ours_b, step=step, nesterov=nesterov, maximize=maximize,
                         **hyper)
        library.sgd(buffers, nesterov, maximize).step(params, grads, *([moms] if buffers else []),
                                                      step=step, **hyper)
    for a, b in zip(ours_p + (ours_b or []), params + (moms or [])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_zero_weight_decay_leaves_an_infinite_param_as_torch(momentum):
    """weight_decay=0 adds nothing (torch skips it): an infinite param stays infinite, not NaN."""
    params = [torch.tensor([float("inf"), 1.0, -float("inf")])]
    theirs = [torch.nn.Parameter(params[0].clone())]
    grads = [torch.tensor([0.5, -0.5, 0.25])]
    theirs[0].grad = grads[0].clone()
    torch.optim.SGD(theirs, lr=0.1, momentum=momentum, foreach=False).step()
    buffers = [torch.zeros(3)] if momentum else None
    mtapply.sgd_step(params, grads, buffers, lr=0.1, step=1, momentum=momentum)
    torch.testing.assert_close(params[0], theirs[0].detach())
