"""mtapply.optax: the transformations and fused steps against optax and mtapply.reference.

CPU tests run on jax's CPU backend (the callback then runs mtapply's NumPy backend on XLA's host
buffers); the `gpu` tests run the same comparisons on the GPU, where the callback launches the
kernels on XLA's stream. Each comparison runs many steps, eagerly and inside jax.jit, and checks
params and every state buffer, and that the caller's arrays are never written.
"""
from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to mtapply
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402
from mtapply import reference  # noqa: E402

STEPS = 20
GPU_STEPS = 200
SHAPES = {"w": (7, 5), "b": (5,), "deep": {"k": (3, 4, 2), "s": ()}}
# Two fp32 implementations with different operation orders (optax's bias corrections in fp32,
# mtapply's in double; FMA contraction), compounded over the steps: ~80 fp32 ulps.
RTOL = 1e-5


def _device(kind: str):
    if kind == "gpu":
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            pytest.skip("jax has no GPU backend here (install jax[cuda])")
        return gpus[0]
    return jax.devices("cpu")[0]


def _draw(rng, shapes=SHAPES):
    """A pytree of float32 NumPy arrays of the given shapes, standard normal."""
    return jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))


def _put(tree, device):
    return jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), device), tree)


def _host(tree):
    return jax.tree.map(lambda x: np.array(x, dtype=np.float64), tree)


def _assert_trees_close(got, want, what: str, rtol: float = RTOL, scales=None) -> None:
    """Leaf by leaf. atol is rtol times the largest magnitude the leaf has held over the steps
    (`scales`, a dict kept by the caller for one quantity): an element that an update cancels
    to near 0 keeps the rounding of the values it came from."""
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, f"{what}: {got_def} != {want_def}"
    scales = {} if scales is None else scales
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        w = np.asarray(w, np.float64)
        scales[i] = max(scales.get(i, 1e-3), np.abs(w).max(initial=0.0))
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol,
                                   atol=rtol * scales[i], err_msg=f"{what}, leaf {i}")


def _run(tx, params, grads_seq, mode: str):
    """(params, state) after each step of `tx`, eager calls or one jitted train step; the
    state in optax's layout (mtapply's flat slots as pytrees like params)."""
    state, first = tx.init(params), params

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if mode == "jit" else step
    for grads in grads_seq:
        params, state = step(params, grads, state)
        yield params, _as_tree(state, first)


def _as_tree(state, params):
    """`state` with the flat slots of mtapply's states as pytrees; a state already in that
    layout (flat_state=False, or optax's own) as it is."""
    try:
        return mtx.tree_state(state, params)
    except ValueError:  # not flat: buffers_of names what it found
        return state


def _compare(ours, theirs, params, grads_seq, mode, state_map):
    """Steps both transformations; `state_map(ours_state, their_state)` yields state pairs."""
    scales = collections.defaultdict(dict)
    for t, ((p1, s1), (p2, s2)) in enumerate(zip(_run(ours, params, grads_seq, mode),
                                                 _run(theirs, params, grads_seq, mode)), 1):
        _assert_trees_close(p1, p2, f"params after step {t}", scales=scales["params"])
        for name, a, b in state_map(s1, s2):
            _assert_trees_close(a, b, f"{name} after step {t}", scales=scales[name])
        assert int(s1.count) == t


def _adam_states(ours, theirs):
    adam_state = theirs[0]
    yield "mu", ours.mu, adam_state.mu
    yield "nu", ours.nu, adam_state.nu


def _sgd_states(ours, theirs):
    if ours.trace is not None:
        yield "trace", ours.trace, theirs[0].trace


