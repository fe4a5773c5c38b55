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

RULES = {  # name -> its arguments here
    "adam": dict(learning_rate=1e-3),
    "adamw": dict(learning_rate=1e-3, weight_decay=0.1),
    "sgd": dict(learning_rate=1e-2, momentum=0.9, nesterov=True),
    "lars": dict(learning_rate=0.5, trust_coefficient=0.02, weight_decay=1e-4),
    "lamb": dict(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0),
}
FORMS = ["fused", "transformation", "tree-state"]  # tree-state: a transformation, flat_state=False


def _make(rule, form, **overrides):
    hyper = {**RULES[rule], **overrides}
    if form == "fused":
        return getattr(mtx, f"fused_{rule}")(**hyper)
    return getattr(mtx, rule)(**hyper, flat_state=form != "tree-state")


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


def _run(opt, form, params, grads_seq, donate):
    """(params, state in optax's layout, the lowered step) after jitted steps."""
    if form == "fused":
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
    lowered = jitted.lower(p, s, grads_seq[0])
    return p, (s if form == "tree-state" else mtx.tree_state(s, params)), lowered


def _custom_calls(lowered) -> list:
    return re.findall(r'custom_call_target="([^"]+)"', lowered.compile().as_text())


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "kept"])
def test_ffi_step_equals_the_callback_step(gpu, rule, form, donate, monkeypatch):
    rng = np.random.default_rng(1)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS // 4)]
    kept = jax.tree.map(np.asarray, params)
    got_p, got_s, lowered = _run(_make(rule, form), form, params, grads_seq, donate)
    targets = _custom_calls(lowered)
    assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    want_p, want_s, _ = _run(_make(rule, form), form, params, grads_seq, donate)
    for got, want in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for held, before in zip(jax.tree.leaves(params), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(np.asarray(held), before)  # the caller's arrays


OPTAX_TWINS = {  # rule -> (overrides of RULES, optax's equal transformation, our state slot,
    #                  the same slot in optax's state)
    "adam": ({}, optax.adam(1e-3), "mu", lambda s: s[0].mu),
    "adamw": ({}, optax.adamw(1e-3, weight_decay=0.1), "nu", lambda s: s[0].nu),
    "sgd": ({}, optax.sgd(1e-2, momentum=0.9, nesterov=True), "trace", lambda s: s[0].trace),
    "lars": ({"weight_decay": 0.0}, optax.lars(0.5, trust_coefficient=0.02), "momentum",
             lambda s: jax.tree.map(lambda x: -x, s[-1].trace)),
    "lamb": ({"max_grad_norm": 0.0}, optax.lamb(1e-2, weight_decay=0.01), "mu",
             lambda s: s[0].mu),
}


@pytest.mark.parametrize("rule", list(OPTAX_TWINS))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "kept"])
def test_follows_optax_over_many_steps(gpu, rule, form, donate):
    """Params and a state slot after 60 jitted steps, against optax's transformation where the
    semantics agree (LARS without weight decay, LAMB without grad-norm clipping)."""
    overrides, twin, field, slot = OPTAX_TWINS[rule]
    rng = np.random.default_rng(2)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS)]
    mine, state, _ = _run(_make(rule, form, **overrides), form, params, grads_seq, donate)
    theirs, their_state, _ = _run(twin, "optax", params, grads_seq, donate)
    for got, want in zip(jax.tree.leaves((mine, getattr(state, field))),
                         jax.tree.leaves((theirs, slot(their_state)))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("form", FORMS)
def test_adamw_weight_decay_mask_follows_optax_in_one_call(gpu, form):
    """optax.adamw's mask (decay on matrices only): one mtapply_step for the whole tree, the
    kernel reading each tensor's flag, and the steps of optax.adamw with the same mask."""
    def matrices(params):
        return jax.tree.map(lambda x: x.ndim > 1, params)

    rng = np.random.default_rng(4)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS)]
    mine, state, lowered = _run(_make("adamw", form, mask=matrices), form, params, grads_seq,
                                True)
    theirs, their_state, _ = _run(optax.adamw(1e-3, weight_decay=0.1, mask=matrices), "optax",
                                  params, grads_seq, True)
    assert _custom_calls(lowered).count("mtapply_step") == 1
    for got, want in zip(jax.tree.leaves((mine, state.nu)),
                         jax.tree.leaves((theirs, their_state[0].nu))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("form", FORMS)
def test_multi_transform_of_adamws_follows_optax_in_one_call(gpu, form, monkeypatch):
    """mtapply.optax.multi_transform of three labels' adamws (a constant lr, a schedule, a
    masked weight decay): one mtapply_step for the whole tree, each tensor reading its label's
    lr from the step's array of them; against optax.multi_transform of optax.adamw's, and bit
    for bit the buffer callback's steps."""
    schedule = optax.linear_schedule(3e-3, 1e-4, STEPS)

    def matrices(params):
        return jax.tree.map(lambda x: x.ndim > 1, params)

    def transforms(adamw, **options):
        return {"body": adamw(1e-3, weight_decay=0.1, **options),
                "head": adamw(schedule, weight_decay=0.0, **options),
                "rest": adamw(2e-3, weight_decay=0.05, mask=matrices, **options)}

    def ours():
        if form == "fused":
            return mtx.fused_multi_transform(transforms(mtx.fused_adamw), labels)
        return mtx.multi_transform(transforms(mtx.adamw, flat_state=form != "tree-state"),
                                   labels)

    labels = {f"p{i}": ("body", "head", "rest")[i % 3] for i in range(len(SHAPES))}
    rng = np.random.default_rng(5)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(STEPS)]
    mine, state, lowered = _run(ours(), form, params, grads_seq, True)
    theirs, their_state, _ = _run(optax.multi_transform(transforms(optax.adamw), labels),
                                  "tree-state", params, grads_seq, True)
    assert _custom_calls(lowered).count("mtapply_step") == 1
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    again, _, _ = _run(ours(), form, params, grads_seq, True)
    for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    nu = state.nu  # _run gives the flat forms' states as trees
    their_nu = {k: v for label in ("body", "head", "rest")
                for k, v in their_state.inner_states[label].inner_state[0].nu.items()
                if labels[k] == label}
    for got, want in zip(jax.tree.leaves((mine, nu)), jax.tree.leaves((theirs, their_nu))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("form", FORMS)
def test_bfloat16_and_mixed_dtype_trees(gpu, form):
    rng = np.random.default_rng(3)
    params = {"b": _tree(rng, gpu, jnp.bfloat16), "f": _tree(rng, gpu)}
    grads = {"b": _tree(rng, gpu, jnp.bfloat16), "f": _tree(rng, gpu)}
    opt = _make("adam", form, learning_rate=1e-2)
    state = opt.init(params)
    if form == "fused":
        new, state = jax.jit(opt.step)(params, grads, state)
    else:
        updates, state = jax.jit(opt.update)(grads, state, params)
        new = optax.apply_updates(params, updates)
    if form != "tree-state":
        assert set(state.mu) == {"bfloat16", "float32"}
    for group, tol in (("b", 1.6e-2), ("f", 1.3e-6)):
        for key in params[group]:
            p = np.asarray(params[group][key], np.float64)
            g = np.asarray(grads[group][key], np.float64)
            want = reference.adam(p, g, 0.0 * p, 0.0 * p, lr=1e-2, step=1)[0]
            np.testing.assert_allclose(np.asarray(new[group][key], np.float64), want, rtol=tol,
                                       atol=1e-5)


@pytest.mark.parametrize("form", ["fused", "transformation"])
def test_thousands_of_leaves_step_a_thousand_per_call(gpu, form):
    """2,500 leaves: several custom calls (XLA's compile time grows with the square of one
    call's operands), the flat state passing through them; every leaf stepped once."""
    rng = np.random.default_rng(4)
    params = [jax.device_put(jnp.asarray(rng.standard_normal(100), jnp.float32), gpu)
              for _ in range(2500)]
    opt = _make("sgd", form, learning_rate=0.1, nesterov=False)
    grads = [p * 0.5 for p in params]
    new, state, lowered = _run(opt, form, params, [grads, grads], donate=True)
    assert _custom_calls(lowered).count("mtapply_step") >= 2
    for got, p in zip(new, params):  # trace g, then 1.9 g: p - 0.1 * 2.9 * 0.5 p
        np.testing.assert_allclose(np.asarray(got), np.asarray(p) * 0.855, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.trace[-1]), np.asarray(grads[-1]) * 1.9,
                               rtol=1e-6)


