"""Rules with factored slots (Adafactor) on a GPU: refused before anything is written, naming
the rule and the slot, through the rule's step and plan and through mtapply.torch.Adafactor;
the same lists step on the CPU."""
import numpy as np
import pytest

import mtapply
from mtapply.rules import library

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402

SHAPES = [(4, 6), (7,), (2, 3, 5)]


def _lists(rule, device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    grads = [torch.randn(s, device=device) for s in SHAPES]
    shapes = [rule.state_shapes(s) for s in SHAPES]
    states = [[torch.zeros(s[name], device=device) for s in shapes]
              for name in ("row_var", "col_var", "variance")]
    return params, grads, states


def test_a_rule_step_and_plan_are_refused_before_anything_is_written():
    rule = library.adafactor()
    params, grads, states = _lists(rule, "cuda")
    before = [p.clone() for p in params]
    for call in (lambda: rule.step(params, grads, *states, eps1=1e-30, step=1),
                 lambda: rule.plan(params, grads, *states)):
        with pytest.raises(NotImplementedError,
                           match=r"rule 'adafactor'.*slot 'row_var' is factored.*CPU"):
            call()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(not s.any() for column in states for s in column)


def test_the_torch_optimizer_is_refused_on_the_gpu_and_steps_on_the_cpu():
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    opt = mt.Adafactor(params)
    with pytest.raises(NotImplementedError, match=r"'adafactor'.*'row_var'.*CPU"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    cpu = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    for p, q in zip(cpu, params):
        p.grad = q.grad.cpu()
    mt.Adafactor(cpu).step()
    assert all(not np.array_equal(p.detach().numpy(), b.cpu().numpy())
               for p, b in zip(cpu, before))
