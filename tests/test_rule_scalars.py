"""Scalar state of a rule (`mtapply.rule(..., scalars=...)`): numbers kept between steps for the
whole list, on the CPU path; NAdam (`mtapply.rules.library.nadam`) against torch.optim.NAdam."""
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mtapply
from mtapply.rules import library

COUNTER = dict(slots="param:rw grad:r", hyper=dict(lr=(None, ">= 0"), decay=0.5),
               scalars=dict(total=1.0),
               update="""
                   total = total * decay + step
                   param = param - lr * total * grad
               """)


def _lists(seed=0, shapes=((4, 3), (5,)), dtype=np.float64):
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal(s).astype(dtype) for s in shapes],
            [rng.standard_normal(s).astype(dtype) for s in shapes])


def _expected_totals(steps, decay=0.5, start=1.0):
    totals, total = [], start
    for t in range(1, steps + 1):
        total = total * decay + t
        totals.append(total)
    return totals


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_scalar_carries_from_step_to_step_in_two_copies(dtype):
    """The state is of the params' precision where every param is float64, else float32."""
    rule = mtapply.rule("counter", **COUNTER)
    params, grads = _lists(dtype=dtype)
    before = [p.copy() for p in params]
    state = rule.initial_scalars(dtype)
    assert state.dtype == dtype and state.tolist() == [1.0, 1.0, 1.0]
    totals = _expected_totals(4)
    for t in range(1, 5):
        rule.step(params, grads, lr=0.1, step=t, scalars_out=state)
        assert state[t % 2] == dtype(totals[t - 1])  # written at the step's parity
        assert state[(t + 1) % 2] == dtype(totals[t - 2] if t > 1 else 1.0)  # kept
        assert state[2] == dtype(totals[t - 1])  # the latest, where it stays
    for p, p0, g in zip(params, before, grads):
        want = p0 - sum(0.1 * total * g for total in totals)  # the totals are exact
        np.testing.assert_allclose(p, want, rtol=1e-12 if dtype == np.float64 else 1e-6)


def test_a_repeated_or_skipped_step_reads_what_the_step_before_left():
    rule = mtapply.rule("counter", **COUNTER)
    params, grads = _lists(1)
    state = rule.initial_scalars(np.float64)
    rule.step(params, grads, lr=0.1, step=1, scalars_out=state)
    rule.step(params, grads, lr=0.1, step=2, scalars_out=state, found_inf=1.0)  # skipped
    assert state.tolist() == [1.0, 1.5, 1.5]
    rule.step(params, grads, lr=0.1, step=2, scalars_out=state)
    again = state.copy()
    rule.step(params, grads, lr=0.1, step=2, scalars_out=state)  # the same step once more
    assert state.tolist() == again.tolist() == [2.75, 1.5, 2.75]


def test_a_plan_steps_the_same_scalar_state():
    rule = mtapply.rule("counter", **COUNTER)
    (params, grads), (twin, twin_grads) = _lists(2), _lists(2)
    plan = rule.plan(params, grads)
    state, twin_state = rule.initial_scalars(np.float64), rule.initial_scalars(np.float64)
    for t in range(1, 4):
        plan.step(lr=0.1, step=t, scalars_out=state)
        rule.step(twin, twin_grads, lr=0.1, step=t, scalars_out=twin_state)
    assert state.tolist() == twin_state.tolist()
    for a, b in zip(params, twin):
        np.testing.assert_array_equal(a, b)