def _matrices(params):
    """optax's usual weight-decay mask: decay on matrices, none on vectors and scalars."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


MASK_TREE = {"w": False, "b": True, "deep": {"k": True, "s": False}}

CASES = {  # name -> (ours, optax's, state pairs)
    "adam": (lambda: mtx.adam(1e-2), lambda: optax.adam(1e-2), _adam_states),
    "adam-betas": (lambda: mtx.adam(3e-2, b1=0.5, b2=0.9, eps=1e-6),
                   lambda: optax.adam(3e-2, b1=0.5, b2=0.9, eps=1e-6), _adam_states),
    "adamw": (lambda: mtx.adamw(1e-2, weight_decay=0.1),
              lambda: optax.adamw(1e-2, weight_decay=0.1), _adam_states),
    "adamw-tree-state": (lambda: mtx.adamw(1e-2, weight_decay=0.1, flat_state=False),
                         lambda: optax.adamw(1e-2, weight_decay=0.1), _adam_states),
    "adamw-default-wd": (lambda: mtx.adamw(1e-3), lambda: optax.adamw(1e-3), _adam_states),
    "adamw-mask": (lambda: mtx.adamw(1e-2, weight_decay=0.1, mask=_matrices),
                   lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_matrices), _adam_states),
    "adamw-mask-tree": (lambda: mtx.adamw(1e-2, weight_decay=0.1, mask=MASK_TREE),
                        lambda: optax.adamw(1e-2, weight_decay=0.1, mask=MASK_TREE),
                        _adam_states),
    "sgd": (lambda: mtx.sgd(0.1), lambda: optax.sgd(0.1), _sgd_states),
    "sgd-momentum": (lambda: mtx.sgd(0.05, momentum=0.9), lambda: optax.sgd(0.05, momentum=0.9),
                     _sgd_states),
    "sgd-nesterov": (lambda: mtx.sgd(0.05, momentum=0.8, nesterov=True),
                     lambda: optax.sgd(0.05, momentum=0.8, nesterov=True), _sgd_states),
    "sgd-tree-state": (lambda: mtx.sgd(0.05, momentum=0.9, flat_state=False),
                       lambda: optax.sgd(0.05, momentum=0.9), _sgd_states),
}


def _check_case(name, mode, device, steps, seed=0):
    ours, theirs, states = CASES[name]
    rng = np.random.default_rng(seed)
    params = _put(_draw(rng), device)
    grads_seq = [_put(_draw(rng), device) for _ in range(steps)]
    kept = _host(params)
    _compare(ours(), theirs(), params, grads_seq, mode, states)
    _assert_trees_close(params, kept, "the caller's params", rtol=0.0)


# ---------------------------------------------------------------------------------------------
# CPU


def test_importing_mtapply_does_not_import_jax():
    code = "import sys, mtapply; assert 'jax' not in sys.modules and 'optax' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("callback", ["buffer", "host"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_optax(name, mode, callback, monkeypatch):
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", callback)
    _check_case(name, mode, _device("cpu"), STEPS)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_chain_with_clipping_matches_optax(mode):
    rng = np.random.default_rng(1)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(jax.tree.map(lambda g: 3 * g, _draw(rng)), _device("cpu"))
                 for _ in range(STEPS)]
    ours = optax.chain(optax.clip_by_global_norm(1.0), mtx.adamw(1e-2, weight_decay=0.05))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.05))
    scales = collections.defaultdict(dict)
    for t, ((p1, s1), (p2, s2)) in enumerate(zip(_run(ours, params, grads_seq, mode),
                                                 _run(theirs, params, grads_seq, mode)), 1):
        _assert_trees_close(p1, p2, f"params after step {t}", scales=scales["params"])
        _assert_trees_close(s1[1].mu, s2[1][0].mu, f"mu after step {t}", scales=scales["mu"])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_schedules_match_optax(mode):
    rng = np.random.default_rng(2)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(_draw(rng), _device("cpu")) for _ in range(STEPS)]
    warmup = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS)
    _compare(mtx.adamw(warmup, weight_decay=0.1), optax.adamw(warmup, weight_decay=0.1), params,
             grads_seq, mode, _adam_states)
    decay = optax.exponential_decay(0.1, 3, 0.5)
    _compare(mtx.sgd(decay, momentum=0.9), optax.sgd(decay, momentum=0.9), params, grads_seq,
             mode, _sgd_states)


def test_update_without_params():
    """adam and sgd read no params (optax allows update(grads, state)); adamw needs them."""
    rng = np.random.default_rng(3)
    params, grads = _draw(rng), _draw(rng)
    for ours, theirs in ((mtx.adam(1e-2), optax.adam(1e-2)),
                         (mtx.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9))):
        mine, _ = ours.update(grads, ours.init(params))
        want, _ = theirs.update(grads, theirs.init(params))
        _assert_trees_close(mine, want, "updates")
    adamw = mtx.adamw(1e-2)
    with pytest.raises(ValueError, match="update\\(grads, state, params\\)"):
        adamw.update(grads, adamw.init(params))


@pytest.mark.parametrize("mode", ["eager", "train-step"])
def test_fused_step_matches_optax_and_keeps_inputs(mode):
    rng = np.random.default_rng(4)
    device = _device("cpu")
    params = _put(_draw(rng), device)
    targets = [_put(_draw(rng), device) for _ in range(STEPS)]
    opt, tx = mtx.fused_adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    _fused_against_optax(opt, tx, params, targets, mode)


def _loss(params, target):
    return sum(jnp.sum((p - t) ** 2 * (1 + jnp.abs(t))) for p, t in
               zip(jax.tree.leaves(params), jax.tree.leaves(target)))


def _fused_against_optax(opt, tx, params, targets, mode, rtol=RTOL):
    """opt.step (eager, or inside a jitted train step that donates params and state) against
    optax; the arrays the caller still holds keep their values."""
    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def train_step(params, target, state):
        return opt.step(params, jax.grad(_loss)(params, target), state)

    @jax.jit
    def optax_step(params, target, state):
        updates, state = tx.update(jax.grad(_loss)(params, target), state, params)
        return optax.apply_updates(params, updates), state

    kept = _host(params)
    mine = params if mode == "eager" else jax.tree.map(jnp.copy, params)  # the copy is donated
    state, want, their_state = opt.init(params), params, tx.init(params)
    scales = collections.defaultdict(dict)
    for t, target in enumerate(targets, 1):
        if mode == "eager":
            old, old_state = (mine, state), (_host(mine), _host(state.mu), _host(state.nu))
            mine, state = opt.step(mine, jax.grad(_loss)(mine, target), state)
            for held, values in zip((old[0], old[1].mu, old[1].nu), old_state):
                _assert_trees_close(held, values, f"an input of step {t}", 0.0)
        else:
            mine, state = train_step(mine, target, state)
        want, their_state = optax_step(want, target, their_state)
        _assert_trees_close(mine, want, f"params after step {t}", rtol, scales["params"])
        _assert_trees_close(opt.tree_state(state, mine).mu, their_state[0].mu,
                            f"mu after step {t}", rtol, scales["mu"])
    _assert_trees_close(params, kept, "the caller's initial params", 0.0)


def test_fused_eager_step_leaves_the_callers_arrays_unchanged():
    rng = np.random.default_rng(5)
    params, grads = _put(_draw(rng), _device("cpu")), _put(_draw(rng), _device("cpu"))
    opt = mtx.fused_adam(0.1)
    state = opt.init(params)
    state = opt.step(params, grads, state)[1]  # a non-zero state to keep
    kept = [_host(x) for x in (params, grads, state.mu, state.nu)]
    new_params, new_state = opt.step(params, grads, state)
    for got, want in zip((params, grads, state.mu, state.nu), kept):
        _assert_trees_close(got, want, "an input of step", rtol=0.0)
    assert not np.allclose(_host(new_params)["w"], kept[0]["w"])
    assert int(new_state.count) == 2


def test_donated_step_consumes_its_inputs():
    rng = np.random.default_rng(6)
    params, grads = _put(_draw(rng), _device("cpu")), _put(_draw(rng), _device("cpu"))
    opt = mtx.fused_sgd(0.1, momentum=0.9)
    state = opt.init(params)
    want, _ = opt.step(params, grads, state)
    got, _ = opt.donated_step(params, grads, state)
    _assert_trees_close(got, want, "donated step", rtol=0.0)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert not any(x.is_deleted() for x in jax.tree.leaves(grads))


def _reference_steps(rule, n_states, params, grads_seq):
    """float64 mtapply.reference over the steps, leaf by leaf, from zero states: (params,
    states) after each step. `rule(p, g, *states, t, i)` returns (p, *states)."""
    leaves = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
    states = [[np.zeros_like(p) for _ in range(n_states)] for p in leaves]
    for t, grads in enumerate(grads_seq, 1):
        for i, g in enumerate(jax.tree.leaves(grads)):
            leaves[i], *states[i] = rule(leaves[i], np.asarray(g, np.float64), *states[i], t, i)
        yield leaves, states


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_lars_matches_reference(weight_decay, mode):
    rng = np.random.default_rng(7)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(_draw(rng), _device("cpu")) for _ in range(STEPS)]
    mask = {"w": True, "b": False, "deep": {"k": True, "s": False}}
    hyper = dict(momentum=0.9, trust_coefficient=0.02, eps=1e-6, weight_decay=weight_decay)
    exclude = [not m for m in jax.tree.leaves(mask)]

    def rule(p, g, v, t, i):
        return reference.lars(p, g, v, lr=0.5, adapt=not exclude[i], **hyper)

    tx = mtx.lars(0.5, trust_ratio_mask=mask, weight_decay_mask=mask, **hyper)
    ours, want = _run(tx, params, grads_seq, mode), _reference_steps(rule, 1, params, grads_seq)
    scales = collections.defaultdict(dict)
    for t, ((p, state), (want_p, want_states)) in enumerate(zip(ours, want), 1):
        _assert_trees_close(jax.tree.leaves(p), want_p, f"params after step {t}",
                            scales=scales["params"])
        _assert_trees_close(jax.tree.leaves(state.momentum), [v for v, in want_states],
                            f"momentum after step {t}", scales=scales["momentum"])


def test_lars_without_weight_decay_matches_optax():
    rng = np.random.default_rng(8)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(_draw(rng), _device("cpu")) for _ in range(STEPS)]
    ours = mtx.lars(0.5, momentum=0.9, trust_coefficient=0.02)
    theirs = optax.lars(0.5, momentum=0.9, trust_coefficient=0.02)
    _compare(ours, theirs, params, grads_seq, "jit",
             lambda a, b: [("momentum", a.momentum, jax.tree.map(lambda x: -x, b[-1].trace))])


LAMB_CASES = [
    dict(weight_decay=0.01),
    dict(weight_decay=0.0),  # optax.lamb: the trust ratio whatever the weight decay
    dict(weight_decay=0.0, use_nvlamb=False),  # Apex: none without weight decay
    dict(weight_decay=0.1, b1=0.5, b2=0.95, eps=1e-8, max_grad_norm=1.0),
    dict(weight_decay=0.01, adam_w_mode=False, grad_averaging=False, bias_correction=False),
]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", LAMB_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in
                                                                     c.items()))
def test_lamb_matches_reference(case, mode):
    rng = np.random.default_rng(9)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(jax.tree.map(lambda g: 2 * g, _draw(rng)), _device("cpu"))
                 for _ in range(STEPS)]
    names = {"b1": "beta1", "b2": "beta2"}
    hyper = {"use_nvlamb": True, **{names.get(k, k): v for k, v in case.items()}}
    norms = [float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)))
                               for g in jax.tree.leaves(grads)))) for grads in grads_seq]

    def rule(p, g, m, v, t, i):
        return reference.lamb(p, g, m, v, lr=1e-2, step=t, global_grad_norm=norms[t - 1], **hyper)

    tx = mtx.lamb(1e-2, **case)
    ours, want = _run(tx, params, grads_seq, mode), _reference_steps(rule, 2, params, grads_seq)
    scales = collections.defaultdict(dict)
    for t, ((p, state), (want_p, want_states)) in enumerate(zip(ours, want), 1):
        _assert_trees_close(jax.tree.leaves(p), want_p, f"params after step {t}",
                            scales=scales["params"])
        _assert_trees_close(jax.tree.leaves(state.mu), [m for m, _ in want_states],
                            f"mu after step {t}", scales=scales["mu"])
        _assert_trees_close(jax.tree.leaves(state.nu), [v for _, v in want_states],
                            f"nu after step {t}", scales=scales["nu"])


def test_lamb_matches_optax_when_the_trust_ratio_applies():
    rng = np.random.default_rng(10)
    params = _put(_draw(rng), _device("cpu"))
    grads_seq = [_put(_draw(rng), _device("cpu")) for _ in range(STEPS)]
    _compare(mtx.lamb(1e-2, weight_decay=0.01), optax.lamb(1e-2, weight_decay=0.01), params,
             grads_seq, "jit", _adam_states)


def test_empty_tree_and_empty_leaves():
    tx = mtx.adam(1e-2)
    updates, state = tx.update({}, tx.init({}))
    assert updates == {} and int(state.count) == 1
    params = {"e": jnp.zeros((0, 3)), "x": jnp.ones(4)}
    grads = {"e": jnp.zeros((0, 3)), "x": jnp.full(4, 0.5)}
    opt = mtx.fused_adam(0.1)
    new, _ = opt.step(params, grads, opt.init(params))
    assert new["e"].shape == (0, 3)
    np.testing.assert_allclose(np.asarray(new["x"]), 0.9, rtol=1e-6)


def _call_operand_shapes(jaxpr, primitive: str) -> list:
    """The operand shapes of every `primitive` equation, in nested jaxprs too."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            shapes += [tuple(v.aval.shape) for v in eqn.invars]
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    shapes += _call_operand_shapes(inner, primitive)
    return shapes


