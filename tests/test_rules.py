"""User-written rules (`mtapply.rule`): the language's checks, the NumPy path against float64
references and torch.optim, and the generated CUDA compiled by NVRTC (no GPU needed)."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mtapply
from mtapply import _source

LION = dict(slots="param:rw grad:r exp_avg:rw",
            hyper=dict(lr=None, beta1=0.9, beta2=0.99, weight_decay=0.0),
            update="""
                c = beta1 * exp_avg + (1 - beta1) * grad
                param = param * (1 - lr * weight_decay) - lr * sign(c)
                exp_avg = beta2 * exp_avg + (1 - beta2) * grad
            """)
ADAGRAD = dict(slots="param:rw grad:r state_sum:rw",
               hyper=dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10),
               update="""
                   g = grad + weight_decay * param
                   state_sum = state_sum + g * g
                   clr = lr / (1 + (step - 1) * lr_decay)
                   param = param - clr * (g / (sqrt(state_sum) + eps))
               """)
# every construct of the language once: where() on element and uniform conditions, each
# function, powers, unary minus, a temporary reassigned
EVERYTHING = dict(slots="param:rw grad:r a:rw b:r",
                  hyper=dict(lr=None, k=2.0),
                  update="""
                      t = where(grad > 0, sqrt(abs(grad)), -rsqrt(abs(grad) + 1))
                      t = t + exp(-abs(b)) * log(1 + b * b) + min(grad, b) - max(a, -1)
                      u = where(step > 1, lr, lr / k)
                      u = where(step % 3 == 0, u * 0.5, u) + (grad % 0.75) * 0
                      t = t + (b % -0.5) * 0.1
                      a = a ** 2 * 0.5 + b ** 0.5 * 0 + abs(a) ** 1.5 * 0.1 + sign(grad)
                      param = param - u * t
                  """)
# per-tensor sums: LARS (norms of the old values) and LAMB (the norm of a direction computed
# from the new moments by the lines before the first use of a sum)
LARS = dict(slots="param:rw grad:r momentum_buffer:rw",
            hyper=dict(lr=None, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                       eps=0.0),
            sums={"p2": "param * param", "g2": "grad * grad"},
            finish="""
                p_norm = sqrt(p2)
                g_norm = sqrt(g2)
                ratio = trust_coefficient * p_norm / (g_norm + weight_decay * p_norm + eps)
                local_lr = where(p_norm > 0, where(g_norm > 0, lr * ratio, lr), lr)
            """,
            update="""
                d = local_lr * (grad + weight_decay * param)
                momentum_buffer = momentum * momentum_buffer + d
                param = param - momentum_buffer
            """)
LAMB = dict(slots="param:rw grad:r exp_avg:rw exp_avg_sq:rw",
            hyper=dict(lr=None, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01),
            sums={"p2": "param * param", "u2": "u * u"},
            update="""
                exp_avg = exp_avg * beta1 + (1 - beta1) * grad
                exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
                u = (exp_avg / (1 - beta1 ** step)) / (sqrt(exp_avg_sq / (1 - beta2 ** step)) + eps)
                u = u + weight_decay * param
                ratio = where(p2 > 0, where(u2 > 0, sqrt(p2) / sqrt(u2), 1), 1)
                param = param - lr * ratio * u
            """)
SHAPES = [(10,), (3, 4), (0,), (1,), (257,)]


def _lists(rng, n_slots, dtype=np.float32, positive=()):
    return [[(np.abs(x) if k in positive else x).astype(dtype)
             for x in (rng.standard_normal(s) for s in SHAPES)] for k in range(n_slots)]


def test_lion_follows_its_float64_definition():
    lion = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(0)
    params, _, exp_avgs = _lists(rng, 3)
    want_p = [p.astype(np.float64) for p in params]
    want_m = [m.astype(np.float64) for m in exp_avgs]
    for _ in range(5):
        grads = _lists(rng, 1)[0]
        lion.step(params, grads, exp_avgs, lr=0.01, weight_decay=0.1)
        for i, g in enumerate(grads):
            c = 0.9 * want_m[i] + 0.1 * g
            want_p[i] = want_p[i] * (1 - 0.01 * 0.1) - 0.01 * np.sign(c)
            want_m[i] = 0.99 * want_m[i] + 0.01 * g
    for got, want in zip(params + exp_avgs, want_p + want_m):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_adagrad_rule_matches_torch_optim():
    torch = pytest.importorskip("torch")
    adagrad = mtapply.rule("adagrad", **ADAGRAD)
    rng = np.random.default_rng(1)
    params = _lists(rng, 1)[0]
    sums = [np.zeros_like(p) for p in params]
    theirs = [torch.tensor(p, requires_grad=True) for p in params]
    opt = torch.optim.Adagrad(theirs, lr=0.1, lr_decay=0.01, weight_decay=0.05)
    for step in range(1, 21):
        grads = _lists(rng, 1)[0]
        adagrad.step(params, grads, sums, lr=0.1, lr_decay=0.01, weight_decay=0.05, step=step)
        for t, g in zip(theirs, grads):
            t.grad = torch.tensor(g)
        opt.step()
    for got, want in zip(params, theirs):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=2e-6, atol=1e-7)


def test_every_construct_follows_the_float64_definition():
    rule = mtapply.rule("everything", **EVERYTHING)
    rng = np.random.default_rng(2)
    params, grads, a, b = _lists(rng, 4, positive=(3,))
    want = [np.array(x, np.float64) for x in params], [np.array(x, np.float64) for x in a]
    rule.step(params, grads, a, b, lr=0.1, step=1)
    for i, (g, bb) in enumerate(zip(grads, b)):
        g, bb, aa = g.astype(np.float64), bb.astype(np.float64), want[1][i]
        t = np.where(g > 0, np.sqrt(np.abs(g)), -1 / np.sqrt(np.abs(g) + 1))
        t = t + np.exp(-np.abs(bb)) * np.log(1 + bb * bb) + np.fmin(g, bb) - np.fmax(aa, -1)
        t = t + np.mod(bb, -0.5) * 0.1  # Python's %: the sign of the divisor
        want[1][i] = aa ** 2 * 0.5 + np.abs(aa) ** 1.5 * 0.1 + np.sign(g)
        want[0][i] = want[0][i] - 0.05 * t  # step 1: lr / k
    for got, expected in zip(params + a, want[0] + want[1]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# bfloat16(x): on elements and on a uniform value
ROUNDING = dict(slots="param:rw grad:r", hyper=dict(k=1.0),
                update="param = bfloat16(grad) * bfloat16(k)")
TIE = 2.0 ** -8  # half a bfloat16 step above 1: ties go to the even neighbour
ROUNDED = {1 + TIE: 1.0, 1 + 3 * TIE: 1 + 4 * TIE, -(1 + 3 * TIE): -(1 + 4 * TIE),
           1 + 1.5 * TIE: 1 + 2 * TIE, 3.4e38: np.inf, -3.4e38: -np.inf,  # a subnormal too:
           1e-40: float(np.uint32(1 << 16).view(np.float32)),
           -0.0: -0.0, np.inf: np.inf, 0.1: 0.10009765625, 65536.0 + 256.0: 65536.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bfloat16_rounds_to_the_nearest_bfloat16_ties_to_even(dtype):
    rule = mtapply.rule("rounding", **ROUNDING)
    grads = np.array([*ROUNDED, np.nan], dtype)
    params = np.full_like(grads, 7.0)
    rule.step([params], [grads], k=1 + 3 * TIE)  # k rounds to 1 + 4 TIE
    want = np.array([*ROUNDED.values(), np.nan], dtype) * dtype(1 + 4 * TIE)
    np.testing.assert_array_equal(params, want)
    assert np.signbit(params[list(ROUNDED).index(-0.0)])
    torch = pytest.importorskip("torch")
    drawn = np.random.default_rng(4).standard_normal(10_000).astype(dtype) * 1e3
    params = np.full_like(drawn, 7.0)
    rule.step([params], [drawn], k=1.0)
    expected = torch.from_numpy(drawn).to(torch.bfloat16).to(torch.float64).numpy()
    np.testing.assert_array_equal(params, expected.astype(dtype))


def test_float16_storage_computes_in_float32():
    lion = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(3)
    params, grads, exp_avgs = _lists(rng, 3, np.float16)
    want = [p.astype(np.float32) - 0.01 * np.sign(0.9 * m.astype(np.float32) + 0.1 * g)
            for p, g, m in zip(params, grads, exp_avgs)]
    lion.step(params, grads, exp_avgs, lr=0.01)
    for got, expected in zip(params, want):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, expected.astype(np.float16))


def test_plan_steps_like_the_one_call():
    lion = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(4)
    lists = _lists(rng, 3)
    copies = [[x.copy() for x in column] for column in lists]
    plan = lion.plan(*lists)
    for _ in range(3):
        plan.step(lr=0.01, beta1=0.5)
        lion.step(*copies, lr=0.01, beta1=0.5)
    for got, want in zip(lists[0] + lists[2], copies[0] + copies[2]):
        np.testing.assert_array_equal(got, want)


def test_amp_grad_scale_and_found_inf():
    lion = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(5)
    params, grads, exp_avgs = _lists(rng, 3)
    kept = [p.copy() for p in params]
    lion.step(params, grads, exp_avgs, lr=0.01, found_inf=1.0)
    for got, want in zip(params, kept):
        np.testing.assert_array_equal(got, want)
    scaled = [g * 1024 for g in grads]
    twin = [p.copy() for p in params], [m.copy() for m in exp_avgs]
    lion.step(params, scaled, exp_avgs, lr=0.01, grad_scale=1024.0)
    lion.step(twin[0], grads, twin[1], lr=0.01)
    for got, want in zip(params + exp_avgs, twin[0] + twin[1]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _bad(update, slots="param:rw grad:r m:rw", hyper=None):
    return mtapply.rule("bad", slots=slots, hyper=hyper or {"lr": None}, update=update)


@pytest.mark.parametrize("update,error,match", [
    ("param = param - lr * nope", ValueError, r"line 1 .*unknown name 'nope'"),
    ("m = grad\ngrad = 0 * grad\nparam = param", ValueError, r"line 2 .*'grad' is read-only"),
    ("param = param - lr * grad", ValueError, r"'m' is declared rw but no line assigns it"),
    ("m = grad > 0\nparam = param", TypeError, r"line 1 .*comparison is only a where"),
    ("m = (grad > 0) * 2\nparam = param", TypeError, r"line 1 .*cannot be an operand of \*"),
    ("m = where(grad, 1, 2)\nparam = param", TypeError, r"line 1 .*first argument must be a comp"),
    ("m = grad / 0\nparam = param", ValueError, r"line 1 .*division by the literal 0"),
    ("m = grad\nparam = __import__('os').system('true')", ValueError,
     r"line 2 .*__import__\('os'\)\.system\(\) is not a rule function"),
    ("m = grad\nparam = __import__('os')", ValueError, r"line 2 .*__import__\(\) is not a rule"),
    ("m = grad.real\nparam = param", ValueError, r"line 1 .*Attribute \(grad.real\)"),
    ("m = grad\nparam = param[0]", ValueError, r"line 2 .*Subscript"),
    ("m = grad\nlr = 1\nparam = param", ValueError, r"line 2 .*'lr' is a hyperparameter"),
    ("m = grad\nparam = sqrt(grad, m)", TypeError, r"line 2 .*sqrt\(\) takes 1"),
    ("m = grad\nparam = param if lr else m", ValueError, r"line 2 .*IfExp"),
    ("m, param = grad, grad", ValueError, r"line 1 .*one assignment NAME = expression"),
    ("m = grad\nparam = param - 1e999 * lr", ValueError, r"line 2 .*not a finite number"),
    ("m = grad +\nparam = param", ValueError, r"line 1 .*invalid syntax"),
])
def test_bad_rules_are_refused_naming_the_line(update, error, match):
    with pytest.raises(error, match=match):
        _bad(update)


@pytest.mark.parametrize("slots,hyper,match", [
    ("grad:r param:rw", {}, "begin with param:rw"),
    ("param:rw m:rw", {}, "include grad:r"),
    ("param:rw grad:r m:x", {}, "'m:x' is not NAME:r or NAME:rw"),
    ("param:rw grad:r m:rw m:r", {}, "'m' is declared twice"),
    ("param:rw grad:r step:rw", {}, "'step' is a reserved name"),
    ("param:rw grad:r m:rw", {"m": 1.0}, "'m' is already a slot"),
    ("param:rw grad:r m:rw", {"lr": "fast"}, "default of 'lr' must be a number"),
    ("param:rw grad:r m:rw", {"lr": (0.1, "positive")}, "'positive' is not a range of 'lr'"),
    ("param:rw grad:r m:rw", {"lr": (0.1, 0)}, "the range of 'lr' must be a string"),
    ("param:rw grad:r m:rw", {"lr": (0.1, ">= 0", 1)}, "a \\(default, range\\) pair"),
    ("param:rw grad:r m:rw", {"b": (0.5, "(1, 0)")}, "range '\\(1, 0\\)' of 'b' is empty"),
    ("param:rw grad:r m:rw", {"b": (1.0, "[0, 1)")}, "default 1.0 of 'b' is outside its range"),
    ("param:rw grad:r m:rw", {"b": (float("inf"), None)}, "range of 'b' must be a string"),
])
def test_bad_slots_and_hyperparameters(slots, hyper, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _bad("m = grad\nparam = param", slots=slots, hyper=hyper)


def test_step_arguments_are_checked_before_anything_is_written():
    lion = mtapply.rule("lion", **LION)
    rng = np.random.default_rng(6)
    lists = _lists(rng, 3)
    kept = [x.copy() for x in lists[0]]
    with pytest.raises(TypeError, match="needs lr="):
        lion.step(*lists)
    with pytest.raises(TypeError, match="no hyperparameter 'momentum'"):
        lion.step(*lists, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="beta1 must be"):
        lion.step(*lists, lr=0.1, beta1=float("nan"))
    with pytest.raises(TypeError, match="takes 3 lists"):
        lion.step(lists[0], lists[1], lr=0.1)
    with pytest.raises(ValueError, match="exp_avgs"):
        lion.step(lists[0], lists[1], lists[2][:-1], lr=0.1)
    for got, want in zip(lists[0], kept):
        np.testing.assert_array_equal(got, want)


RANGED = dict(LION, hyper=dict(lr=(None, ">= 0"), beta1=(0.9, "[0, 1)"), beta2=(0.99, "(0, 1]"),
                               weight_decay=(0.0, "< 1")))


@pytest.mark.parametrize("bad,match", [
    (dict(lr=-1e-3), r"lr must be >= 0, got -0\.001"),
    (dict(lr=float("inf")), "lr must be finite and >= 0, got inf"),
    (dict(beta1=1.0), r"beta1 must be \[0, 1\), got 1\.0"),
    (dict(beta1=-0.5), r"beta1 must be \[0, 1\)"),
    (dict(beta2=0.0), r"beta2 must be \(0, 1\]"),
    (dict(weight_decay=1.0), r"weight_decay must be < 1"),
    (dict(weight_decay=float("nan")), "weight_decay must be < 1, got nan"),
])
def test_declared_ranges_are_checked_before_anything_is_written(bad, match):
    lion = mtapply.rule("lion", **RANGED)
    assert lion.ranges == {"lr": ">= 0", "beta1": "[0, 1)", "beta2": "(0, 1]",
                           "weight_decay": "< 1"}
    lists = _lists(np.random.default_rng(8), 3)
    kept = [[x.copy() for x in column] for column in lists]
    with pytest.raises(ValueError, match=match):
        lion.step(*lists, **dict(dict(lr=0.1), **bad))
    with pytest.raises(ValueError, match=match):  # a plan checks them at every step
        lion.plan(*lists).step(**dict(dict(lr=0.1), **bad))
    for column, was in zip(lists, kept):
        for got, want in zip(column, was):
            np.testing.assert_array_equal(got, want)
    lion.step(*lists, lr=0.0, beta1=0.0, beta2=1.0, weight_decay=-5.0)  # the edges, and below


def test_hyperparameters_without_a_range_take_any_finite_number():
    lion = mtapply.rule("lion", **LION)
    assert lion.ranges == dict.fromkeys(LION["hyper"], "a finite number")
    lists = _lists(np.random.default_rng(9), 3)
    lion.step(*lists, lr=-0.1, beta1=1.5)  # no range declared: any finite number goes
    for value in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="beta2 must be a (finite )?number"):
            lion.step(*lists, lr=0.1, beta2=value)


def test_shipped_rules_declare_ranges_for_every_hyperparameter():
    from mtapply.rules import library

    for make in (library.lion, library.adagrad, library.rmsprop, library.adan,
                 library.adagrad_optax, library.rmsprop_optax, library.schedule_free_adamw,
                 library.adam, library.adamax, library.adadelta, library.adamax_optax,
                 library.adadelta_optax, library.radam, library.nadam, library.ademamix):
        rule = make()
        assert "a finite number" not in rule.ranges.values(), rule.name
        assert rule.ranges["lr"] == ">= 0", rule.name


def test_step_is_required_only_by_rules_that_read_it():
    adagrad = mtapply.rule("adagrad", **ADAGRAD)
    lists = _lists(np.random.default_rng(7), 3, positive=(2,))
    with pytest.raises(TypeError, match="needs step="):
        adagrad.step(*lists)
    mtapply.rule("lion", **LION).step(*lists, lr=0.1)  # no step needed


ARCHS = ("sm_80", "sm_90")


def test_cuda_source_is_readable():
    source = mtapply.rule("lion", **LION).cuda_source()
    assert "// param = param * (1 - lr * weight_decay) - lr * sign(c)" in source
    assert "scalar_arg(a.hp_lr, a.hv_lr)" in source and "N_SLOTS = 3" in source


# names a Python identifier may take that C++ reserves or mtapply's host reads as addresses
AWKWARD = dict(slots="param:rw grad:r auto:rw register:r",
               hyper=dict(lr=None, int=1.5, new=0.5, default=0.25, template=2.0, float=0.75,
                          x=0.5, x_ptr=0.125, y_out=3.0, z_array=0.5, this=1.0, a=2.0),
               sums={"virtual": "grad * grad"},
               finish="namespace = sqrt(virtual) * default",
               update="""
                   const = int * grad + new * template * float + x * x_ptr * y_out * z_array
                   auto = auto * this + const * a + namespace * register
                   param = param - lr * auto
               """)


def _awkward_reference(p, g, auto, register, *, lr, int=1.5, new=0.5, default=0.25,
                       template=2.0, float=0.75, x=0.5, x_ptr=0.125, y_out=3.0, z_array=0.5,
                       this=1.0, a=2.0):
    namespace = np.sqrt(np.sum(np.float32(g) ** 2, dtype=np.float64).astype(np.float32)) * default
    const = int * g + new * template * float + x * x_ptr * y_out * z_array
    auto = auto * this + const * a + namespace * register
    return p - lr * auto, auto


@pytest.mark.parametrize("hyper", [dict(lr=0.1),
                                   dict(lr=0.01, int=-1.0, x_ptr=2.0, y_out=0.5, z_array=4.0),
                                   dict(lr=np.array([0.05], np.float32), default=0.5,
                                        x_ptr=np.array([-0.5], np.float32),
                                        int=np.array([2.0], np.float32))],
                         ids=["defaults", "numbers", "arrays"])
def test_hyperparameters_named_like_cpp_keywords_or_addresses_run_on_the_cpu(hyper):
    rule = mtapply.rule("awkward", **AWKWARD)
    rng = np.random.default_rng(3)
    lists = [[np.float32(rng.standard_normal(n)) for n in (5, 130)] for _ in range(4)]
    expected = [_awkward_reference(*map(np.float64, column),
                                   **{k: float(np.asarray(v).reshape(-1)[0])
                                      for k, v in hyper.items()})
                for column in zip(*lists)]
    rule.step(*lists, **hyper)
    for (p, auto), got_p, got_auto in zip(expected, lists[0], lists[2]):
        np.testing.assert_allclose(got_p, p, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_auto, auto, rtol=1e-5, atol=1e-6)
    # one value per tensor (rows) of a hyperparameter whose name ends in _ptr
    before = [t.copy() for t in lists[0]]
    rule.plan(*lists).step(lr=[0.0, 0.0], x_ptr=[1.0, 2.0], y_out=(1.0, 1.0))
    for old, new in zip(before, lists[0]):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("dtypes", ["float32", "bfloat16", "master"])
def test_hyperparameters_named_like_cpp_keywords_or_addresses_compile(dtypes):
    pytest.importorskip("cuda.bindings")
    rule = mtapply.rule("awkward", **AWKWARD)
    spec = rule.spec(master_weights=dtypes == "master")
    assert {"x_ptr", "y_out", "z_array"} <= set(spec.device_scalars)
    # no number is taken for an address (x_ptr is x's pointer word, not x_ptr's number)
    assert spec.field_of("x") == "x" and spec.field_of("x_ptr") not in ("x_ptr", "x")
    assert not {"y_out", "z_array"} & set(spec.arg_fields) and spec.outputs == ()
    types = {"float32": ("float32",) * 4, "bfloat16": ("bfloat16",) + ("float32",) * 3,
             "master": ("bfloat16", "bfloat16", "float32", "float32", "float32")}[dtypes]
    source = spec.source(types)
    for arch in ARCHS:
        cubin = _source.compile_offline(source, arch)
        assert cubin[:4] == b"\x7fELF" and _source.entry_name(1).encode() in cubin


@pytest.mark.parametrize("definition", [LION, ADAGRAD, EVERYTHING, LARS, LAMB, ROUNDING],
                         ids=["lion", "adagrad", "everything", "lars", "lamb", "rounding"])
@pytest.mark.parametrize("dtypes", ["float32", "bfloat16", "float64", "master"])
def test_generated_kernels_compile(definition, dtypes):
    pytest.importorskip("cuda.bindings")
    rule = mtapply.rule("compiled", **definition)
    spec = rule.spec(master_weights=dtypes == "master")
    n = len(rule.slots)
    types = {"float32": ("float32",) * n, "bfloat16": ("bfloat16",) + ("float32",) * (n - 1),
             "float64": ("float64",) * n,
             "master": ("bfloat16", "bfloat16") + ("float32",) * (n - 1)}[dtypes]
    source = spec.source(types)
    assert "#include" not in source
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        cubins = list(pool.map(lambda arch: _source.compile_offline(source, arch), ARCHS))
    for cubin in cubins:
        assert cubin[:4] == b"\x7fELF"
        for k in range(len(spec.functors)):
            assert _source.entry_name(k).encode() in cubin


def _shipped():
    from mtapply.rules import library

    yield "lion", library.lion()
    yield "adan", library.adan()
    yield "ademamix", library.ademamix()
    for maximize in (False, True):
        yield f"adagrad-max{int(maximize)}", library.adagrad(maximize)
        yield f"adamax-max{int(maximize)}", library.adamax(maximize)
        yield f"adadelta-max{int(maximize)}", library.adadelta(maximize)
        yield f"radam-max{int(maximize)}", library.radam(maximize, maximize)
        yield f"nadam-max{int(maximize)}", library.nadam(maximize, maximize)
        yield f"radam-optax-n{int(maximize)}", library.radam_optax(maximize)
    for centered in (False, True):
        for momentum in (False, True):
            for maximize in (False, True):
                yield (f"rmsprop-c{int(centered)}-m{int(momentum)}-max{int(maximize)}",
                       library.rmsprop(centered, momentum, maximize))
    yield "adagrad-optax", library.adagrad_optax()
    yield "adamax-optax", library.adamax_optax()
    for unscaled in (False, True):
        yield f"adadelta-optax-u{int(unscaled)}", library.adadelta_optax(unscaled)
    yield "schedule-free-adamw", library.schedule_free_adamw()
    yield "adamw", library.adam(True)
    for centered, momentum, nesterov, eps_in_sqrt in [(False, False, False, True),
                                                      (True, True, True, True),
                                                      (False, True, False, False)]:
        yield (f"rmsprop-optax-c{int(centered)}-m{int(momentum)}-n{int(nesterov)}"
               f"-s{int(eps_in_sqrt)}",
               library.rmsprop_optax(centered, momentum, nesterov, eps_in_sqrt))


@pytest.mark.parametrize("name,rule", list(_shipped()), ids=[n for n, _ in _shipped()])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shipped_rules_compile_and_stay_short(name, rule, dtype):
    pytest.importorskip("cuda.bindings")
    assert len(rule.program.lines) < 30
    spec = rule.spec()
    types = (dtype,) * 2 + ("float32",) * (len(rule.slots) - 2)
    source = spec.source(types)
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        for cubin in pool.map(lambda arch: _source.compile_offline(source, arch), ARCHS):
            assert cubin[:4] == b"\x7fELF" and _source.entry_name(0).encode() in cubin


@pytest.mark.parametrize("mode", ["delta", "zero"])
def test_rules_compile_in_the_optax_param_modes(mode):
    """mtapply.optax steps rules that return updates: the new param minus the old ("delta"),
    or the step from zero params ("zero")."""
    pytest.importorskip("cuda.bindings")
    spec = mtapply.rule("lion", **LION).spec().with_param_mode(mode)
    types = ("float32",) * len(spec.slots)
    source = spec.source(types)
    assert f"#define MTA_{'DELTA' if mode == 'delta' else 'ZERO_PARAM'} 1" in source
    assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"


def test_sums_lars_follows_the_reference():
    from mtapply import reference

    rule = mtapply.rule("lars", **LARS)
    assert rule.program.prefix == 0 and len(rule.spec().functors) == 2
    rng = np.random.default_rng(8)
    params, _, buffers = _lists(rng, 3)
    want = [(p.astype(np.float64), b.astype(np.float64)) for p, b in zip(params, buffers)]
    for _ in range(4):
        grads = _lists(rng, 1)[0]
        rule.step(params, grads, buffers, lr=0.5, weight_decay=0.01, trust_coefficient=0.02,
                  eps=1e-6)
        want = [reference.lars(p, g.astype(np.float64), b, lr=0.5, momentum=0.9,
                               weight_decay=0.01, trust_coefficient=0.02, eps=1e-6, adapt=True)
                for (p, b), g in zip(want, grads)]
    for got, (expected, _) in zip(params, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_sums_read_the_values_of_the_lines_before_their_first_use():
    from mtapply import reference

    rule = mtapply.rule("lamb", **LAMB)
    assert rule.program.prefix == 4  # exp_avg, exp_avg_sq and u twice
    rng = np.random.default_rng(9)
    params, _, m, v = _lists(rng, 4, positive=(3,))
    want = [tuple(x.astype(np.float64) for x in t) for t in zip(params, m, v)]
    for step in range(1, 4):
        grads = _lists(rng, 1)[0]
        rule.step(params, grads, m, v, lr=1e-2, step=step)
        want = [reference.lamb(p, g.astype(np.float64), mm, vv, lr=1e-2, step=step,
                               weight_decay=0.01) for (p, mm, vv), g in zip(want, grads)]
    for got, (expected, _, _) in zip(params, want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_first_pass_stores_the_slots_the_update_would_compute_again():
    """LAMB's first pass updates the moments for its sums: it stores them, and the update
    reads them instead of the grad and the old moments (7 reads and 3 writes per element
    rather than 8 and 3), for moments kept in the math type only."""
    spec = mtapply.rule("lamb", **LAMB).spec()
    assert spec.program.stored_first == {"exp_avg", "exp_avg_sq"}
    wide, narrow = ("float32",) * 4, ("float32", "float32", "bfloat16", "bfloat16")
    first, update = spec.functors_for(wide)
    assert first.endswith("StoredSums") and update.endswith("Stored")
    assert spec.functors_for(narrow) == spec.functors  # bfloat16 moments: computed again
    text = spec.functor_text
    stored_sums = text[text.index(f"struct {first[5:]} {{"):]
    stored_update = text[text.index(f"struct {update[5:]} {{"):]
    assert "WRITTEN = (1u << s_exp_avg) | (1u << s_exp_avg_sq);" in stored_sums.split("__device__")[0]
    head = stored_update.split("__device__")[0]
    assert "WRITTEN = (1u << PARAM);" in head
    assert "READ = (1u << PARAM) | (1u << s_exp_avg) | (1u << s_exp_avg_sq);" in head
    if _has_nvrtc():
        for types in (wide, narrow):
            assert _source.compile_offline(spec.source(types), "sm_90")[:4] == b"\x7fELF"


def test_a_first_pass_stores_nothing_where_the_update_needs_an_old_value():
    rule = mtapply.rule("keeps_old", slots="param:rw grad:r m:rw", hyper=dict(lr=None),
                        sums={"s": "m * m"}, update="""
                            old = m
                            m = 0.9 * m + grad
                            param = param - lr * (old + s)
                        """)
    assert rule.program.prefix == 2 and rule.program.stored_first == frozenset()
    assert rule.spec().functors_for(("float32",) * 3) == rule.spec().functors


def test_a_stored_first_pass_keeps_the_prefix_lines_of_scalar_state():
    """A scalar-state value assigned before the first sum is still updated by the update pass
    when the first pass stores the slots."""
    rule = mtapply.rule("early_scalar", slots="param:rw grad:r m:rw", hyper=dict(lr=None),
                        scalars={"count": 0.0}, totals={"s": "m * m"}, update="""
                            count = count + 1
                            m = 0.9 * m + grad
                            param = param - lr * m * s
                        """)
    program = rule.program
    assert program.stored_first == {"m"}
    kept = [program.lines[k].target for k in program.update_prefix_lines(program.stored_first)]
    assert kept == ["count"]


def _has_nvrtc() -> bool:
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("change,error,match", [
    (dict(finish="local_lr = sqrt(p2) * param"), ValueError, r"finish line 1 .*no slots"),
    (dict(finish="x = sqrt(p2)", sums=None), ValueError, "give sums or totals too"),
    (dict(sums={"lr": "param"}), ValueError, r"sums: 'lr' is already"),
    (dict(sums={"p2": "param * param", "q": "p2 * 2"}), ValueError, r"sum 'q' .*not known yet"),
    (dict(sums={"p2": "param > 0"}), TypeError, r"sum 'p2' .*not a comparison"),
    (dict(sums={"p2": "param.real"}), ValueError, r"sum 'p2' .*Attribute"),
])
def test_bad_sums_and_finish_lines(change, error, match):
    definition = {**LARS, "finish": "local_lr = lr", **change}
    if definition["sums"] is None:
        definition["update"] = "momentum_buffer = grad\nparam = param - lr * grad"
    with pytest.raises(error, match=match):
        mtapply.rule("bad", **definition)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), max_size=6), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(["float32", "float64", "float16"]),
       lr=st.floats(1e-4, 1.0), beta1=st.floats(0.0, 0.99), weight_decay=st.floats(0.0, 0.5))
def test_lion_over_drawn_lists_follows_its_definition(sizes, seed, dtype, lr, beta1,
                                                      weight_decay):
    """Any list lengths, tensor sizes (0 included) and storage dtypes: each element as the
    definition computes it in the math type, rounded once to storage."""
    rng = np.random.default_rng(seed)
    lion = mtapply.rule("lion", **LION)
    params, grads, moments = ([rng.standard_normal(n).astype(dtype) for n in sizes]
                              for _ in range(3))
    math = np.float64 if dtype == "float64" else np.float32
    want = []
    for p, g, m in zip(params, grads, moments):
        p, g, m = (x.astype(math) for x in (p, g, m))
        c = math(beta1) * m + math(1 - beta1) * g
        want.append(((p * math(1 - lr * weight_decay) - math(lr) * np.sign(c)).astype(dtype),
                     (math(0.99) * m + math(1 - 0.99) * g).astype(dtype)))
    lion.step(params, grads, moments, lr=lr, beta1=beta1, weight_decay=weight_decay)
    for got_p, got_m, (want_p, want_m) in zip(params, moments, want):
        np.testing.assert_array_equal(got_p, want_p)
        np.testing.assert_array_equal(got_m, want_m)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_adam_as_a_rule_follows_the_built_in_op(decoupled, maximize):
    """The built-in Adam written as a rule (to compare the generated kernel with the
    hand-written one) takes the same steps as `mtapply.adam_step`."""
    from mtapply.rules import library

    rule = library.adam(decoupled, maximize)
    rng = np.random.default_rng(10)
    ours = _lists(rng, 4, positive=(3,))
    theirs = [[x.copy() for x in column] for column in ours]
    hyper = dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)
    for step in range(1, 6):
        grads = _lists(rng, 1)[0]
        rule.step(ours[0], grads, ours[2], ours[3], step=step, **hyper)
        mtapply.adam_step(theirs[0], grads, theirs[2], theirs[3], step=step, maximize=maximize,
                          decoupled_weight_decay=decoupled, **hyper)
    for got, want in zip(ours[0] + ours[2] + ours[3], theirs[0] + theirs[2] + theirs[3]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_declared_bound_beyond_a_double_is_refused():
    """The kernels check declared ranges in double: a bound that overflows one is refused when
    the rule is made (the CPU alone would take it)."""
    with pytest.raises(ValueError, match="beyond the range of a double"):
        mtapply.rule("big", slots="param:rw grad:r", hyper={"lr": (None, ">= 1e400")},
                     update="param = param - lr * grad")
    rule = mtapply.rule("fine", slots="param:rw grad:r", hyper={"lr": (None, "[0, 1e300)")},
                        update="param = param - lr * grad")
    assert rule.ranges == {"lr": "[0, 1e300)"}