INJECTED = {  # name -> (ours, optax's, keyword arguments of both)
    "adamw": (mtx.adamw, optax.adamw, dict(weight_decay=0.1, eps_root=1e-8)),
    "sgd": (mtx.sgd, optax.sgd, dict(momentum=0.9, nesterov=True)),
    "lars": (mtx.lars, optax.lars, dict(trust_coefficient=0.02)),
    "lamb": (mtx.lamb, optax.lamb, dict(weight_decay=0.01)),
    "lion": (mtx.lion, optax.lion, dict(weight_decay=0.01)),
}


@pytest.mark.parametrize("flat", [True, False], ids=["flat-state", "tree-state"])
@pytest.mark.parametrize("name", list(INJECTED))
def test_inject_hyperparams_reach_the_kernel_as_device_values(gpu, name, flat):
    """optax.inject_hyperparams passes every number as a traced array: one mtapply_step (the
    op's rule, reading them from device memory) follows optax's steps, with b1 (or momentum)
    changed in the state between steps and no retrace."""
    ours, theirs, kwargs = INJECTED[name]
    lr = 0.5 if name == "lars" else 1e-2
    rng = np.random.default_rng(6)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(12)]
    changed = "momentum" if name in ("sgd", "lars") else "b1"
    results, traces = [], []
    for factory in (ours, theirs):
        tx = optax.inject_hyperparams(factory)(learning_rate=lr, **kwargs,
                                               **({"flat_state": flat} if factory is ours else {}))

        @jax.jit
        def step(p, s, g):
            traces.append(factory)
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        p, s = params, tx.init(params)
        for t, g in enumerate(grads_seq):
            hyper = dict(s.hyperparams, **{changed: jnp.asarray(0.9 - 0.02 * t)})
            p, s = step(p, s._replace(hyperparams=hyper), g)
        results.append(p)
        if factory is ours:
            assert traces.count(ours) == 1
            lowered = step.lower(p, s, grads_seq[0])
    assert _custom_calls(lowered).count("mtapply_step") >= 1
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


