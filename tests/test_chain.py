"""Chains of gradient transformations fused into one rule (`mtapply.chain`), against
optax.chain of optax's own links, and as a torch optimizer."""
import pickle

import numpy as np
import pytest

import mtapply
from mtapply.rules import library as L
from mtapply.rules.chain import Link

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

STEPS = 6
CHAINS = {  # name -> (our links, optax's links), both ending in the learning rate
    "adamw": (lambda: [L.scale_by_adam(b1=0.8), L.add_decayed_weights(0.01),
                       L.scale_by_learning_rate()],
              lambda lr: [optax.scale_by_adam(b1=0.8), optax.add_decayed_weights(0.01),
                          optax.scale_by_learning_rate(lr)]),
    "nesterov": (lambda: [L.trace(0.9, nesterov=True), L.scale_by_learning_rate()],
                 lambda lr: [optax.trace(0.9, nesterov=True), optax.scale_by_learning_rate(lr)]),
    "clip-rms": (lambda: [L.clip(0.5), L.scale_by_rms(decay=0.8, initial_scale=0.1),
                          L.scale(0.5), L.scale_by_learning_rate()],
                 lambda lr: [optax.clip(0.5), optax.scale_by_rms(decay=0.8, initial_scale=0.1),
                             optax.scale(0.5), optax.scale_by_learning_rate(lr)]),
    "lion": (lambda: [L.scale_by_lion(b2=0.95), L.add_decayed_weights(0.1),
                      L.scale_by_learning_rate()],
             lambda lr: [optax.scale_by_lion(b2=0.95), optax.add_decayed_weights(0.1),
                         optax.scale_by_learning_rate(lr)]),
    "belief": (lambda: [L.scale_by_belief(), L.scale_by_learning_rate()],
               lambda lr: [optax.scale_by_belief(), optax.scale_by_learning_rate(lr)]),
    "lamb": (lambda: [L.scale_by_adam(eps=1e-6), L.add_decayed_weights(0.01),
                      L.scale_by_trust_ratio(), L.scale_by_learning_rate()],
             lambda lr: [optax.lamb(lr, weight_decay=0.01)]),
    "lars": (lambda: [L.add_decayed_weights(1e-3), L.scale_by_trust_ratio(trust_coefficient=0.02),
                      L.scale_by_learning_rate(), L.trace(0.9)],
             lambda lr: [optax.lars(lr, weight_decay=1e-3, trust_coefficient=0.02,
                                    momentum=0.9)]),
    "global-norm": (lambda: [L.clip_by_global_norm(0.5), L.scale_by_adam(),
                             L.add_decayed_weights(0.01), L.scale_by_learning_rate()],
                    lambda lr: [optax.clip_by_global_norm(0.5), optax.scale_by_adam(),
                                optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(lr)]),
    "two-traces": (lambda: [L.trace(0.5), L.trace(0.9), L.scale_by_learning_rate()],
                   lambda lr: [optax.trace(0.5), optax.trace(0.9),
                               optax.scale_by_learning_rate(lr)]),
}


def _tree(rng, scale=1.0):
    return {"w": jnp.asarray(rng.standard_normal((5, 4)) * scale, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(4) * scale, jnp.float32)}


def _run(tx, params, grads_seq):
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chain_steps_as_optax_chain_of_the_same_links(name):
    ours, theirs = CHAINS[name]
    rule = mtapply.chain(*ours())
    rng = np.random.default_rng(0)
    params, grads_seq = _tree(rng), [_tree(rng) for _ in range(STEPS)]
    want = _run(optax.chain(*theirs(0.05)), params, grads_seq)
    got = _run(mtx.transformation(rule, 0.05), params, grads_seq)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_clashing_names_take_the_links_position():
    rule = mtapply.chain(L.trace(0.5), L.trace(0.9), L.scale_by_learning_rate())
    assert rule.slots == ("param", "grad", "trace_1", "trace_2")
    assert rule.hyper == {"decay_1": 0.5, "decay_2": 0.9, "lr": None}
    assert [line.text for line in rule.program.lines] == [
        "trace_1 = grad + decay_1 * trace_1", "update_1 = trace_1",
        "trace_2 = update_1 + decay_2 * trace_2", "update_2 = trace_2",
        "update_3 = -lr * update_2", "param = param + update_3"]