@pytest.mark.parametrize("make", [lambda: mtx.adamw(1e-2, weight_decay=0.1),
                                  lambda: mtx.adamw(1e-2, weight_decay=0.1, flat_state=False),
                                  lambda: mtx.lamb(1e-2), lambda: mtx.fused_adamw(1e-2)],
                         ids=["adamw", "adamw-tree-state", "lamb", "fused-adamw"])
def test_leaves_without_elements_stay_out_of_the_call(make, monkeypatch):
    """An empty leaf has no step: it goes through unchanged and is no operand of the call;
    a tree of empty leaves alone makes no call."""
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", "buffer")
    opt = make()
    params = {"a": jnp.full((3, 2), 0.5), "e": jnp.zeros((0,)),
              "f": jnp.zeros((2, 0), jnp.bfloat16)}
    grads = jax.tree.map(lambda x: jnp.full(x.shape, -0.25, x.dtype), params)
    if hasattr(opt, "step"):
        step = lambda p, s, g: opt.step(p, g, s)  # noqa: E731
    else:
        step = lambda p, s, g: (optax.apply_updates(p, opt.update(g, s, p)[0]),  # noqa: E731
                                opt.update(g, s, p)[1])
    state = opt.init(params)
    shapes = _call_operand_shapes(jax.make_jaxpr(step)(params, state, grads), "buffer_callback")
    assert shapes and all(0 not in shape for shape in shapes), shapes
    new, new_state = jax.jit(step)(params, state, grads)
    assert new["e"].shape == (0,) and new["f"].shape == (2, 0) and new["f"].dtype == jnp.bfloat16
    assert np.all(np.asarray(new["a"]) > 0.5)  # stepped against the negative grad
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    only_empty = {"e": params["e"], "f": params["f"]}
    assert _call_operand_shapes(jax.make_jaxpr(step)(only_empty, opt.init(only_empty),
                                                     only_empty), "buffer_callback") == []


