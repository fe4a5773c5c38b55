"""mtapply.torch.Adafactor against torch.optim.Adafactor on the CPU: params and every state
tensor after each step (float64 to 1e-10 over 50 steps, float32 to its tolerance), with param
groups, maximize and weight decay, shapes of 0 to 4 dimensions, checkpoints both ways and bad
arguments refused before anything changes."""
from __future__ import annotations

import copy
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not hasattr(torch.optim, "Adafactor"):
    pytest.skip("torch.optim.Adafactor needs torch 2.5+", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402

SHAPES = [(4, 6), (7,), (2, 3, 5), (1, 9), (), (3, 1)]


def _pair(shapes, dtype, groups=None, **options):
    """torch.optim's and mtapply's Adafactor over equal params (one group per entry of
    `groups`, each a dict of its options and the indices of its params)."""
    made = [torch.randn(s, dtype=dtype) for s in shapes]
    ref = [torch.nn.Parameter(p.clone()) for p in made]
    ours = [torch.nn.Parameter(p.clone()) for p in made]
    if groups:
        ref_groups = [dict(g, params=[ref[i] for i in g["params"]]) for g in groups]
        our_groups = [dict(g, params=[ours[i] for i in g["params"]]) for g in groups]
        return (ref, torch.optim.Adafactor(ref_groups, foreach=False, **options),
                ours, mt.Adafactor(our_groups, **options))
    return (ref, torch.optim.Adafactor(ref, foreach=False, **options),
            ours, mt.Adafactor(ours, **options))


def _grads(ref, ours):
    for p, q in zip(ref, ours):
        g = torch.randn(p.shape, dtype=p.dtype)
        p.grad, q.grad = g.clone(), g.clone()


def _assert_same(ref, ref_opt, ours, our_opt, rtol, atol):
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=rtol, atol=atol)
        expected, got = ref_opt.state[p], our_opt.state[q]
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name].reshape(value.shape), value, rtol=rtol,
                                       atol=atol, check_dtype=name != "step")


@pytest.mark.parametrize("options", [
    dict(),
    dict(lr=0.05, weight_decay=0.1),
    dict(lr=0.2, maximize=True, d=1.5, beta2_decay=-0.5),
    dict(eps=(1e-20, 1e-2), weight_decay=0.01),
    dict(d=math.inf),  # no clipping
    dict(lr=math.inf, d=2.0),  # the relative step 1 / sqrt(t)
])
def test_float64_matches_torch_to_1e_10_over_50_steps(options):
    ref, ref_opt, ours, our_opt = _pair(SHAPES, torch.float64, **options)
    for _ in range(50):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
        _assert_same(ref, ref_opt, ours, our_opt, 1e-10, 1e-10)


def test_float32_matches_torch_to_its_tolerance():
    ref, ref_opt, ours, our_opt = _pair(SHAPES, torch.float32, lr=0.05, weight_decay=0.1)
    for _ in range(50):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
    _assert_same(ref, ref_opt, ours, our_opt, 1e-5, 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_grad_makes_torchs_nans(bad):
    """torch's clamps of the estimate keep a NaN: the elements that it makes NaN are NaN here
    too (not hidden by a max as eps1), and the others take its values."""
    ref, ref_opt, ours, our_opt = _pair([(3, 4), (5,), (2, 3, 4)], torch.float64)
    _grads(ref, ours)
    for p, q in zip(ref, ours):
        p.grad.view(-1)[1] = q.grad.view(-1)[1] = bad
    ref_opt.step()
    our_opt.step()
    for p, q in zip(ref, ours):
        assert p.isnan().any()
        assert torch.equal(q.isnan(), p.isnan())
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-10, atol=1e-12, equal_nan=True)


def test_param_groups_take_their_own_options():
    groups = [dict(params=[0, 1], lr=0.05, weight_decay=0.1),
              dict(params=[2, 3], lr=0.003, maximize=True, d=2.0),
              dict(params=[4, 5], eps=(1e-25, 1e-4), beta2_decay=-0.6)]
    ref, ref_opt, ours, our_opt = _pair(SHAPES, torch.float64, groups)
    for _ in range(20):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
        _assert_same(ref, ref_opt, ours, our_opt, 1e-10, 1e-10)


_SHAPE = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


@given(shapes=st.lists(_SHAPE, min_size=1, max_size=4), maximize=st.booleans(),
       weight_decay=st.sampled_from([0.0, 0.1]))
def test_any_shapes_match_torch(shapes, maximize, weight_decay):
    ref, ref_opt, ours, our_opt = _pair(shapes, torch.float64, lr=0.05, maximize=maximize,
                                        weight_decay=weight_decay)
    for _ in range(3):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
        _assert_same(ref, ref_opt, ours, our_opt, 1e-10, 1e-10)


@pytest.mark.parametrize("saved_by", ["torch", "mtapply"])
def test_checkpoints_move_both_ways(saved_by):
    ref, ref_opt, ours, our_opt = _pair(SHAPES, torch.float64, lr=0.05, weight_decay=0.1)
    for _ in range(10):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
    # the other optimizer continues from the one's checkpoint: both stay equal
    if saved_by == "torch":
        our_opt = mt.Adafactor(ours, lr=0.05, weight_decay=0.1)
        our_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (as saved to disk)
    else:
        ref_opt = torch.optim.Adafactor(ref, lr=0.05, weight_decay=0.1, foreach=False)
        ref_opt.load_state_dict(copy.deepcopy(our_opt.state_dict()))
    for _ in range(10):
        _grads(ref, ours)
        ref_opt.step()
        our_opt.step()
        _assert_same(ref, ref_opt, ours, our_opt, 1e-10, 1e-10)
    saved = our_opt.state_dict()["state"]
    assert sorted(saved[0]) == ["col_var", "row_var", "step"]
    assert sorted(saved[1]) == ["step", "variance"]
    assert saved[0]["row_var"].shape == (4, 1) and saved[0]["col_var"].shape == (1, 6)
    assert saved[0]["step"].device.type == "cpu" and float(saved[0]["step"]) == 20


