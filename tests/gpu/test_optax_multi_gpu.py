"""mtapply.optax on several GPUs, each way JAX spreads a step over devices, against the same
steps on one device:

- jax.pmap: each replica's call steps that replica's buffers with the plan's part on its GPU;
- jax.jit with params sharded by NamedSharding: XLA gives the call (which has no partitioning
  rule) every operand whole on each device, so each GPU runs the whole step on its copies
  (the fused forms' results are then replicated unless jit's out_shardings says otherwise);
- jax.shard_map: each device steps its own shard of every param (and of the state, sharded
  like the params, or a flat state made per shard inside the shard_map).

The functions take the devices as an argument: tests/test_optax_devices.py runs them on two
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2), where the call is a buffer
callback into the NumPy backend."""
import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

SHAPES = {"p0": (1000, 7), "p1": (3,), "p2": (0,), "p3": (4098,), "p4": (66, 65)}
SHARDED = {"p0": P("x"), "p1": P(), "p2": P(), "p3": P("x"), "p4": P("x")}  # dims even
# Trees for jax.pmap and jax.shard_map hold no empty leaf: some JAX versions (0.11.2) crash
# compiling a pmap or shard_map of any function, the identity included, over an empty array.
MAPPED = [name for name, shape in SHAPES.items() if 0 not in shape]
STEPS = 5
RULES = {  # name -> (transformation, fused form) with these hyperparameters
    "adamw": (lambda **kw: mtx.adamw(1e-2, weight_decay=0.01, **kw),
              lambda: mtx.fused_adamw(1e-2, weight_decay=0.01)),
    "lamb": (lambda **kw: mtx.lamb(1e-2, weight_decay=0.01, **kw),
             lambda: mtx.fused_lamb(1e-2, weight_decay=0.01)),
    "lion": (lambda **kw: mtx.lion(1e-3, weight_decay=0.01, **kw),
             lambda: mtx.fused_lion(1e-3, weight_decay=0.01)),
    "adam-injected": (lambda **kw: optax.inject_hyperparams(mtx.adam)(learning_rate=1e-2, **kw),
                      None),
}
ELEMENTWISE = ["adamw", "lion", "adam-injected"]  # each element's step reads only that element


@pytest.fixture(scope="module")
def gpus():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    return gpus[:2]


def _draw(rng, scale=1.0, names=tuple(SHAPES)):
    return {name: (rng.standard_normal(SHAPES[name]) * scale).astype(np.float32)
            for name in names}


def _make(rule, form, **kwargs):
    transformation, fused = RULES[rule]
    if form == "fused":
        if fused is None:
            pytest.skip(f"{rule} has no fused form")
        return fused()
    return transformation(**kwargs)


def _step_of(opt, form):
    if form == "fused":
        return lambda p, s, g: opt.step(p, g, s)

    def step(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s
    return step


def _on_one_device(opt, form, params, grads_seq, device):
    """(params, state) after the steps, jitted on `device` alone."""
    step = jax.jit(_step_of(opt, form))
    p = jax.device_put(params, device)
    s = jax.device_put(opt.init(params), device)
    for g in grads_seq:
        p, s = step(p, s, jax.device_put(g, device))
    return p, s


def _assert_close(got, want, what):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=f"{what}, leaf {i}")


@pytest.mark.parametrize("form", ["fused", "transformation"])
@pytest.mark.parametrize("rule", list(RULES))
def test_pmap_replicas_equal_their_steps_on_one_gpu(gpus, form, rule):
    rng = np.random.default_rng(0)
    opt = _make(rule, form)
    replicas = [_draw(rng, names=MAPPED) for _ in gpus]
    grads = [[_draw(rng, 0.1, MAPPED) for _ in gpus] for _ in range(STEPS)]
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack(xs), *trees)  # noqa: E731

    pstep = jax.pmap(_step_of(opt, form), devices=gpus)
    p = stack(replicas)
    s = jax.tree.map(lambda *xs: jnp.stack(xs), *[opt.init(r) for r in replicas])
    for g in grads:
        p, s = pstep(p, s, stack(g))
    for k, replica in enumerate(replicas):
        want = _on_one_device(opt, form, replica, [g[k] for g in grads], gpus[0])
        _assert_close(jax.tree.map(lambda x: x[k], (p, s)), want, f"replica {k}")


