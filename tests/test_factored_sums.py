"""The product form of a factored rule's sums (mtapply.rules._factored_sums): per matrix,
M sum_j C_j sum_i E_ij R_i over the new row and column state equals the sum the NumPy backend
takes over the elements, where the form's checks hold; and they fail where a clamp bites."""
import ast

import numpy as np
import pytest

from mtapply import rules
from mtapply.rules import library
from mtapply.rules._factored import canonical_shape
from mtapply.rules._factored_sums import ELEMENT, MATRIX, ROWS, COLS, product_sums
from mtapply.rules._numpy import evaluate, tensor_sums

RULES = {
    "torch": (library.adafactor(), dict(lr=0.01, beta2_decay=-0.8, eps1=1e-30, eps2=1e-3,
                                        d=1.0, weight_decay=0.01)),
    "torch-maximize": (library.adafactor(True), dict(lr=0.01, beta2_decay=-0.8, eps1=1e-30,
                                                     eps2=1e-3, d=1.0, weight_decay=0.0)),
    "optax": (library.adafactor_optax(), dict(lr=0.01, decay=0.8, eps=1e-30,
                                              clipping_threshold=1.0, weight_decay=0.0)),
    "optax-momentum": (library.adafactor_optax(True, False, True),
                       dict(lr=0.01, decay=0.8, eps=1e-30, clipping_threshold=1.0,
                            weight_decay=0.0, momentum=0.9)),
}


def _arrays(program, shape, rng, grad_scale=1.0):
    arrays = {}
    for s in program.slots:
        form_shape = canonical_shape(s.form, shape) if s.form != "unfactored" else (0,)
        values = rng.uniform(0.5, 2.0, form_shape) if s.form in ("row", "col") else \
            rng.standard_normal(form_shape)
        arrays[s.name] = values * (grad_scale if s.name == "grad" else 1.0)
    return arrays


def _value(text, env):
    functions = {"sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "where": np.where,
                 "max": np.fmax, "min": np.fmin,
                 "col_mean": lambda x: x.mean(axis=-2, keepdims=True),
                 "row_mean": lambda x: x.mean(axis=-1, keepdims=True)}
    return eval(compile(ast.Expression(ast.parse(text, mode="eval").body), "<part>", "eval"),
                {"__builtins__": {}}, {**functions, **env})


def _form_and_checks(program, found, arrays, new, scalars):
    """Each sum by its product form (summed over the matrices), and whether every check
    holds in every matrix."""
    env = {**scalars, **arrays,
           **{s.name: new[s.name] for s in program.slots if s.form in ("row", "col")}}
    totals, holds = [], True
    for total in found.sums:
        parts = {v: np.asarray(_value(total.part(v), env), np.float64)
                 for v in (ELEMENT, ROWS, COLS, MATRIX)}
        by_column = (parts[ELEMENT] * parts[ROWS]).sum(axis=-2, keepdims=True)
        per_matrix = (by_column * parts[COLS]).sum(axis=(-2, -1)) * parts[MATRIX].reshape(-1)
        totals.append(per_matrix.sum())
        for f in total.positive:
            value = np.asarray(_value(ast.unparse(f.expr), env), np.float64)
            holds &= bool(np.all((value > 0) & np.isfinite(value)))
        for clamp in total.clamps:
            least = 1.0
            for f in clamp.factors:
                value = np.asarray(_value(f.text(), env), np.float64)
                axes = {ROWS: -2, COLS: -1}.get(f.varies)
                least = least * (value.min(axis=axes, keepdims=True) if axes else value)
            holds &= bool(np.all(least >= _value(ast.unparse(clamp.bound), env)))
    return totals, holds


@pytest.mark.parametrize("which", sorted(RULES))
@pytest.mark.parametrize("shape", [(9, 16), (3, 5, 12), (1, 1)])
def test_product_form_is_the_sum(which, shape):
    rule, hyper = RULES[which]
    program = rule.program
    found = product_sums(program)
    assert found.why_not == "" and len(found.sums) == len(program.sums)
    rng = np.random.default_rng(len(shape) + sum(shape))
    arrays = _arrays(program, shape, rng)
    scalars = {**hyper, "step": 3.0}
    direct = tensor_sums(program, arrays, scalars, np.float64, factored=True,
                         sum_dtype="float64")
    new = evaluate(program, arrays, scalars, np.float64, factored=True, sum_dtype="float64")
    totals, holds = _form_and_checks(program, found, arrays, new, scalars)
    assert holds
    np.testing.assert_allclose(totals, direct, rtol=1e-12)


def test_a_clamp_that_bites_fails_the_check():
    """torch's v >= eps1^2: with grads and state far below eps1^2 the clamp is active and the
    product form is not the sum; its check says so."""
    rule, hyper = RULES["torch"]
    program = rule.program
    rng = np.random.default_rng(0)
    arrays = _arrays(program, (6, 8), rng)
    arrays["grad"] *= 1e-6
    arrays["row_var"] *= 1e-12
    arrays["col_var"] *= 1e-12
    scalars = {**hyper, "eps1": 1e-3, "step": 2.0}
    new = evaluate(program, arrays, scalars, np.float64, factored=True, sum_dtype="float64")
    direct = tensor_sums(program, arrays, scalars, np.float64, factored=True,
                         sum_dtype="float64")
    totals, holds = _form_and_checks(program, product_sums(program), arrays, new, scalars)
    assert not holds
    assert not np.allclose(totals, direct, rtol=1e-6)


def test_a_zero_row_fails_the_check():
    """A row of zero state (all its grads zero, from zero state) is not positive: optax's
    split of rsqrt(row / mean) needs it."""
    rule, hyper = RULES["optax"]
    program = rule.program
    rng = np.random.default_rng(1)
    arrays = _arrays(program, (4, 8), rng)
    arrays["grad"][0, 2, :] = 0.0
    arrays["row_var"][0, 2, 0] = 0.0
    scalars = {**hyper, "eps": 0.0, "step": 1.0}
    new = evaluate(program, arrays, scalars, np.float64, factored=True, sum_dtype="float64")
    with np.errstate(all="ignore"):
        _, holds = _form_and_checks(program, product_sums(program), arrays, new, scalars)
    assert not holds


@pytest.mark.parametrize("sums, why", [
    ({"s": "(grad * grad + row_var) if factored else grad"}, "is not a product"),
    ({"s": "row_var * row_var if factored else grad"}, "no element value"),
    ({"s": "grad * rsqrt(grad * row_var) if factored else grad"},
     "element value is not checked positive"),
])
def test_sums_without_a_product_form_say_why(sums, why):
    rule = rules.rule("probe", slots="param:rw grad:r row_var:rw@row", hyper=dict(lr=0.1),
                      sums=sums, update="""
                          row_var = row_mean(grad * grad)
                          param = param - lr * s * grad
                      """)
    found = product_sums(rule.program)
    assert found.sums == ()
    assert "sum 's'" in found.why_not and why in found.why_not