@pytest.mark.parametrize("callback,primitive", [("buffer", "buffer_callback["),
                                                ("host", "pure_callback[")])
def test_one_callback_per_update(callback, primitive, monkeypatch):
    monkeypatch.setenv("MTAPPLY_OPTAX_CALLBACK", callback)
    params = _put(_draw(np.random.default_rng(17)), _device("cpu"))
    for opt in (mtx.fused_adamw(1e-3), mtx.fused_lamb(1e-3, max_grad_norm=1.0)):
        text = str(jax.make_jaxpr(opt.step)(params, params, opt.init(params)))
        assert text.count(primitive) == 1, text


@pytest.mark.parametrize("make,mu_dtype", [
    (lambda: mtx.adam(1e-2), jnp.float32),
    (lambda: mtx.adamw(1e-2, mu_dtype=jnp.bfloat16), jnp.bfloat16),
    (lambda: mtx.sgd(1e-2, momentum=0.9), None), (lambda: mtx.fused_adamw(1e-2), jnp.float32)],
    ids=["adam", "adamw-mu-bf16", "sgd-momentum", "fused-adamw"])
def test_a_state_over_one_array_is_laid_out_as_optax_keeps_it(make, mu_dtype):
    """A tree of one leaf keeps its slots like params (flat buffers would save no array):
    optax's layout, with the dtypes optax gives them; tree_state and flat_state keep it; a
    state an older version kept flat for one leaf steps the same."""
    from mtapply._optax_state import FlatLayout, leaf_struct

    opt = make()
    params = jnp.asarray(np.random.default_rng(19).standard_normal((3, 4)), jnp.float32)
    state = opt.init(params)
    slots = {f: getattr(state, f) for f in state._fields[1:]}
    for field, slot in slots.items():
        assert slot.shape == params.shape, field
    if mu_dtype is not None:
        assert slots["mu"].dtype == mu_dtype and slots["nu"].dtype == jnp.float32
    for convert in (mtx.tree_state, mtx.flat_state):
        converted = convert(state, params)
        assert jax.tree.structure(converted) == jax.tree.structure(state)
    layout = FlatLayout([leaf_struct(params)])
    older = state._replace(**{f: dict(zip(layout.names, layout.join([s + 0.25])))
                              for f, s in slots.items() if s.dtype == jnp.float32})
    newer = state._replace(**{f: s + 0.25 for f, s in slots.items() if s.dtype == jnp.float32})
    grads = params * 0.5 - 0.1
    if hasattr(opt, "step"):
        got, want = opt.step(params, grads, older)[0], opt.step(params, grads, newer)[0]
    else:
        got, want = opt.update(grads, older, params)[0], opt.update(grads, newer, params)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_leaves_follow_the_reference():
    """bf16 reaches mtapply through XLA's DLPack export; the update runs in fp32."""
    rng = np.random.default_rng(18)
    p, g = (rng.standard_normal(300).astype(np.float32) for _ in range(2))
    params = {"p": jax.device_put(jnp.asarray(p, jnp.bfloat16), _device("cpu"))}
    grads = {"p": jax.device_put(jnp.asarray(g, jnp.bfloat16), _device("cpu"))}
    opt = mtx.fused_adam(1e-2)
    new, state = opt.step(params, grads, opt.init(params))
    assert new["p"].dtype == jnp.bfloat16 and state.nu["p"].dtype == jnp.bfloat16  # one leaf
    want, _, _, _ = reference.adam(np.asarray(params["p"], np.float64),
                                   np.asarray(grads["p"], np.float64), 0.0, 0.0, lr=1e-2, step=1)
    np.testing.assert_allclose(np.asarray(new["p"], np.float64), want, rtol=1.6e-2, atol=1e-5)


