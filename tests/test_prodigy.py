"""Prodigy (`mtapply.rules.library.prodigy`, `mtapply.torch.Prodigy`): a rule whose step size d is
scalar state fed by whole-list sums, against the float64 reference (mtapply.reference.prodigy)
and, where it is installed, prodigyopt itself."""
import math

import numpy as np
import pytest

from mtapply import reference
from mtapply.rules import library
from _quadratic import problem as _problem
from _quadratic import torch_problem as _torch_problem
from _quadratic import assert_equals_peer, torch_run

VARIANTS = [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, decouple=False),
            dict(use_bias_correction=True), dict(safeguard_warmup=True),
            dict(growth_rate=1.02, d_coef=0.5)]



def _hyper(options):
    return dict(lr=1.0, beta3=math.sqrt(0.999), weight_decay=options.get("weight_decay", 0.0),
                d_coef=options.get("d_coef", 1.0), growth_rate=options.get("growth_rate", 0.0))


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(o) or "defaults")
@pytest.mark.parametrize("dtype", [np.float64])
def test_the_prodigy_rule_follows_the_reference(options, dtype):
    params, targets = _problem(0)
    rule = library.prodigy(options.get("decouple", True), options.get("use_bias_correction", False),
                           options.get("safeguard_warmup", False))
    ours = [p.astype(dtype) for p in params]
    lists = [[np.zeros_like(p) for p in ours] for _ in range(3)] + [[p.copy() for p in ours]]
    scalars = rule.initial_scalars(np.float64)
    want, state = [p.copy() for p in params], {}
    reference_options = dict(options)
    if "growth_rate" not in reference_options:
        reference_options["growth_rate"] = float("inf")
    for t in range(1, 31):
        rule.step(ours, [p - y.astype(dtype) for p, y in zip(ours, targets)], *lists, step=t,
                  scalars_out=scalars, **_hyper(options))
        want = reference.prodigy(want, [p - y for p, y in zip(want, targets)], state, step=t,
                                 **reference_options)
    assert state["d"] > 2 * 1e-6  # d grew
    # float64 params: d is float64 scalar state from float64 sums, the reference's precision.
    # (float32 params: the numerator's <g, p0 - p> cancels in float32 while p is near p0, as
    # in any float32 Prodigy; prodigyopt's float32 run agrees with ours, in the last test.)
    np.testing.assert_allclose(scalars[6], state["d"], rtol=1e-12)
    for got, expected in zip(ours, want):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


def test_a_zero_denominator_leaves_params_and_d_alone():
    rule = library.prodigy()
    params = [np.ones(5), np.full(3, 2.0)]
    lists = [[np.zeros_like(p) for p in params] for _ in range(3)] + [[p.copy() for p in params]]
    scalars = rule.initial_scalars(np.float64)
    rule.step(params, [np.zeros(5), np.zeros(3)], *lists, step=1, scalars_out=scalars,
              **_hyper({}))
    np.testing.assert_array_equal(params[0], 1.0)
    assert scalars[6] == 1e-6 and scalars[8] == 0.0




@pytest.mark.parametrize("options", VARIANTS[:4], ids=lambda o: ",".join(o) or "defaults")
def test_mtapply_torch_prodigy_follows_the_reference(options):
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    params, targets = _torch_problem(torch)
    opt = mt.Prodigy(params, **options)
    want, state = [p.detach().numpy().copy() for p in params], {}
    torch_run(opt, params, targets, 20)
    for t in range(1, 21):
        want = reference.prodigy(want, [p - y.numpy() for p, y in zip(want, targets)], state,
                                 step=t, **options)
    for got, expected in zip(params, want):
        np.testing.assert_allclose(got.detach().numpy(), expected, rtol=2e-4, atol=2e-5)
    entry = opt.state[params[0]]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "s", "p0", "d", "d_max", "d_numerator"}
    assert float(entry["d"]) == pytest.approx(state["d"], rel=2e-5)


def test_prodigy_checkpoints_resume_and_refusals():
    torch = pytest.importorskip("torch")
    import copy

    import mtapply.torch as mt

    params, targets = _torch_problem(torch, 1)
    opt = mt.Prodigy(params, weight_decay=0.01)
    torch_run(opt, params, targets, 5)
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = mt.Prodigy(twins, weight_decay=0.01)
    resumed.load_state_dict(saved)
    torch_run(opt, params, targets, 5)
    torch_run(resumed, twins, targets, 5)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one param group"):
        mt.Prodigy([{"params": params[:1]}, {"params": params[1:]}])
    with pytest.raises(ValueError, match="slice_p=11"):
        mt.Prodigy(params, slice_p=11)
    with pytest.raises(ValueError, match="fsdp_in_use=True"):
        mt.Prodigy(params, fsdp_in_use=True)
    with pytest.raises(ValueError, match="Invalid d0"):
        mt.Prodigy(params, d0=0.0)


@pytest.mark.parametrize("dtype,rel", [("float64", 1e-12), ("float32", 1e-5)])
def test_mtapply_torch_prodigy_equals_prodigyopt(dtype, rel):
    torch = pytest.importorskip("torch")
    prodigyopt = pytest.importorskip("prodigyopt")
    import mtapply.torch as mt

    assert_equals_peer(torch, mt.Prodigy, prodigyopt.Prodigy, VARIANTS, dtype, rel)


# a param without grads for a few steps (an unused branch): prodigyopt counts its steps per
# group and sums over the params that have grads; the param then steps on with the group
MISSED = frozenset({(1, 0), (2, 0), (40, 0), (3, 3), (99, 1)})


def test_params_that_miss_steps_follow_prodigyopt():
    torch = pytest.importorskip("torch")
    prodigyopt = pytest.importorskip("prodigyopt")
    import mtapply.torch as mt

    assert_equals_peer(torch, mt.Prodigy, prodigyopt.Prodigy, VARIANTS, "float64", 1e-12,
                       MISSED)


def test_the_prodigy_kernel_compiles():
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    spec = library.prodigy().spec()
    assert spec.n_totals == 2 and spec.outputs == ("scalars_out",)
    for dtypes in (("float32",) * 6, ("bfloat16", "bfloat16") + ("float32",) * 4):
        source = spec.source(dtypes)
        assert "a.totals_array[1] = total" in source and "a.scalars_out[" in source
        assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"
