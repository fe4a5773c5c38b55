"""mtapply.optax on several GPUs: under jax.pmap each replica's custom call steps that replica's
buffers with the plan prepared on its own GPU, and equals the same steps on one GPU."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

SHAPES = [(1000, 7), (3,), (0,), (4097,), (65, 65)]
STEPS = 5


@pytest.fixture(scope="module")
def gpus():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    return gpus[:2]


def _draw(rng, scale=1.0):
    return {f"p{i}": (rng.standard_normal(s) * scale).astype(np.float32)
            for i, s in enumerate(SHAPES)}


def _step_of(opt, form):
    if form == "fused":
        return lambda p, s, g: opt.step(p, g, s)

    def step(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    return step


@pytest.mark.parametrize("form", ["fused", "transformation"])
@pytest.mark.parametrize("rule", ["adamw", "lamb"])
def test_pmap_replicas_equal_their_steps_on_one_gpu(gpus, form, rule):
    rng = np.random.default_rng(0)
    make = getattr(mtx, f"fused_{rule}" if form == "fused" else rule)
    opt = make(1e-2, weight_decay=0.01)
    replicas = [_draw(rng) for _ in gpus]
    grads = [[_draw(rng, 0.1) for _ in gpus] for _ in range(STEPS)]
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack(xs), *trees)  # noqa: E731
    step = _step_of(opt, form)

    pstep = jax.pmap(step, devices=gpus)
    p = stack(replicas)
    s = jax.tree.map(lambda *xs: jnp.stack(xs), *[opt.init(r) for r in replicas])
    for g in grads:
        p, s = pstep(p, s, stack(g))

    single = jax.jit(step)  # on gpus[0], where its inputs are
    for k, replica in enumerate(replicas):
        q, t = jax.device_put(replica, gpus[0]), jax.device_put(opt.init(replica), gpus[0])
        for g in grads:
            q, t = single(q, t, jax.device_put(g[k], gpus[0]))
        for got, want in zip(jax.tree.leaves((p, s)), jax.tree.leaves((q, t))):
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want), rtol=1e-6,
                                       atol=1e-7, err_msg=f"replica {k}")