def test_float16_leaves_follow_the_reference():
    rng = np.random.default_rng(11)
    params = {"h": jnp.asarray(rng.standard_normal(64), jnp.float16),
              "f": jnp.asarray(rng.standard_normal(8), jnp.float32)}
    grads = {"h": jnp.asarray(rng.standard_normal(64), jnp.float16),
             "f": jnp.asarray(rng.standard_normal(8), jnp.float32)}
    opt = mtx.fused_adam(1e-2)
    new, state = opt.step(params, grads, opt.init(params))
    assert new["h"].dtype == jnp.float16 and state.mu["float16"].dtype == jnp.float16
    for key in params:
        p, _, _, _ = reference.adam(np.asarray(params[key]), np.asarray(grads[key]), 0.0, 0.0,
                                    lr=1e-2, step=1)
        np.testing.assert_allclose(np.asarray(new[key], np.float64), p, rtol=1e-3, atol=1e-5)


def test_unsupported_options_and_bad_hyperparameters():
    with pytest.raises(NotImplementedError, match="accumulator_dtype=complex64"):
        mtx.sgd(1e-3, accumulator_dtype=jnp.complex64)
    with pytest.raises(NotImplementedError, match="mu_dtype=int32"):
        mtx.adam(1e-3, mu_dtype=jnp.int32)
    with pytest.raises(ValueError, match="eps_root must be >= 0"):
        mtx.adam(1e-3, eps_root=-1.0)
    with pytest.raises(NotImplementedError, match="nesterov"):
        mtx.lars(1e-3, nesterov=True)
    with pytest.raises(ValueError, match="b1"):
        mtx.adam(1e-3, b1=1.5)
    with pytest.raises(ValueError, match="learning_rate"):
        mtx.sgd(-1.0)
    with pytest.raises(TypeError, match="schedule"):
        mtx.adamw(1e-3, weight_decay=lambda count: 0.1)
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    tx = mtx.lars(0.1, weight_decay=0.1, trust_ratio_mask={"w": True, "b": False})
    with pytest.raises(ValueError, match="same weight_decay_mask"):
        tx.update(params, tx.init(params), params)
    tx = mtx.adamw(0.1, weight_decay=0.1, mask=lambda p: p)  # arrays, not bools
    with pytest.raises(TypeError, match="mask must hold Python bools"):
        tx.update(params, tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels on XLA's stream


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_matches_optax(name, mode):
    _check_case(name, mode, _device("gpu"), GPU_STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "train-step"])