def test_a_chain_is_one_rule_that_reads_and_writes_each_tensor_once():
    rule = mtapply.chain(*CHAINS["adamw"][0]())
    source = rule.cuda_source()
    assert source.count("struct Rule_") == 2  # Args and the one functor: one pass
    params = [np.ones(3), np.full(2, 2.0)]
    grads = [np.full(3, 0.5), np.full(2, -1.0)]
    mu, nu = [np.zeros(3), np.zeros(2)], [np.zeros(3), np.zeros(2)]
    rule.step(params, grads, mu, nu, lr=0.1, step=1)
    # step 1 of Adam: the update is sign(g) (eps aside); plus the decay 0.01 * p, times -lr
    np.testing.assert_allclose(params[0], 1 - 0.1 * (1 + 0.01), rtol=1e-7)
    np.testing.assert_allclose(params[1], 2 - 0.1 * (-1 + 0.02), rtol=1e-7)


def test_a_chain_is_a_torch_optimizer_like_adamw():
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    torch.manual_seed(0)
    ours = torch.nn.Linear(6, 3)
    theirs = torch.nn.Linear(6, 3)
    theirs.load_state_dict(ours.state_dict())
    rule = mtapply.chain(L.scale_by_adam(eps=1e-8), L.add_decayed_weights(0.01),
                         L.scale_by_learning_rate())
    opt = mt.optimizer(rule, ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(4, 6, generator=g)
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert set(opt.state[next(ours.parameters())]) == {"mu", "nu", "step"}


@pytest.mark.parametrize("make,error,message", [
    (lambda: mtapply.chain(L.scale_by_trust_ratio(), L.scale_by_trust_ratio()), ValueError,
     "at most one link with sums"),
    (lambda: Link("no_output", "", {}, "x = grad"), ValueError, "never assigns 'update'"),
    (lambda: Link("bad", "m:rw", {}, "update = grad"), ValueError, "'m' is declared rw"),
    (lambda: mtapply.chain(), TypeError, "one or more links"),
    (lambda: mtapply.chain(L.trace(0.9), "scale"), TypeError, "one or more links"),
])
def test_bad_links_and_chains_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("name", ["adamw", "two-traces", "clip-rms", "lamb"])
def test_a_chain_compiles_for_the_gpu(name):
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    rule = mtapply.chain(*CHAINS[name][0]())
    source = rule.spec().source(("bfloat16", "bfloat16") + ("float32",) * (len(rule.slots) - 2))
    assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"


def _numpy_run(rule, params, grads_seq, lr, dtype):
    """A rule's functional steps over NumPy lists (slots' state from zero)."""
    ours = [np.asarray(p, dtype).copy() for p in params]
    state = [[np.zeros_like(p) for p in ours] for _ in rule.slots[2:]]
    for t, grads in enumerate(grads_seq, 1):
        rule.step(ours, [np.asarray(g, dtype) for g in grads], *state, lr=lr, step=t)
    return ours


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_clip_by_global_norm_in_a_chain_steps_as_optax(max_norm, dtype):
    """A whole-list sum (`totals`): the norm over every tensor of the list, then AdamW."""
    rule = mtapply.chain(L.clip_by_global_norm(max_norm), L.scale_by_adam(),
                         L.add_decayed_weights(0.01), L.scale_by_learning_rate())
    assert [t.name for t in rule.program.totals] == ["link1_u2"]
    rng = np.random.default_rng(1)
    shapes = [(5, 4), (4,), (0,), (300,)]
    params = [rng.standard_normal(s) for s in shapes]
    grads_seq = [[rng.standard_normal(s) for s in shapes] for _ in range(STEPS)]
    with jax.enable_x64(dtype == "float64"):
        tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.scale_by_adam(),
                         optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(0.05))
        theirs = [jnp.asarray(p, dtype) for p in params]
        state = tx.init(theirs)
        for grads in grads_seq:
            updates, state = tx.update([jnp.asarray(g, dtype) for g in grads], state, theirs)
            theirs = optax.apply_updates(theirs, updates)
        theirs = [np.asarray(p) for p in theirs]
    ours = _numpy_run(rule, params, grads_seq, 0.05, dtype)
    # the norm is a float32 sum, as the kernel's: float64 params meet optax to its rounding
    tolerance = dict(rtol=1e-6, atol=1e-8) if dtype == "float64" else dict(rtol=2e-5, atol=2e-6)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, **tolerance)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_clipped_adamw_chain_is_torch_clip_grad_norm_then_adamw(groups):
    """The norm spans every param of every group (groups of other lrs merge into one plan)."""
    torch = pytest.importorskip("torch")
    import mtapply.torch  # noqa: F401
    rule = mtapply.chain(L.clip_by_global_norm(0.5), L.scale_by_adam(),
                         L.add_decayed_weights(0.01), L.scale_by_learning_rate())
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    theirs = __import__("copy").deepcopy(ours)

    def grouped(model, decay=None):
        params = list(model.parameters())
        if groups == 1:
            return [{"params": params}]
        extra = {} if decay is None else {"weight_decay": decay}
        return [{"params": params[:2], **extra}, {"params": params[2:], "lr": 3e-3, **extra}]
    opt = mtapply.torch.optimizer(rule, grouped(ours), lr=1e-2)
    ref = torch.optim.AdamW(grouped(theirs, 0.01), lr=1e-2, weight_decay=0.01)
    for _ in range(5):
        x = torch.randn(32, 8)
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            (model(x).square().mean() * 10).backward()  # norms above 0.5: clipped
            if o is ref:
                torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):  # (torch adds 1e-6 to the norm)
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_whole_list_sums_with_per_tensor_hyperparameters_and_refusals():
    rule = mtapply.rule("clipped", slots="param:rw grad:r", hyper=dict(lr=None),
                        totals={"g2": "grad * grad"},
                        update="param = param - lr * grad / max(sqrt(g2), 1)")
    rng = np.random.default_rng(2)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(10,), (20,)]]
    grads = [rng.standard_normal(p.shape).astype(np.float32) * 3 for p in params]
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    want = [p - lr * g / max(norm, 1) for p, g, lr in zip(params, grads, (0.1, 0.2))]
    rule.plan(params, grads).step(lr=[0.1, 0.2])  # rows: each tensor its own lr, one norm
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="'g2' is a per-tensor sum already"):
        mtapply.rule("both", slots="param:rw grad:r", hyper=dict(lr=None),
                     sums={"g2": "grad * grad"}, totals={"g2": "grad * grad"},
                     update="param = param - lr * g2")
    with pytest.raises(ValueError, match="scalars: 'g2' is already"):
        mtapply.rule("both", slots="param:rw grad:r", hyper=dict(lr=None), scalars={"g2": 1.0},
                     totals={"g2": "grad * grad"}, update="param = param - lr * g2")
    with pytest.raises(ValueError, match="at most one link with sums or totals"):
        mtapply.chain(L.clip_by_global_norm(1.0), L.scale_by_trust_ratio())
    assert "totals=['g2']" in repr(rule)
    assert pickle.loads(pickle.dumps(rule)).program.totals[0].name == "g2"


