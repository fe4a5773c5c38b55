"""Factored slots in the rule language (`NAME:rw@row`, `@col`, `@unfactored`, row_mean,
col_mean, `A if factored else B`, numel): the NumPy path against a float64 reference written
here, over 1-D, 2-D, 3-D and small shapes; the checks of the declarations and lines; the state
shapes; the CUDA source."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mtapply

# a factored second moment of g^2 (Adafactor's, without its step size), for any shape
FACTORED = dict(
    slots="param:rw grad:r rv:rw@row cv:rw@col v:rw@unfactored",
    hyper=dict(lr=(None, ">= 0"), beta=(0.9, "[0, 1)")),
    sums={"u2": "u * u"},
    update="""
        g2 = grad * grad + 1e-3
        rv = beta * rv + (1 - beta) * row_mean(g2)
        cv = beta * cv + (1 - beta) * col_mean(g2)
        v = beta * v + (1 - beta) * g2
        e = rv * cv / col_mean(rv) if factored else v
        u = grad / sqrt(e)
        param = param - lr * u / max(1, sqrt(u2 / numel))
    """)


def _reference(p, rv, cv, v, g, lr, beta=0.9):
    """The rule in float64 for one param (factored where rv has elements)."""
    g2 = g * g + 1e-3
    if rv.size:
        shape = p.shape
        rv = beta * rv + (1 - beta) * g2.mean(axis=-1, keepdims=True)
        cv = beta * cv + (1 - beta) * g2.mean(axis=-2, keepdims=True)
        e = rv * cv / rv.mean(axis=-2, keepdims=True)
        assert e.shape == shape
    else:
        v = beta * v + (1 - beta) * g2
        e = v
    u = g / np.sqrt(e)
    return p - lr * u / max(1.0, np.sqrt(np.mean(u * u))), rv, cv, v


def _state(rule, params, min_dim_size=1):
    shapes = [rule.state_shapes(p.shape, min_dim_size) for p in params]
    return [[np.zeros(s[name]) for s in shapes] for name in ("rv", "cv", "v")]


def test_state_shapes_follow_the_param():
    rule = mtapply.rule("f", **FACTORED)
    assert rule.state_shapes((4, 6)) == {"rv": (4, 1), "cv": (1, 6), "v": (0,)}
    assert rule.state_shapes((2, 3, 5)) == {"rv": (2, 3, 1), "cv": (2, 1, 5), "v": (0,)}
    assert rule.state_shapes((7,)) == {"rv": (0,), "cv": (0,), "v": (7,)}
    assert rule.state_shapes(()) == {"rv": (0,), "cv": (0,), "v": ()}
    # below the size that factors (optax's min_dim_size_to_factor): a full slot
    assert rule.state_shapes((4, 200), min_dim_size=128) == {"rv": (0,), "cv": (0,),
                                                             "v": (4, 200)}
    assert "rv:rw@row" in repr(rule) and "v:rw@unfactored" in repr(rule)


_SHAPES = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


@given(shapes=st.lists(_SHAPES, min_size=1, max_size=5), min_dim_size=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_steps_match_the_reference(shapes, min_dim_size, seed):
    rule = mtapply.rule("f", **FACTORED)
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in shapes]
    rv, cv, v = _state(rule, params, min_dim_size)
    expected = [(p.copy(), a.copy(), b.copy(), c.copy()) for p, a, b, c in zip(params, rv, cv, v)]
    for _ in range(3):
        grads = [rng.standard_normal(s) for s in shapes]
        rule.step(params, grads, rv, cv, v, lr=0.1)
        expected = [_reference(*e, g, 0.1) for e, g in zip(expected, grads)]
        for i, (p, a, b, c) in enumerate(expected):
            np.testing.assert_allclose(params[i], p, rtol=1e-12, atol=1e-12)
            for got, want in ((rv[i], a), (cv[i], b), (v[i], c)):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_float32_and_a_transposed_param_match():
    rule = mtapply.rule("f", **FACTORED)
    rng = np.random.default_rng(1)
    base = rng.standard_normal((6, 4)).astype(np.float32)
    params = [base.T, rng.standard_normal((3, 5)).astype(np.float32)]  # the first not row-major
    assert not params[0].flags.c_contiguous
    rv, cv, v = ([x.astype(np.float32) for x in column] for column in _state(rule, params))
    grads = [rng.standard_normal((6, 4)).astype(np.float32).T,  # laid out as its param
             rng.standard_normal((3, 5)).astype(np.float32)]
    expected = [_reference(p.astype(np.float64), a, b, c, g.astype(np.float64), 0.1)
                for p, g, a, b, c in zip(params, grads, rv, cv, v)]
    rule.step(params, grads, rv, cv, v, lr=0.1)
    for got, (want, a, b, _) in zip(params, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv[0], expected[0][1], rtol=1e-5)


def test_state_of_the_wrong_shape_is_refused_before_anything_changes():
    rule = mtapply.rule("f", **FACTORED)
    params = [np.ones((3, 4)), np.ones((2, 5))]
    rv, cv, v = _state(rule, params)
    rv[1] = np.zeros((5, 1))
    before = [p.copy() for p in params]
    with pytest.raises(ValueError, match=r"params\[1\] has shape \(2, 5\).*rvs\[1\] \(5, 1\)"):
        rule.step(params, [np.ones((3, 4)), np.ones((2, 5))], rv, cv, v, lr=0.1)
    assert all(np.array_equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("slots,update,match", [
    ("param:rw grad:r r:rw@rows", "r = grad", r"@row, @col or @unfactored"),
    ("param:rw@row grad:r", "param = grad", r"only state slots"),
    ("param:rw grad:r r:rw@row=param", "r = row_mean(grad)", r"starts at a number"),
    ("param:rw grad:r r:rw@row", "r = grad", r"varies along the columns: take its row_mean"),
    ("param:rw grad:r c:rw@col", "c = row_mean(grad)", r"varies along the rows: take its col_mean"),
    ("param:rw grad:r r:rw@row", "r = row_mean(grad)\nparam = param - r",
     r"kept for every param.*factored params only"),
    ("param:rw grad:r r:rw@row v:rw@unfactored", "r = row_mean(grad)\nv = grad\nx = r + v",
     r"mixes values of factored params"),
    ("param:rw grad:r v:rw@unfactored", "v = row_mean(grad)", r"factored params only"),
    ("param:rw grad:r", "param = grad if factored else row_mean(grad)",
     r"A is for factored params and B for unfactored"),
    ("param:rw grad:r", "param = grad if grad else grad", r"IfExp .* `A if factored else B`"),
    ("param:rw grad:r", "param = factored", r"only the test"),
    ("param:rw grad:r", "param = row_mean(2)", r"the same for every element"),
    ("param:rw grad:r", "numel = 2\nparam = grad", r"reserved"),
])
def test_bad_factored_rules_are_refused(slots, update, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mtapply.rule("bad", slots=slots, hyper={}, update=update)


def test_a_sum_of_a_factored_value_is_refused():
    with pytest.raises(ValueError, match=r"sum 'r2'.*factored params only"):
        mtapply.rule("bad", slots="param:rw grad:r r:rw@row", hyper={}, sums={"r2": "r * r"},
                     update="r = row_mean(grad)\nparam = param - r2 * grad")


def test_factored_slots_are_not_kept_in_eight_bits():
    rule = mtapply.rule("f", **FACTORED)
    with pytest.raises(ValueError, match=r"'rv' is a factored slot"):
        rule.with_state_bits(8)


def test_the_cuda_source_reduces_rows_and_columns_before_the_walker():
    source = mtapply.rule("f", **FACTORED).cuda_source()
    for piece in ("Factors", "factor_walk", "Combine", "combine_walk", "finish_row", "finish_col",
                  "Matrix", "matrix_walk", "INDEXED = true", "if constexpr (FACTORED) {",
                  "} else {", "if (factored) element<true>"):
        assert piece in source, piece
    assert "// col_mean(rv)" in source  # the per-matrix mean, read from the workspace


def test_a_factored_rule_the_gpu_passes_cannot_run_is_refused_naming_the_line():
    mean_in_a_temporary = dict(FACTORED, update=FACTORED["update"].replace(
        "rv = beta * rv + (1 - beta) * row_mean(g2)",
        "r = row_mean(g2)\n        rv = beta * rv + (1 - beta) * r"))
    with pytest.raises(NotImplementedError, match=r"rule 'f' runs on the CPU only: line 3 "
                       r"\('r = row_mean\(g2\)'\).*in the lines of @row slots.*CPU"):
        mtapply.rule("f", **mean_in_a_temporary).cuda_source()
    numel_only = mtapply.rule("n", slots="param:rw grad:r", hyper={},
                              update="param = param - grad / numel")
    with pytest.raises(NotImplementedError, match=r"it reads numel"):
        numel_only.cuda_source()
    # rules without them keep their kernels
    assert "struct" in mtapply.rule("plain", slots="param:rw grad:r", hyper={},
                                    update="param = param - grad").cuda_source()