def test_defaults_are_torchs():
    p = torch.nn.Parameter(torch.randn(3, 4))
    ours, theirs = mt.Adafactor([p]), torch.optim.Adafactor([p])
    assert ours.defaults == theirs.defaults
    assert type(ours).__module__ == "mtapply.torch" and "Adafactor" in mt.__all__


@pytest.mark.parametrize("options,match", [
    (dict(lr=-1.0), r"Learning rate should be >= 0"),
    (dict(lr=float("nan")), r"Learning rate should be >= 0"),
    (dict(lr=torch.tensor([0.1, 0.2])), r"Tensor lr must be 1-element"),
    (dict(beta2_decay=0.5), r"beta2_decay should be <= 0"),
    (dict(eps=(-1.0, 1e-3)), r"epsilon1 should be >= 0 .*eps\[0\]"),
    (dict(eps=(None, -1e-3)), r"epsilon2 should be >= 0 .*eps\[1\]"),
    (dict(eps=1e-3), r"eps must be a pair"),
    (dict(d=0.5), r"Clipping threshold d should be >= 1"),
    (dict(weight_decay=-0.1), r"weight_decay should be >= 0"),
])
def test_bad_arguments_are_refused_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        mt.Adafactor([torch.nn.Parameter(torch.randn(2, 3))], **options)


def test_a_bad_group_option_is_refused_before_any_param_changes():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = mt.Adafactor([{"params": [params[0]]}, {"params": [params[1]]}])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.param_groups[1]["d"] = 0.5
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param group 1: d"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    opt.param_groups[1]["d"] = 1.0
    opt.step()  # the optimizer keeps working
    assert not torch.equal(params[0], before[0])


WRONG_SHAPES = [  # (param shape, state name, a wrong shape): of other sizes, and of the same
    ("2,5", "row_var", (5, 1)), ("2,5", "row_var", (1, 2)), ("2,5", "row_var", (2,)),
    ("2,5", "col_var", (5, 1)), ("2,5", "col_var", (5,)), ("3,2,5", "col_var", (1, 3, 5)),
    ("6", "variance", (6, 1)), ("6", "variance", (3, 2)),
]


def _stepped(shape):
    params = [torch.nn.Parameter(torch.randn(3, 4)),
              torch.nn.Parameter(torch.randn([int(n) for n in shape.split(",")]))]
    opt = mt.Adafactor(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


@pytest.mark.parametrize("shape, name, wrong", WRONG_SHAPES)
def test_a_loaded_state_of_the_wrong_shape_is_refused_naming_it(shape, name, wrong):
    params, opt = _stepped(shape)
    saved = opt.state_dict()
    kept = opt.state[params[1]][name].clone()
    saved["state"][1][name] = torch.zeros(wrong)
    with pytest.raises(ValueError, match=rf"state of param 1 holds '{name}' of shape "
                                         rf"{re.escape(str(wrong))}, but a param of shape"):
        opt.load_state_dict(saved)
    assert torch.equal(opt.state[params[1]][name], kept)  # the state as it was


@pytest.mark.parametrize("shape, name, wrong", WRONG_SHAPES)
def test_a_state_set_to_the_wrong_shape_is_refused_before_any_param_changes(shape, name, wrong):
    params, opt = _stepped(shape)
    opt.state[params[1]][name] = torch.zeros(wrong)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"holds '{name}' of shape {re.escape(str(wrong))}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_torch_state_without_its_factors_is_refused_naming_them():
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = mt.Adafactor([p])
    saved = opt.state_dict()
    saved["state"] = {0: {"step": torch.tensor(1.0), "variance": torch.zeros(3, 4)}}
    with pytest.raises(KeyError, match=r"no 'row_var'"):
        opt.load_state_dict(saved)


def test_flat_grads_match_torch():
    made = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    ref = [torch.nn.Parameter(p.clone()) for p in made]
    ours = [torch.nn.Parameter(p.clone()) for p in made]
    ref_opt = torch.optim.Adafactor(ref, lr=0.05)
    our_opt = mt.Adafactor(ours, lr=0.05, flat_grads=True)
    for _ in range(5):
        our_opt.zero_grad()
        for p, q in zip(ref, ours):
            g = torch.randn(p.shape, dtype=p.dtype)
            p.grad = g.clone()
            q.grad.copy_(g) if q.grad is not None else setattr(q, "grad", g.clone())
        ref_opt.step()
        our_opt.step()
    _assert_same(ref, ref_opt, ours, our_opt, 1e-10, 1e-10)


def test_complex_params_are_refused_at_the_step_before_anything_is_written():
    real = torch.nn.Parameter(torch.randn(3, 4))
    complex_param = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64))
    opt = mt.Adafactor([{"params": [real]}, {"params": [complex_param]}])
    real.grad, complex_param.grad = torch.randn(3, 4), torch.randn(2, 2, dtype=torch.complex64)
    before = real.detach().clone(), complex_param.detach().clone()
    with pytest.raises(RuntimeError, match=r"Adafactor does not support complex parameters: "
                                           r"param 0 of param group 1"):
        opt.step()
    assert torch.equal(real.detach(), before[0]) and torch.equal(complex_param.detach(), before[1])