def test_steps_without_the_state_array_or_with_a_wrong_one_are_refused_before_writing():
    rule = mtapply.rule("counter", **COUNTER)
    params, grads = _lists(3)
    before = [p.copy() for p in params]
    with pytest.raises(TypeError, match=r"keeps scalar state \(total\): pass scalars_out="):
        rule.step(params, grads, lr=0.1, step=1)
    with pytest.raises(ValueError, match="scalars_out must be a writable contiguous float64 "
                                         "array of 3 element"):
        rule.step(params, grads, lr=0.1, step=1, scalars_out=np.ones(2, np.float64))
    with pytest.raises(ValueError, match=r"float64 array .* got float32 .*the params are all "
                                         r"float64.*initial_scalars\(numpy.float64\)"):
        rule.step(params, grads, lr=0.1, step=1, scalars_out=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="one number, not one per tensor"):  # one scalar state
        rule.plan(params, grads).step(lr=[0.1, 0.2], step=1,
                                      scalars_out=rule.initial_scalars(np.float64))
    for p, p0 in zip(params, before):
        np.testing.assert_array_equal(p, p0)
    mixed = [params[0].astype(np.float32), params[1]]  # not all float64: float32 state
    with pytest.raises(ValueError, match="contiguous float32 array of 3 element.*got float64"):
        rule.step(mixed, [g.astype(p.dtype) for g, p in zip(grads, mixed)], lr=0.1, step=1,
                  scalars_out=np.ones(3, np.float64))
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        rule.initial_scalars(np.float16)


LATEST_G2 = dict(slots="param:rw grad:r", hyper=dict(lr=(None, ">= 0")), scalars=dict(seen=0.0),
                 totals={"g2": "grad * grad"},
                 update="""
                     seen = g2
                     param = param - lr * grad
                 """)


@given(st.lists(st.sampled_from([np.float32, np.float64]), min_size=1, max_size=5),
       st.integers(0, 2**32 - 1))
def test_a_whole_list_sum_feeds_scalar_state_in_the_params_precision(dtypes, seed):
    """The sum of grad^2 over the list, kept as scalar state: float64 (to float64 rounding)
    where every param is float64, else float32 (the float64 sum rounded once)."""
    rule = mtapply.rule("latest_g2", **LATEST_G2)
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(int(rng.integers(1, 50))).astype(d) for d in dtypes]
    params = [np.ones_like(g) for g in grads]
    plan = rule.plan(params, grads)
    wide = all(d == np.float64 for d in dtypes)
    assert plan.sum_dtype == ("float64" if wide else "float32")
    state = rule.initial_scalars(plan.sum_dtype)
    plan.step(lr=0.5, step=1, scalars_out=state)
    exact = sum(float(np.sum(np.float64(g) ** 2)) for g in grads)
    assert state.dtype == plan.sum_dtype
    if wide:
        assert state[2] == pytest.approx(exact, rel=1e-14)
    else:
        assert state[2] == pytest.approx(np.float32(exact), rel=1e-6)


@pytest.mark.parametrize("change,error,message", [
    (dict(update="total = total + grad\nparam = param - lr * grad"), ValueError,
     "scalar state 'total' holds one value for the whole list"),
    (dict(scalars=dict(grad=1.0)), ValueError, "already a slot"),
    (dict(scalars=dict(total="one")), TypeError, "must be a finite number"),
    (dict(scalars=dict(total=float("inf"))), TypeError, "must be a finite number"),
    (dict(scalars=[1.0]), TypeError, "scalars must be a dict"),
    (dict(sums={"g2": "grad * grad"}), ValueError, "scalars cannot be combined with per-tensor sums"),
])
def test_bad_scalar_declarations_are_refused_when_the_rule_is_made(change, error, message):
    with pytest.raises(error, match=message):
        mtapply.rule("counter", **{**COUNTER, **change})


def test_a_rule_with_scalars_pickles_and_shows_them():
    rule = mtapply.rule("counter", **COUNTER)
    assert "scalars={'total': 1.0}" in repr(rule)
    assert rule.scalars == {"total": 1.0} and rule.program.uses_step
    copy = pickle.loads(pickle.dumps(rule))
    params, grads = _lists(4)
    twin = [p.copy() for p in params]
    a, b = rule.initial_scalars(np.float64), copy.initial_scalars(np.float64)
    for t in (1, 2):
        rule.step(params, grads, lr=0.1, step=t, scalars_out=a)
        copy.step(twin, grads, lr=0.1, step=t, scalars_out=b)
    assert a.tolist() == b.tolist()


