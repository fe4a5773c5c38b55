"""D-Adaptation Adam (`mtapply.rules.library.dadapt_adam`, `mtapply.torch.DAdaptAdam`): scalar
state fed by whole-list sums, against the float64 reference (mtapply.reference.dadapt_adam)
and, where it is installed, dadaptation itself."""
import numpy as np
import pytest

from mtapply import reference
from mtapply.rules import library
from _quadratic import problem as _problem
from _quadratic import torch_problem as _torch_problem
from _quadratic import assert_equals_peer, torch_run

VARIANTS = [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, decouple=True),
            dict(use_bias_correction=True), dict(growth_rate=1.02)]



@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(o) or "defaults")
def test_the_dadapt_adam_rule_follows_the_reference(options):
    params, targets = _problem(0)
    rule = library.dadapt_adam(options.get("decouple", False),
                               options.get("use_bias_correction", False))
    ours = [p.copy() for p in params]
    lists = [[np.zeros_like(p) for p in ours] for _ in range(3)]
    scalars = rule.initial_scalars(np.float64)
    hyper = dict(lr=1.0, weight_decay=options.get("weight_decay", 0.0),
                 growth_rate=options.get("growth_rate", 0.0))
    want, state = [p.copy() for p in params], {}
    reference_options = {"growth_rate": float("inf"), **options}
    for t in range(1, 31):
        rule.step(ours, [p - y for p, y in zip(ours, targets)], *lists, step=t,
                  scalars_out=scalars, **hyper)
        want = reference.dadapt_adam(want, [p - y for p, y in zip(want, targets)], state, step=t,
                                     **reference_options)
    assert state["d"] > 1.5e-6  # d grew
    np.testing.assert_allclose(scalars[4], state["d"], rtol=1e-12)
    for got, expected in zip(ours, want):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)




def test_mtapply_torch_dadapt_adam_follows_the_reference_and_resumes():
    torch = pytest.importorskip("torch")
    import copy

    import mtapply.torch as mt

    params, targets = _torch_problem(torch)
    opt = mt.DAdaptAdam(params, weight_decay=0.01, decouple=True)
    want, state = [p.detach().numpy().copy() for p in params], {}
    torch_run(opt, params, targets, 10)
    for t in range(1, 11):
        want = reference.dadapt_adam(want, [p - y.numpy() for p, y in zip(want, targets)], state,
                                     step=t, weight_decay=0.01, decouple=True)
    for got, expected in zip(params, want):
        np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-4, atol=2e-5)
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq", "s", "d",
                                          "numerator_weighted"}
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = mt.DAdaptAdam(twins, weight_decay=0.01, decouple=True)
    resumed.load_state_dict(saved)
    torch_run(opt, params, targets, 5)
    torch_run(resumed, twins, targets, 5)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one param group"):
        mt.DAdaptAdam([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match="log_every=10"):
        mt.DAdaptAdam(params, log_every=10)
    with pytest.raises(ValueError, match="Invalid growth_rate"):
        mt.DAdaptAdam(params, growth_rate=0.5)


# (float64: d and the sums are float64 there, so the params follow dadaptation's to 1e-12)
@pytest.mark.parametrize("dtype,rel", [("float64", 1e-12), ("float32", 1e-5)])
def test_mtapply_torch_dadapt_adam_equals_dadaptation(dtype, rel):
    torch = pytest.importorskip("torch")
    dadaptation = pytest.importorskip("dadaptation")
    import mtapply.torch as mt

    assert_equals_peer(torch, mt.DAdaptAdam, dadaptation.DAdaptAdam, VARIANTS, dtype, rel)


def test_params_that_miss_steps_follow_dadaptation():
    """A param without grads for a few steps steps on with its group's count afterwards."""
    torch = pytest.importorskip("torch")
    dadaptation = pytest.importorskip("dadaptation")
    import mtapply.torch as mt

    missed = frozenset({(1, 0), (2, 0), (40, 0), (3, 3), (99, 1)})
    assert_equals_peer(torch, mt.DAdaptAdam, dadaptation.DAdaptAdam, VARIANTS, "float64", 1e-12,
                       missed)


def test_the_dadapt_adam_kernel_compiles():
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    spec = library.dadapt_adam(decouple=True).spec()
    for dtypes in (("float32",) * 5, ("bfloat16", "bfloat16") + ("float32",) * 3):
        assert _source.compile_offline(spec.source(dtypes), "sm_90")[:4] == b"\x7fELF"