def test_gpu_fused_step_matches_optax_and_keeps_inputs(mode):
    rng = np.random.default_rng(12)
    device = _device("gpu")
    shapes = {"big": (1000, 777), "odd": (278011,), "small": [(3,), (1,), (0,), (65, 65)]}
    params = _put(_draw(rng, shapes), device)
    targets = [_put(_draw(rng, shapes), device) for _ in range(50)]
    opt, tx = mtx.fused_adamw(1e-3, weight_decay=0.1), optax.adamw(1e-3, weight_decay=0.1)
    _fused_against_optax(opt, tx, params, targets, mode)


@pytest.mark.gpu
def test_gpu_chain_and_schedule_match_optax():
    rng = np.random.default_rng(13)
    device = _device("gpu")
    params = _put(_draw(rng), device)
    grads_seq = [_put(jax.tree.map(lambda g: 3 * g, _draw(rng)), device) for _ in range(GPU_STEPS)]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, GPU_STEPS)
    ours = optax.chain(optax.clip_by_global_norm(1.0), mtx.adamw(schedule, weight_decay=0.05))
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))
    scales = {}
    for t, ((p1, _), (p2, _)) in enumerate(zip(_run(ours, params, grads_seq, "jit"),
                                               _run(theirs, params, grads_seq, "jit")), 1):
        _assert_trees_close(p1, p2, f"params after step {t}", scales=scales)


