"""optax.inject_hyperparams over every mtapply.optax transformation, and hyperparameters given
as arrays: inject_hyperparams passes every number (b1, eps, momentum, ...) as an array, traced
under jit. Such a hyperparameter reaches the kernel as a device value (the op then runs as its
rule, `mtapply._optax_rules`): the results follow optax's, a new value in the state takes
effect without retracing, and no tracer leaks into a callback."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply import reference  # noqa: E402
from mtapply.rules import library  # noqa: E402

STEPS = 6
LION = library.lion()

# name -> (mtapply factory, optax factory or None, keyword arguments for both)
CASES = {
    "adam": (mtx.adam, optax.adam, {}),
    "adam-eps_root-nesterov": (mtx.adam, optax.adam, dict(eps_root=1e-6, nesterov=True)),
    "adamw-mask": (mtx.adamw, optax.adamw, dict(weight_decay=0.1,
                                                 mask={"w": True, "b": False, "e": True})),
    "sgd": (mtx.sgd, optax.sgd, {}),
    "sgd-momentum": (mtx.sgd, optax.sgd, dict(momentum=0.9)),
    "sgd-nesterov": (mtx.sgd, optax.sgd, dict(momentum=0.8, nesterov=True)),
    "lars": (mtx.lars, optax.lars, dict(momentum=0.9, trust_coefficient=0.02)),
    "lars-mask": (mtx.lars, optax.lars, dict(trust_coefficient=0.02,
                                              trust_ratio_mask={"w": True, "b": False, "e": True})),
    "lamb": (mtx.lamb, optax.lamb, dict(weight_decay=0.01)),
    "lamb-mask": (mtx.lamb, optax.lamb, dict(weight_decay=0.01, eps_root=1e-8,
                                              mask={"w": False, "b": True, "e": True})),
    "lion": (mtx.lion, optax.lion, dict(weight_decay=0.01)),
    "adan": (mtx.adan, optax.adan, dict(weight_decay=0.01)),
    "adagrad": (mtx.adagrad, optax.adagrad, {}),
    "adamax": (mtx.adamax, optax.adamax, dict(b1=0.8)),
    "adadelta": (mtx.adadelta, optax.adadelta, dict(weight_decay=0.01)),
    "radam": (mtx.radam, optax.radam, dict(b2=0.99, threshold=4.5)),
    "nadamw": (mtx.nadamw, optax.nadamw, dict(weight_decay=0.01)),
    "rmsprop": (mtx.rmsprop, optax.rmsprop, {}),
    "rmsprop-centered-momentum": (mtx.rmsprop, optax.rmsprop, dict(centered=True, momentum=0.9)),
    "schedule_free_adamw": (mtx.schedule_free_adamw, optax.contrib.schedule_free_adamw,
                            dict(weight_decay=0.01)),
    "rule": (mtx.alias(LION), None, dict(beta1=0.8)),
}


def _tree(rng, scale=1.0):
    return {"w": jnp.asarray(rng.standard_normal((7, 5)) * scale, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(5) * scale, jnp.float32),
            "e": jnp.zeros((0,), jnp.float32)}


def _train(tx, params, grads_seq, jit: bool):
    """(params after each step, final state)."""
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    step = jax.jit(step) if jit else step
    state, seen = (jax.jit(tx.init) if jit else tx.init)(params), []
    for grads in grads_seq:
        params, state = step(params, state, grads)
        seen.append(params)
    return seen, state


def _assert_close(got, want, rtol=2e-5, atol=2e-6, what="params"):
    for t, (g, w) in enumerate(zip(got, want), 1):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                       err_msg=f"{what} after step {t}")


def _data(seed):
    rng = np.random.default_rng(seed)
    return _tree(rng), [_tree(rng, 0.5) for _ in range(STEPS)]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_inject_hyperparams_follows_optax(name, jit):
    ours, theirs, kwargs = CASES[name]
    params, grads_seq = _data(1)
    lr = 0.3 if name.startswith("lars") else 1e-2
    got, state = _train(optax.inject_hyperparams(ours)(learning_rate=lr, **kwargs), params,
                        grads_seq, jit)
    if theirs is None:  # a user's rule: against the same rule with numbers
        theirs = ours
    want, _ = _train(optax.inject_hyperparams(theirs)(learning_rate=lr, **kwargs), params,
                     grads_seq, True)
    _assert_close(got, want)
    assert int(state.count) == STEPS


def test_injected_values_are_read_by_the_kernel_at_run_time():
    """A new b1, eps and weight decay in the state change the next step like optax's, and the
    jitted update is traced once: the values are not compiled in."""
    params, grads_seq = _data(2)
    traces = []

    def trained(factory):
        tx = optax.inject_hyperparams(factory)(learning_rate=1e-2, weight_decay=0.1)

        @jax.jit
        def step(params, state, grads):
            traces.append(factory)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state, seen = tx.init(params), []
        p = params
        for t, grads in enumerate(grads_seq):
            hyper = dict(state.hyperparams, b1=jnp.asarray(0.9 - 0.1 * t),
                         eps=jnp.asarray(10.0 ** -(t + 3)), weight_decay=jnp.asarray(0.05 * t))
            p, state = step(p, state._replace(hyperparams=hyper), grads)
            seen.append(p)
        return seen

    got, want = trained(mtx.adamw), trained(optax.adamw)
    _assert_close(got, want)
    assert traces.count(mtx.adamw) == 1


def test_no_tracer_leaks_into_the_callbacks():
    params, grads_seq = _data(3)
    for factory, kwargs in ((mtx.lion, {}), (mtx.adan, {}), (mtx.adamw, {}), (mtx.lamb, {}),
                            (mtx.sgd, dict(momentum=0.9)), (mtx.lars, {})):
        with jax.checking_leaks():
            _train(optax.inject_hyperparams(factory)(learning_rate=1e-2, **kwargs), params,
                   grads_seq[:2], jit=True)


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
def test_arrays_given_directly_equal_the_same_numbers(fused):
    """An array hyperparameter runs the rule, which reads every hyperparameter from the
    device; numbers run the built-in op (only lr and the step there): the same steps."""
    params, grads_seq = _data(4)
    numbers = dict(b1=0.85, b2=0.99, eps=1e-6, weight_decay=0.05)
    arrays = {k: jnp.asarray(v) for k, v in numbers.items()}
    run = _fused_run if fused else (lambda tx, p, g: _train(tx, p, g, True)[0])
    for make in (mtx.fused_adamw, mtx.fused_lamb) if fused else (mtx.adamw, mtx.lamb):
        built_in, ruled = make(1e-2, **numbers), make(1e-2, **arrays)
        assert "beta1" not in built_in.mtapply[0].spec(()).device_scalars
        assert "beta1" in ruled.mtapply[0].spec(()).device_scalars
        _assert_close(run(ruled, params, grads_seq), run(built_in, params, grads_seq),
                      rtol=1e-5, atol=1e-6)


def _fused_run(opt, params, grads_seq):
    step, state, seen = jax.jit(lambda p, s, g: opt.step(p, g, s)), opt.init(params), []
    for grads in grads_seq:
        params, state = step(params, state, grads)
        seen.append(params)
    return seen


def test_lars_with_array_hyperparameters_follows_the_reference():
    """mtapply's LARS (weight decay in the trust ratio's denominator), a leaf left out by the
    masks stepped with plain momentum: as the built-in op, against the float64 reference."""
    params, grads_seq = _data(5)
    hyper = dict(weight_decay=0.01, trust_coefficient=0.02, eps=1e-6, momentum=0.9)
    mask = {"w": True, "b": False, "e": True}
    tx = mtx.lars(0.5, **{k: jnp.asarray(v) for k, v in hyper.items()}, trust_ratio_mask=mask,
                  weight_decay_mask=mask)
    got, _ = _train(tx, params, grads_seq, True)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_seq):
        for k in p:
            p[k], v[k] = reference.lars(p[k], np.asarray(grads[k], np.float64), v[k], lr=0.5,
                                        adapt=mask[k], **hyper)
        for k in p:
            np.testing.assert_allclose(np.asarray(got[t][k]), p[k], rtol=1e-5, atol=1e-6)


def test_hyperparameters_must_be_scalars():
    with pytest.raises(TypeError, match="b1 must be a number or a one-element array"):
        mtx.adam(1e-2, b1=jnp.ones(2))


def test_multi_transform_of_array_hyperparameters_is_optaxs():
    params, grads_seq = _data(6)
    labels = {"w": "a", "b": "b", "e": "a"}
    ours = mtx.multi_transform({"a": mtx.adamw(1e-2, b1=jnp.asarray(0.8)), "b": mtx.adam(3e-2)},
                               labels)
    theirs = optax.multi_transform({"a": optax.adamw(1e-2, b1=0.8), "b": optax.adam(3e-2)},
                                   labels)
    _assert_close(_train(ours, params, grads_seq, True)[0],
                  _train(theirs, params, grads_seq, True)[0])


def test_equal_calls_share_one_ffi_plan(monkeypatch):
    """The FFI handler's plans are kept by what they do: a transformation made anew for each
    step (inject_hyperparams, eagerly) registers its plan once. (No GPU here: the registration
    is counted.)"""
    from mtapply import _xla

    registered = []
    monkeypatch.setattr(_xla, "_ids", {})
    monkeypatch.setattr(_xla, "_register_plan", lambda *a: registered.append(a) or len(registered))
    spec = mtx.adamw(1e-2).mtapply[0].spec(())
    table = np.arange(8, dtype=np.int64).reshape(2, 4)
    args = (spec, table, table * 0, [("float32",) * 4] * 2, [3, 4], dict(lr=_xla.placeholder(0)),
            {"lr": 9}, [0], [3] * 10)
    assert _xla.prepare(*args) == _xla.prepare(*args) == 1
    assert _xla.prepare(*args[:5], dict(lr=_xla.placeholder(0), beta1=0.5), *args[6:]) == 2
    assert len(registered) == 2
    # the same element counts in other shapes (a factored rule's rows and columns): a plan each
    assert _xla.prepare(*args, shapes={"params": [(3,), (2, 2)]}) == 3
    assert _xla.prepare(*args, shapes={"params": [(3,), (4, 1)]}) == 4
    assert _xla.prepare(*args, shapes={"params": [(3,), (4, 1)]}) == 4
    assert registered[-1][-1] == {"params": ((3,), (4, 1))}


def _rule_variants():
    from mtapply import _optax_rules

    rules = [_optax_rules.adam(), _optax_rules.adam(True), _optax_rules.sgd(),
             _optax_rules.sgd(True), _optax_rules.lars(), _optax_rules.lamb(),
             _optax_rules.lamb(False, True)]
    for rule in rules:
        for mode in ("inplace", "delta", "zero"):
            spec = rule.spec() if mode == "inplace" else rule.spec().with_param_mode(mode)
            n = len(spec.slots)
            for dtypes in (("float32",) * n, ("bfloat16",) * n,
                           ("float32", "float32", "bfloat16") + ("float32",) * (n - 3)):
                yield pytest.param(spec, dtypes, id=f"{spec.name[:14]}-{mode}-{'-'.join(dtypes)}")


@pytest.mark.parametrize("spec,dtypes", list(_rule_variants()))
def test_rules_of_array_hyperparameters_compile(spec, dtypes):
    """Each rule that array hyperparameters run compiles with NVRTC (no GPU needed), in the
    param modes of the transformations and with a moment of its own dtype (mu_dtype)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from mtapply import _source

    source = _source.variant_source(spec.kernel_file, spec.functors_for(dtypes), dtypes, spec.flags)
    cubin = _source.compile_offline(source, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    for k in range(len(spec.functors)):
        assert _source.entry_name(k).encode() in cubin


def test_the_ffi_route_refuses_what_the_kernels_cannot_step_before_registering(monkeypatch):
    """The XLA route checks as the torch and CuPy routes do: a rule with no CUDA kernel (an
    8-bit slot that a factored rule's row and column means read) is refused by name, and
    factored slots that fit neither mode (param-shaped row vectors) are refused naming the
    param, before any plan is made; an 8-bit momentum beside factored slots registers."""
    from mtapply import _launcher, _xla
    from mtapply.rules import library, rule as make_rule

    registered = []
    monkeypatch.setattr(_xla, "_ids", {})
    monkeypatch.setattr(_xla, "_register_plan", lambda *a: registered.append(a) or 1)
    rule = library.adafactor_optax(momentum=True)
    eight = rule.with_state_bits(8, slots=("ema",)).spec()
    table = np.zeros((1, len(eight.slots)), np.int64)
    assert _xla.prepare(eight, table, table, [("float32",) * len(eight.slots)], [6], {}, {},
                        [0], [6] * len(eight.slots)) == 1
    assert len(registered) == 1
    summed = make_rule("ema_means", slots="param:rw grad:r ema:rw row_var:rw@row "
                                             "col_var:rw@col variance:rw@unfactored",
                          hyper={}, update="""
                              ema = 0.9 * ema + 0.1 * grad
                              row_var = row_mean(ema * ema)
                              col_var = col_mean(ema * ema)
                              variance = ema * ema
                              v = row_var * col_var / col_mean(row_var) if factored else variance
                              param = param - 0.01 * ema * rsqrt(v + 1e-30)
                          """).with_state_bits(8, slots=("ema",)).spec()
    with pytest.raises(NotImplementedError, match=r"8-bit slot 'ema' is read by the row and"):
        _xla.prepare(summed, table, table, [("float32",) * len(summed.slots)], [6], {}, {}, [0],
                     [6] * len(summed.slots))
    assert len(registered) == 1
    spec = rule.spec()
    good = {name: [(2, 3)] for name in spec.slots}
    good.update(row_vars=[(2, 1)], col_vars=[(1, 3)], variances=[(0,)])
    arrays, means = _launcher.with_shapes(spec, {k: [_xla._Shape(s) for s in v]
                                                 for k, v in good.items()}, {})
    assert arrays["shape_array"][0][:3].tolist() == [6, 2, 3] and means > 0
    bad = dict(good, row_vars=[(2, 3)], col_vars=[(2, 3)])
    with pytest.raises(ValueError, match=r"params\[0\] has shape \(2, 3\)"):
        _launcher.with_shapes(spec, {k: [_xla._Shape(s) for s in v] for k, v in bad.items()}, {})
