"""Chains of gradient transformations fused into one rule (`mtapply.chain`), against
optax.chain of optax's own links, and as a torch optimizer."""
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