def test_eager_injected_steps_register_one_plan(gpu):
    """A transformation made anew at each eager step (inject_hyperparams) reuses its FFI plan:
    no GPU memory is taken per step."""
    rng = np.random.default_rng(7)
    params = _tree(rng, gpu)
    tx = optax.inject_hyperparams(mtx.adam)(learning_rate=1e-2)
    state = tx.init(params)
    updates, state = tx.update(params, state, params)
    plans = len(_xla._plans)
    for _ in range(3):
        updates, state = tx.update(params, state, params)
    jax.block_until_ready(updates)
    assert len(_xla._plans) == plans


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("form", FORMS)
def test_mu_dtype_keeps_the_moment_in_its_dtype(gpu, form, dtype, monkeypatch):
    """mu in bfloat16 or float16 (math in float32, as every step): the FFI path equals the
    buffer callback's bit for bit, and follows optax within the dtype's rounding (optax
    computes b1 * mu in mu's dtype, mtapply in float32)."""
    rng = np.random.default_rng(8)
    params = _tree(rng, gpu)
    grads_seq = [_tree(rng, gpu) for _ in range(4)]
    mine, state, _ = _run(_make("adamw", form, mu_dtype=dtype), form, params, grads_seq, True)
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    again, again_state, _ = _run(_make("adamw", form, mu_dtype=dtype), form, params, grads_seq,
                                 True)
    for got, want in zip(jax.tree.leaves((mine, state)), jax.tree.leaves((again, again_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert {x.dtype for x in jax.tree.leaves(state.mu)} == {jnp.dtype(dtype)}
    theirs, their_state, _ = _run(optax.adamw(1e-3, weight_decay=0.1, mu_dtype=dtype), "optax",
                                  params, grads_seq, True)
    for got, want in zip(jax.tree.leaves((mine, state.mu)),
                         jax.tree.leaves((theirs, their_state[0].mu))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("rule,option", [("adamw", "mu_dtype"), ("sgd", "accumulator_dtype")])
@pytest.mark.parametrize("form", FORMS[1:])
def test_bfloat16_params_with_float32_state_give_float32_updates(gpu, rule, form, option,
                                                                  monkeypatch):
    """bfloat16 params with a float32 moment: the updates are float32 as optax's (the kernels
    write them as float32, new param minus old, or the step itself), the FFI path equal to the
    buffer callback's bit for bit."""
    rng = np.random.default_rng(10)
    params = _tree(rng, gpu, jnp.bfloat16)
    grads = _tree(rng, gpu, jnp.bfloat16)
    results = []
    for mechanism in ("ffi", "buffer"):
        monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", mechanism)
        tx = _make(rule, form, **{option: jnp.float32})
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        results.append(updates)
    assert {x.dtype for x in jax.tree.leaves(results[0])} == {jnp.dtype(jnp.float32)}
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(np.abs(np.asarray(x)).max(initial=0) > 0 for x in jax.tree.leaves(results[0]))


@pytest.mark.parametrize("flat", [True, False], ids=["flat-state", "tree-state"])
def test_vmap_of_an_update_steps_each_member(gpu, flat):
    """An ensemble under jax.vmap: the FFI call runs once per member (vmap_method sequential)."""
    rng = np.random.default_rng(9)
    tx = mtx.lamb(1e-2, weight_decay=0.01, flat_state=flat)
    members = [_tree(rng, gpu) for _ in range(3)]
    grads = [_tree(rng, gpu) for _ in range(3)]
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    vstep = jax.jit(jax.vmap(step))
    p, s = vstep(stack(members), jax.vmap(tx.init)(stack(members)), stack(grads))
    assert "mtapply_step" in _custom_calls(vstep.lower(p, s, stack(grads)))
    for k in range(3):
        want = jax.jit(step)(members[k], tx.init(members[k]), grads[k])
        for got, expected in zip(jax.tree.leaves(jax.tree.map(lambda x: x[k], (p, s))),
                                 jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


X64 = """
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, optax
import mtapply.optax as mtx
gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
rng = np.random.default_rng(0)
params = jax.device_put({"w": jnp.asarray(rng.standard_normal((50, 3)))}, gpu)
grads = jax.device_put({"w": jnp.asarray(rng.standard_normal((50, 3)))}, gpu)
for ours, theirs in ((mtx.adam(1 / 3), optax.adam(1 / 3)),
                     (mtx.adam(1 / 3, b1=jnp.asarray(0.9)), optax.adam(1 / 3))):
    u = jax.jit(ours.update)(grads, ours.init(params), params)[0]["w"]
    v = theirs.update(grads, theirs.init(params), params)[0]["w"]
    assert u.dtype == jnp.float64
    # the kernels read lr and the step as float32 on GPUs
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-7)
print("ok")
"""


def test_float64_params_under_x64(gpu):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", X64], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("form", ["fused", "transformation"])
def test_an_out_of_range_injected_lr_goes_through_as_in_optax(gpu, form):
    """The kernels of XLA's calls check no device value: their outputs are fresh buffers, which
    a skipped step would leave unwritten. A NaN lr gives NaN params, as optax's step does, and
    never memory the step did not write."""
    rng = np.random.default_rng(11)
    params = _tree(rng, gpu)
    grads = _tree(rng, gpu)
    tx = optax.inject_hyperparams(mtx.adam)(learning_rate=1e-3)
    state = tx.init(params)
    state = state._replace(hyperparams=dict(state.hyperparams, learning_rate=jnp.asarray(jnp.nan)))

    @jax.jit
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    if form == "fused":
        opt = mtx.fused_adam(learning_rate=jnp.asarray(jnp.nan))
        new, _ = jax.jit(lambda p, s, g: opt.step(p, g, s))(params, opt.init(params), grads)
    else:
        new, _ = step(params, state, grads)
    for name, leaf in new.items():
        values = np.asarray(leaf)
        assert values.size == 0 or np.isnan(values).all(), name


def test_ragged_leaves_in_blocks_of_128_follow_optax(gpu):
    """Leaves whose chunks mostly end part way through a stride run in blocks of 128 threads;
    the handler launches each group with its own block size (a kernel built for 128 threads
    launched with 256 would step elements twice)."""
    from mtapply import _source

    rng = np.random.default_rng(6)
    sizes = rng.integers(129, 2 * _source.CHUNK_ELEMENTS, 150)
    assert _source.block_threads(sizes, _source.CHUNK_ELEMENTS, ("float32",) * 4) == 128

    def tree():
        return {f"p{i}": jax.device_put(jnp.asarray(rng.standard_normal(int(n)), jnp.float32), gpu)
                for i, n in enumerate(sizes)}

    params, grads_seq = tree(), [tree() for _ in range(20)]
    for form in ("fused", "transformation"):
        mine, _, lowered = _run(_make("adam", form), form, params, grads_seq, False)
        assert _custom_calls(lowered).count("mtapply_step") == 1
        theirs, _, _ = _run(optax.adam(1e-3), "optax", params, grads_seq, False)
        for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
@pytest.mark.parametrize("form", ["transformation", "fused"])
def test_scalar_state_steps_in_the_ffi_call_as_optax_contrib(gpu, name, form, monkeypatch):
    """Prodigy and D-Adaptation keep their step size d in the state: the FFI call steps that
    array in place in its result (one mtapply_step, no callback), as the buffer callback does
    (the same kernels: bit for bit), following optax.contrib's jitted steps on a noisy
    quadratic, where d grows."""
    from optax import contrib

    rng = np.random.default_rng(3)
    target, params = _tree(rng, gpu), jax.tree.map(jnp.zeros_like, _tree(rng, gpu))
    noise = [jax.tree.map(lambda g: 0.1 * g, _tree(rng, gpu)) for _ in range(STEPS)]

    def run(tx, fused):
        def step(p, s, n):
            g = jax.tree.map(lambda p, t, n: 2 * (p - t) + n, p, target, n)
            if fused:
                return tx.step(p, g, s)
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s
        jitted = jax.jit(step, donate_argnums=(0, 1))
        p, s = jax.tree.map(jnp.copy, params), tx.init(params)
        for n in noise:
            p, s = jitted(p, s, n)
        return p, s, jitted.lower(p, s, noise[0])

    make = getattr(mtx, name if form == "transformation" else f"fused_{name}")
    got_p, got_s, lowered = run(make(), form == "fused")
    targets = _custom_calls(lowered)
    assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    same_p, same_s, _ = run(make(), form == "fused")
    for got, want in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((same_p, same_s))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want_p, want_s, _ = run(getattr(contrib, name)(), False)
    d, want_d = float(mtx.tree_state(got_s, got_p).d), float(want_s.estim_lr)
    assert want_d > 1e-5 and d == pytest.approx(want_d, rel=1e-3)  # d grew, as optax's did
    for got, want in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(np.abs(want).max(initial=0), 1e-3)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * scale)


ADAFACTOR_SHAPES = {"matrix": (256, 130), "stack": (3, 128, 129), "wide": (130, 520),
                    "small": (6, 40), "bias": (7,), "column": (300, 1)}


def _adafactor_run(opt, through_step, params, grads_seq) -> tuple:
    """(params, state, the lowered step) after jitted steps over grads_seq, by the fused step
    or by update and apply_updates."""
    def step(p, s, g):
        if through_step:
            return opt.step(p, g, s)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    jitted = jax.jit(step)
    p, s = params, opt.init(params)
    for g in grads_seq:
        p, s = jitted(p, s, g)
    return p, s, jitted.lower(p, s, grads_seq[0])


@pytest.mark.parametrize("fused", [False, "flat", True],
                         ids=["transformation", "transformation-flat-state", "fused"])
@pytest.mark.parametrize("options", [{}, {"momentum": 0.9, "weight_decay_rate": 0.01}],
                         ids=["defaults", "momentum-decay"])
def test_adafactor_steps_through_the_ffi_call_as_optax(gpu, fused, options, monkeypatch):
    """mtapply.optax.adafactor under jit (its state optax's, or flat): one mtapply_step whose
    factored kernels take each param's rows and columns (matrices, a stack, leaves too small
    to factor, vectors), and optax.adafactor's params and state after 20 steps."""
    monkeypatch.delenv("MTAPPLY_OPTAX_CALLBACK", raising=False)
    rng = np.random.default_rng(9)

    def tree():
        return {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32), gpu)
                for k, s in ADAFACTOR_SHAPES.items()}

    params, grads_seq = tree(), [tree() for _ in range(20)]

    def run(opt, through_step):
        return _adafactor_run(opt, through_step, params, grads_seq)

    mine = (mtx.fused_adafactor(learning_rate=0.01, **options) if fused is True else
            mtx.adafactor(learning_rate=0.01, **options, flat_state=fused == "flat"))
    got, got_state, lowered = run(mine, fused is True)
    targets = _custom_calls(lowered)
    assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]
    if fused:  # its flat state (a few buffers) as optax's
        assert len(jax.tree.leaves(got_state)) <= 5
        got_state = mtx.fused_adafactor(learning_rate=0.01, **options).tree_state(got_state, got)
    want, want_state, _ = run(optax.adafactor(learning_rate=0.01, **options), False)
    pairs = list(zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))))
    assert len(pairs) == len(jax.tree.leaves((want, want_state)))
    for g, w in pairs:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        scale = max(np.abs(w).max(initial=0), 1e-3)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale)
    moved = np.abs(np.asarray(got["matrix"]) - np.asarray(params["matrix"])).max()
    assert moved > 1e-3  # the params did move