def test_the_generated_kernel_reads_one_copy_and_one_thread_writes_the_other():
    source = mtapply.rule("counter", **COUNTER).cuda_source()
    assert "sum_t* scalars_out;" in source
    assert "a.scalars_out[(1 - z_parity) * 1 + 0]" in source
    assert ("if (blockIdx.x == 0 && threadIdx.x == 0) { a.scalars_out[z_parity * 1 + 0] = "
            in source) and "a.scalars_out[2] = " in source


@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_nadam_follows_torch_optim_nadam(decoupled, maximize):
    torch = pytest.importorskip("torch")
    rule = library.nadam(decoupled, maximize)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=g, dtype=torch.float64),
              torch.randn(7, generator=g, dtype=torch.float64)]
    theirs = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.NAdam(theirs, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1,
                            momentum_decay=0.01, decoupled_weight_decay=decoupled,
                            maximize=maximize, foreach=False)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    state = rule.initial_scalars(np.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch's scalar state then float64, as ours is
    try:
        for t in range(1, 13):
            grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
            for p, grad in zip(theirs, grads):
                p.grad = grad.clone()
            opt.step()
            rule.step([p.numpy() for p in params], [x.numpy() for x in grads],
                      [x.numpy() for x in exp_avgs], [x.numpy() for x in exp_avg_sqs], lr=0.01,
                      beta1=0.8, beta2=0.99, weight_decay=0.1, momentum_decay=0.01, step=t,
                      scalars_out=state)
    finally:
        torch.set_default_dtype(default)
    mu_product = opt.state[theirs[0]]["mu_product"]
    assert mu_product.dtype == torch.float64
    np.testing.assert_allclose(state[[12 % 2, 2]], mu_product.item(), rtol=1e-14)
    for ours, ref in zip(params, theirs):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-12, atol=1e-14)
    for ours, ref in zip(exp_avg_sqs, theirs):
        torch.testing.assert_close(ours, opt.state[ref]["exp_avg_sq"], rtol=1e-8, atol=1e-12)