@pytest.mark.parametrize("flat", [True, False], ids=["flat-state", "tree-state"])
@pytest.mark.parametrize("form", ["fused", "transformation"])
@pytest.mark.parametrize("rule", list(RULES))
def test_jit_of_sharded_params_equals_one_gpu(gpus, form, rule, flat):
    if form == "fused" and not flat:
        pytest.skip("the fused forms keep a flat state")
    rng = np.random.default_rng(1)
    opt = _make(rule, form) if form == "fused" else _make(rule, form, flat_state=flat)
    params, grads_seq = _draw(rng), [_draw(rng, 0.1) for _ in range(STEPS)]
    mesh = Mesh(np.array(gpus), ("x",))
    shardings = {name: NamedSharding(mesh, spec) for name, spec in SHARDED.items()}
    p = jax.device_put(params, shardings)
    s = opt.init(p)
    step = jax.jit(_step_of(opt, form))
    for g in grads_seq:
        p, s = step(p, s, jax.device_put(g, shardings))
    if form == "transformation":  # optax.apply_updates gives the params' sharding back
        for name, leaf in p.items():
            assert leaf.sharding.is_equivalent_to(shardings[name], leaf.ndim), name
    _assert_close((p, s), _on_one_device(opt, form, params, grads_seq, gpus[0]),
                  "sharded jit")


@pytest.mark.parametrize("flat", [True, False], ids=["flat-state", "tree-state"])
@pytest.mark.parametrize("form", ["fused", "transformation"])
@pytest.mark.parametrize("rule", ELEMENTWISE)
def test_shard_map_steps_each_shard_on_its_device(gpus, form, rule, flat):
    """Each device steps its shards of an elementwise rule: the whole equals one device's step.
    The state is made inside the shard_map, per shard (flat buffers of the shard's leaves, or
    trees like the shards)."""
    if form == "fused" and not flat:
        pytest.skip("the fused forms keep a flat state")
    rng = np.random.default_rng(2)
    opt = _make(rule, form) if form == "fused" else _make(rule, form, flat_state=flat)
    params = _draw(rng, names=MAPPED)
    grads_seq = [_draw(rng, 0.1, MAPPED) for _ in range(STEPS)]
    specs = {name: SHARDED[name] for name in MAPPED}
    mesh = Mesh(np.array(gpus), ("x",))
    shardings = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
    step = _step_of(opt, form)
    # the state: each device's own, stacked along a leading axis of the mesh's size
    state_spec = jax.tree.map(lambda _: P("x"), jax.eval_shape(opt.init, params))

    def init(p):
        return jax.tree.map(lambda x: x[None], opt.init(p))

    def body(p, s, g):
        p, s = step(p, jax.tree.map(lambda x: x[0], s), g)
        return p, jax.tree.map(lambda x: x[None], s)

    shard_init = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(specs,),
                                       out_specs=state_spec, check_vma=False))
    shard_step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, state_spec, specs),
                                       out_specs=(specs, state_spec), check_vma=False))
    p = jax.device_put(params, shardings)
    s = shard_init(p)
    for g in grads_seq:
        p, s = shard_step(p, s, jax.device_put(g, shardings))
    want_p, _ = _on_one_device(opt, form, params, grads_seq, gpus[0])
    _assert_close(p, want_p, "shard_map params")
    # each device's state equals one device's steps over its shard
    for k in range(len(gpus)):
        shard = {name: np.split(x, len(gpus))[k] if SHARDED[name] == P("x") else x
                 for name, x in params.items()}
        shard_grads = [{name: np.split(x, len(gpus))[k] if SHARDED[name] == P("x") else x
                        for name, x in g.items()} for g in grads_seq]
        _, want_s = _on_one_device(opt, form, shard, shard_grads, gpus[0])
        _assert_close(jax.tree.map(lambda x: x[k], s), want_s, f"shard_map state of device {k}")