@pytest.mark.parametrize("fused", [False, True], ids=["transformation", "fused"])
def test_adafactor_with_8_bit_momentum_steps_through_the_ffi_call(gpu, fused, monkeypatch):
    """mtapply.optax.adafactor(state_bits=8) under jit: one mtapply_step, codes in the rule's
    layout (a param whose largest dimensions are moved last among them), each element's
    movement over 4 steps within a few percent of optax.adafactor's in the median."""
    monkeypatch.delenv("MTAPPLY_OPTAX_CALLBACK", raising=False)
    rng = np.random.default_rng(10)
    shapes = {**ADAFACTOR_SHAPES, "first": (300, 130, 2)}

    def tree():
        return {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32), gpu)
                for k, s in shapes.items()}

    params, grads_seq = tree(), [tree() for _ in range(4)]
    options = dict(learning_rate=0.01, momentum=0.9, weight_decay_rate=0.01)

    def run(opt, through_step):
        return _adafactor_run(opt, through_step, params, grads_seq)

    mine = (mtx.fused_adafactor if fused else mtx.adafactor)(**options, state_bits=8)
    got, state, lowered = run(mine, fused)
    targets = _custom_calls(lowered)
    assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]
    ema = next(link for link in state if isinstance(link, mtx.EightBitEmaState))
    assert ema.ema["first"].dtype == jnp.uint8 and ema.ema["first"].shape == (2, 300, 130)
    want, _, _ = run(optax.adafactor(**options), False)
    for k in ("matrix", "stack", "wide", "first"):
        start, ours, ref = (np.asarray(t[k], np.float64) for t in (params, got, want))
        relative = np.abs(ours - ref) / np.maximum(np.abs(ref - start), 1e-12)
        assert np.median(relative) < 0.02 and np.mean(relative > 0.5) < 0.03, k