def test_a_rule_with_scalars_in_a_torch_optimizer_keeps_them_per_group():
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    rule = mtapply.rule("counter", **COUNTER)
    params = [torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)]
    opt = mt.optimizer(rule, [{"params": params[:1]}, {"params": params[1:], "decay": 0.25}],
                       lr=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert opt.state[params[0]]["total"].item() == _expected_totals(3)[-1]
    assert opt.state[params[1]]["total"].item() == _expected_totals(3, decay=0.25)[-1]
    assert len(opt.param_groups) == 2


def test_mtapply_optax_carries_scalar_state_in_its_state():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import jax.numpy as jnp
    import mtapply.optax as mtx

    tx = mtx.transformation(library.nadam(), 1e-3)
    params = {"w": jax.device_put(jnp.ones(3, jnp.float32), jax.devices("cpu")[0])}
    state = tx.init(params)
    assert state._fields[-1] == "mu_product" and float(state.mu_product) == 1.0
    for _ in range(2):
        _, state = tx.update(params, state, params)
    mu = [0.9 * (1 - 0.5 * 0.96 ** (t * 4e-3)) for t in (1, 2)]
    assert float(state.mu_product) == pytest.approx(mu[0] * mu[1], rel=1e-6)


def test_modulo_follows_python_and_picks_every_kth_step():
    """`%` as Python's (the sign of the divisor), uniform or per element: an update applied
    every third step, and the fractional part of negative numbers."""
    rule = mtapply.rule("every_third", slots="param:rw grad:r frac:rw",
                        hyper=dict(lr=(None, ">= 0")),
                        update="""
                            param = where(step % 3 == 0, param - lr * grad, param)
                            frac = grad % 0.75 + (0 - grad) % -0.5
                        """)
    params, grads = _lists(6)
    fracs = [np.zeros_like(g) for g in grads]
    before = [p.copy() for p in params]
    for t in range(1, 7):
        rule.step(params, grads, fracs, lr=0.5, step=t)
        moved = t // 3
        for p, p0, g in zip(params, before, grads):
            np.testing.assert_allclose(p, p0 - moved * 0.5 * g, rtol=1e-12, atol=1e-15)
    for g, f in zip(grads, fracs):
        want = np.array([x % 0.75 + (-x) % -0.5 for x in g.ravel()]).reshape(g.shape)
        np.testing.assert_allclose(f, want, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="division by the literal 0"):
        mtapply.rule("bad", slots="param:rw grad:r", hyper={}, update="param = param % 0")


YOGI_LIKE = dict(slots="param:rw grad:r v:rw=1e-6 anchor:rw=param",
                 hyper=dict(lr=(None, ">= 0")),
                 update="""
                     v = v + grad * grad
                     param = param - lr * grad / sqrt(v) + 0 * anchor
                     anchor = anchor
                 """)


def test_declared_first_values_of_state_slots_in_torch_and_optax():
    rule = mtapply.rule("yogi_like", **YOGI_LIKE)
    assert rule.initial == {"v": 1e-6, "anchor": "param"}
    assert "v:rw=1e-06 anchor:rw=param" in repr(rule)
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    p = torch.randn(4, 3).to(memory_format=torch.contiguous_format).requires_grad_()
    start = p.detach().clone()
    opt = mt.optimizer(rule, [p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(opt.state[p]["v"], torch.full_like(p, 1e-6 + 1.0))
    torch.testing.assert_close(opt.state[p]["anchor"], start)  # the param before the step
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import mtapply.optax as mtx

    params = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
    state = mtx.transformation(rule, 0.1, flat_state=False).init(params)
    np.testing.assert_array_equal(np.asarray(state.v["w"]), np.full((2, 3), 1e-6, np.float32))
    np.testing.assert_array_equal(np.asarray(state.anchor["w"]), np.asarray(params["w"]))


@pytest.mark.parametrize("slots,message", [
    ("param:rw=1 grad:r", "only state slots declare a first value"),
    ("param:rw grad:r v:rw=one", "a first value is a finite number or param"),
    ("param:rw grad:r v:rw=inf", "a first value is a finite number or param"),
])
def test_bad_first_values_are_refused(slots, message):
    with pytest.raises(ValueError, match=message):
        mtapply.rule("bad", slots=slots, hyper={}, update="param = param - grad")


EMA = dict(slots="param:r grad:r ema:rw=param", hyper=dict(lr=(0.1, "[0, 1]")),
           update="ema = ema + lr * (param - ema)")  # lr: the average's rate


def test_a_state_only_rule_keeps_an_average_of_the_params_and_never_writes_them():
    rule = mtapply.rule("ema", **EMA)
    params, grads = _lists(7)
    before = [p.copy() for p in params]
    emas = [np.zeros_like(p) for p in params]
    rule.step(params, grads, emas, lr=0.5)
    for p, p0, e in zip(params, before, emas):
        np.testing.assert_array_equal(p, p0)
        np.testing.assert_allclose(e, 0.5 * p0, rtol=1e-12)
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    w = torch.randn(5, requires_grad=True)
    opt = mt.optimizer(rule, [w], lr=0.25)
    start = w.detach().clone()
    for _ in range(2):
        w.grad = torch.ones_like(w)
        opt.step()
    torch.testing.assert_close(w.detach(), start, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[w]["ema"], start)  # first value: the param itself
    with pytest.raises(ValueError, match="keeps state only"):
        rule.spec(master_weights=True)
    with pytest.raises(ValueError, match="a rule writes at least one slot"):
        mtapply.rule("nothing", slots="param:r grad:r", hyper={}, update="x = grad")
    no_lr = mtapply.rule("no_lr", slots="param:rw grad:r", hyper=dict(rate=0.1),
                         update="param = param - rate * grad")
    with pytest.raises(TypeError, match="rule 'no_lr' has no lr"):
        mt.optimizer(no_lr, [w])


@pytest.mark.parametrize("definition", [COUNTER, EMA, YOGI_LIKE], ids=["scalars", "state-only",
                                                                       "first-values"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_new_constructs_compile_for_the_gpu(definition, dtype):
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    rule = mtapply.rule("compiled", **definition)
    spec = rule.spec()
    types = (dtype, dtype) + ("float32",) * (len(rule.slots) - 2)
    for arch in ("sm_80", "sm_90"):
        assert _source.compile_offline(spec.source(types), arch)[:4] == b"\x7fELF"
