"""The update of a rule in delta mode (mtapply.optax's transformations that read the params):
the step itself where the rule's param line is `param - x` or `param + x`, not new - old,
which loses the step's digits below the param's last one."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mtapply import rule
from mtapply.rules import library
from mtapply.rules._step_update import step_program

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def test_a_param_line_of_param_minus_x_gives_the_step():
    program = step_program(library.adafactor_optax().program)
    line = next(line for line in program.lines if line.target == "param")
    assert line.text == "param = -(u + weight_decay * param)"
    assert step_program(library.lars().program) is not None


@pytest.mark.parametrize("made", [
    lambda: library.adafactor(),  # param * (1 - lr * weight_decay) - scale * u
    lambda: rule("later", slots="param:rw grad:r m:rw", hyper=dict(lr=(1e-3, ">= 0")),
                 update="param = param - lr * grad\nm = param"),
    lambda: rule("twice", slots="param:rw grad:r", hyper=dict(lr=(1e-3, ">= 0")),
                 update="param = param - lr * grad\nparam = param * 0.5"),
], ids=["decay-times-param", "read-after", "assigned-twice"])
def test_other_param_lines_keep_new_minus_old(made):
    assert step_program(made().program) is None


def test_the_delta_spec_writes_the_step_and_compiles():
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    for made in (library.adam, library.adafactor_optax):
        spec = made().spec().with_param_mode("delta")
        assert spec.delta_is_step and spec.slots[-1] == "updates"
        source = spec.source(("float32",) * len(spec.slots))
        assert "#define MTA_DELTA_STEP 1" in source and "#define MTA_DELTA 1" in source
        assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"
    assert not library.adafactor().spec().with_param_mode("delta").delta_is_step


def test_optax_updates_keep_a_step_below_the_params_last_digit():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import mtapply.optax as mtx

    params = {"w": jnp.full((4,), 1000.0, jnp.float32)}  # an ulp of 6.1e-5
    grads = {"w": jnp.array([1.0, -2.0, 3.0, -4.0])}
    options = dict(multiply_by_parameter_scale=False, clipping_threshold=None)
    results = []
    for made in (optax.adafactor, mtx.adafactor):
        tx = optax.chain(made(1e-5, **options), optax.scale(10.0))
        state, p, updates = tx.init(params), params, []
        for _ in range(3):
            u, state = jax.jit(tx.update)(grads, state, p)
            p = optax.apply_updates(p, u)
            updates.append(np.asarray(u["w"]))
        results.append((np.stack(updates), np.asarray(p["w"])))
    (theirs, their_params), (ours, our_params) = results
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert np.abs(ours).min() > 5e-5  # a step of 1e-4, not the 0 that new - old gives
    np.testing.assert_array_equal(our_params, their_params)