# optax's Adafactor rule with its momentum in 8 bits beside the factored slots (min_dim_size
# 128, threshold 1000): factored matrices and a stack, a matrix below min_dim_size that keeps a
# full variance, a long vector and a short one that keeps float32 state
EIGHT_SHAPES = {"matrix": (300, 260), "stack": (3, 130, 140), "thin": (100, 120),
                "vector": (5000,), "bias": (7,)}
EIGHT_HYPER = dict(decay=0.5, eps=1e-30, clipping_threshold=1.0, weight_decay=0.01,
                   momentum=0.9)


def _eight_bit_adafactor_engine():
    """(the rule, its engine, the jitted step returning updates) of the 8-bit Adafactor."""
    from mtapply._optax_eight_bit import EightBitUserRule
    from mtapply._optax_engine import Engine
    from mtapply.rules import library

    rule = library.adafactor_optax(momentum=True).with_state_bits(8, slots=("ema",),
                                                                  threshold=1000)
    made = EightBitUserRule(rule, EIGHT_HYPER)
    engine = Engine(made, 1e-2)
    return rule, made, jax.jit(lambda p, g, s: engine.apply(p, g, s, mode="delta"))


def _eight_bit_adafactor_follows_numpy(device, check_lowered=None):
    """Three steps through the engine on `device`, each from the inputs of the rule's NumPy
    step: params within float32 math, codes equal but for values on a midpoint."""
    from mtapply import quantization

    rule, made, step = _eight_bit_adafactor_engine()
    names, rng = list(EIGHT_SHAPES), np.random.default_rng(7)
    params = [rng.standard_normal(EIGHT_SHAPES[k]).astype(np.float32) for k in names]
    state = [list(c) for c in rule.state(params, min_dim_size=128)]
    for k, p in enumerate(params):  # a momentum to carry (the state starts at zero)
        if state[3][k].dtype == np.uint8:
            codes, state[4][k] = quantization.quantize_blockwise(
                (rng.standard_normal(p.shape) * 0.01).astype(np.float32), True)
            state[3][k] = codes.reshape(p.shape)

    def tree(values):
        return {k: jax.device_put(jnp.asarray(v), device) for k, v in zip(names, values)}

    for t in range(1, 4):
        grads = [rng.standard_normal(EIGHT_SHAPES[k]).astype(np.float32) for k in names]
        inner = made.state_type(jnp.zeros([], jnp.int32), *(tree(c) for c in state))
        args = (tree(params), tree(grads), inner)
        updates, new_state = step(*args)
        if check_lowered:
            check_lowered(step.lower(*args))
        got_params = [np.array(args[0][k] + updates[k]) for k in names]  # (before the host step)
        got_state = [[np.array(getattr(new_state, field)[k]) for k in names] for field in made.slots]
        rule.step(params, grads, *state, lr=1e-2, **EIGHT_HYPER)
        for k, name in enumerate(names):
            got = got_params[k]
            np.testing.assert_allclose(got, params[k], rtol=1e-5, atol=2e-3, err_msg=f"step {t} {name}")
            assert np.isclose(got, params[k], rtol=1e-5, atol=1e-6).mean() >= 0.999, name
            for field, column, mine_column in zip(made.slots, state, got_state):
                mine = mine_column[k]
                if mine.dtype == np.uint8:
                    diff = np.abs(mine.astype(int) - column[k].astype(int))
                    assert diff.max(initial=0) <= 1 and (diff == 0).mean() >= 0.999, (field, name)
                else:
                    np.testing.assert_allclose(mine, column[k], rtol=1e-4, atol=1e-7,
                                               err_msg=f"step {t} {field}[{name}]")


def test_8_bit_momentum_beside_factored_slots_steps_through_the_ffi_call(gpu, monkeypatch):
    """The factored reductions and the 8-bit walk's indexed passes in one mtapply_step custom
    call, against the rule's NumPy step."""
    monkeypatch.delenv("MTAPPLY_OPTAX_CALLBACK", raising=False)

    def one_call(lowered):
        targets = _custom_calls(lowered)
        assert targets.count("mtapply_step") == 1 and not [t for t in targets if "callback" in t]

    _eight_bit_adafactor_follows_numpy(gpu, one_call)