def test_a_whole_list_sum_compiles_for_the_gpu():
    pytest.importorskip("cuda.bindings")
    from mtapply import _source

    rule = mtapply.chain(L.clip_by_global_norm(1.0), L.scale_by_adam(),
                         L.scale_by_learning_rate())
    spec = rule.spec()
    assert spec.n_totals == 1 and spec.arg_fields[-1] == "totals_array"
    for dtypes in (("float32",) * 4, ("bfloat16", "bfloat16", "float32", "float32")):
        source = spec.source(dtypes)
        assert "GLOBAL = true" in source and "a.totals_array[0] = total" in source
        assert _source.compile_offline(source, "sm_90")[:4] == b"\x7fELF"


def test_a_whole_list_sum_that_would_split_is_refused_before_anything_is_written():
    """A clip chain whose groups cannot step together (a tensor lr), and one with a group
    added after a step (two step counts): each would sum over part of the list; refused,
    nothing written."""
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    rule = mtapply.chain(L.clip_by_global_norm(0.5), L.scale_by_adam(), L.scale_by_learning_rate())
    a, b = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(5))
    opt = mt.optimizer(rule, [{"params": [a]}, {"params": [b], "lr": torch.tensor(0.01)}], lr=0.1)
    a.grad, b.grad = torch.randn(10), torch.randn(5)
    before = a.detach().clone(), b.detach().clone()
    with pytest.raises(ValueError, match="sums over all its params"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    opt = mt.optimizer(rule, [a], lr=0.1)
    a.grad = torch.randn(10)
    opt.step()
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = torch.randn(10), torch.randn(5)
    before = a.detach().clone(), b.detach().clone()
    with pytest.raises(ValueError, match="different step counts"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