@pytest.mark.gpu
def test_gpu_donated_step_and_inputs_left_alone():
    rng = np.random.default_rng(14)
    device = _device("gpu")
    params, grads = _put(_draw(rng), device), _put(_draw(rng), device)
    opt = mtx.fused_sgd(0.1, momentum=0.9, nesterov=True)
    state = opt.init(params)
    kept = _host(params)
    want, _ = opt.step(params, grads, state)
    _assert_trees_close(params, kept, "params after a non-donated step", rtol=0.0)
    got, _ = opt.donated_step(params, grads, state)
    _assert_trees_close(got, want, "donated step", rtol=0.0)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))


@pytest.mark.gpu
@pytest.mark.parametrize("case", LAMB_CASES[:2], ids=["wd", "nvlamb"])
def test_gpu_lamb_and_lars_match_optax(case):
    rng = np.random.default_rng(15)
    device = _device("gpu")
    params = _put(_draw(rng), device)
    grads_seq = [_put(_draw(rng), device) for _ in range(GPU_STEPS // 4)]
    _compare(mtx.lamb(1e-2, **case),
             optax.lamb(1e-2, weight_decay=case["weight_decay"]), params, grads_seq, "jit",
             _adam_states)
    _compare(mtx.lars(0.5, trust_coefficient=0.02), optax.lars(0.5, trust_coefficient=0.02),
             params, grads_seq, "jit",
             lambda a, b: [("momentum", a.momentum, jax.tree.map(lambda x: -x, b[-1].trace))])


@pytest.mark.gpu
def test_gpu_bfloat16_leaves():
    """bf16 leaves reach the kernel through DLPack (no CuPy dtype needed): one step against the
    float64 reference, at bf16's tolerance."""
    rng = np.random.default_rng(16)
    device = _device("gpu")
    p = rng.standard_normal(4097).astype(np.float32)
    g = rng.standard_normal(4097).astype(np.float32)
    params = {"p": jax.device_put(jnp.asarray(p, jnp.bfloat16), device)}
    grads = {"p": jax.device_put(jnp.asarray(g, jnp.bfloat16), device)}
    opt = mtx.fused_adam(1e-2)
    new, _ = opt.step(params, grads, opt.init(params))
    want, _, _, _ = reference.adam(np.asarray(params["p"], np.float64),
                                   np.asarray(grads["p"], np.float64), 0.0, 0.0, lr=1e-2, step=1)
    np.testing.assert_allclose(np.asarray(new["p"], np.float64), want, rtol=1.6e-2, atol=1e-5)
