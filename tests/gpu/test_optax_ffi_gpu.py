"""mtapply.optax on the GPU through the XLA FFI handler: one `mtapply_step` custom call in the
compiled step and no Python at run time; results equal to the buffer-callback path (the same
kernels, so bit for bit) and to optax over many steps, donated or not."""
import os
import re

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply import _xla, reference  # noqa: E402

STEPS = 60
SHAPES = [(1000, 7), (3,), (0,), (4097,), (65, 65), (1,), (278011,)]

RULES = {
    "adam": lambda fused: (mtx.fused_adam if fused else mtx.adam)(1e-3),
    "adamw": lambda fused: (mtx.fused_adamw if fused else mtx.adamw)(1e-3, weight_decay=0.1),
    "sgd": lambda fused: (mtx.fused_sgd if fused else mtx.sgd)(1e-2, momentum=0.9, nesterov=True),
    "lars": lambda fused: (mtx.fused_lars if fused else mtx.lars)(0.5, trust_coefficient=0.02,
                                                                  weight_decay=1e-4),
    "lamb": lambda fused: (mtx.fused_lamb if fused else mtx.lamb)(1e-2, weight_decay=0.01,
                                                                  max_grad_norm=1.0),
}


@pytest.fixture(scope="module")
def gpu():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    assert _xla.available(), "the FFI handler must build and register where a GPU is"
    return gpus[0]


def _tree(rng, device, dtype=jnp.float32):
    return {f"p{i}": jax.device_put(jnp.asarray(rng.standard_normal(s), dtype), device)
            for i, s in enumerate(SHAPES)}


def _run(opt, fused, params, grads_seq, donate):
    if fused:
        def step(p, s, g):
            return opt.step(p, g, s)
    else:
        def step(p, s, g):
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s
    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    p, s = jax.tree.map(jnp.copy, params), opt.init(params)
    for g in grads_seq:
        p, s = jitted(p, s, g)
    return p, (opt.tree_state(s, p) if fused else s), jitted.lower(p, s, grads_seq[0])


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformation"])
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "kept"])
def test_ffi_step_equals_the_callback_step(gpu, rule, fused, donate, monkeypatch):
    rng = np.random.default_rng(1)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS // 4)]
    kept = jax.tree.map(np.asarray, params)
    got_p, got_s, lowered = _run(RULES[rule](fused), fused, params, grads_seq, donate)
    targets = re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text())
    assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    want_p, want_s, _ = _run(RULES[rule](fused), fused, params, grads_seq, donate)
    for got, want in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for held, before in zip(jax.tree.leaves(params), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(np.asarray(held), before)  # the caller's arrays


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "kept"])
def test_fused_adamw_follows_optax_over_many_steps(gpu, donate):
    rng = np.random.default_rng(2)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS)]
    mine, state, _ = _run(mtx.fused_adamw(1e-3, weight_decay=0.1), True, params, grads_seq,
                          donate)
    theirs, their_state, _ = _run(optax.adamw(1e-3, weight_decay=0.1), False, params,
                                  grads_seq, donate)
    for got, want in zip(jax.tree.leaves((mine, state.mu)),
                         jax.tree.leaves((theirs, their_state[0].mu))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(np.abs(want).max(initial=0), 1e-3))


def test_bfloat16_and_mixed_dtype_trees(gpu):
    rng = np.random.default_rng(3)
    params = {"b": _tree(rng, gpu, jnp.bfloat16), "f": _tree(rng, gpu)}
    grads = {"b": _tree(rng, gpu, jnp.bfloat16), "f": _tree(rng, gpu)}
    opt = mtx.fused_adam(1e-2)
    new, state = jax.jit(opt.step)(params, grads, opt.init(params))
    assert set(state.mu) == {"bfloat16", "float32"}
    for group, tol in (("b", 1.6e-2), ("f", 1.3e-6)):
        for key in params[group]:
            p = np.asarray(params[group][key], np.float64)
            g = np.asarray(grads[group][key], np.float64)
            want = reference.adam(p, g, 0.0 * p, 0.0 * p, lr=1e-2, step=1)[0]
            np.testing.assert_allclose(np.asarray(new[group][key], np.float64), want, rtol=tol,
                                       atol=1e-5)


def test_a_thousand_leaves_compile_and_step(gpu):
    rng = np.random.default_rng(4)
    params = [jax.device_put(jnp.asarray(rng.standard_normal(100), jnp.float32), gpu)
              for _ in range(1000)]
    opt = mtx.fused_sgd(0.1, momentum=0.9)
    state = opt.init(params)
    new, state = opt.donated_step([jnp.copy(p) for p in params], params, state)
    for got, p in zip(new, params):
        np.testing.assert_allclose(np.asarray(got), np.asarray(p) * 0.9, rtol=1e-6)
