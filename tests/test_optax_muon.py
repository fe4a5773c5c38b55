"""mtapply.optax.muon against optax.contrib.muon: the same results (to float32 rounding), the
same state leaf for leaf (checkpoints move both ways), every option it takes, under jit and
optax.inject_hyperparams; the matrices of one shape take one batched product per
Newton-Schulz term; what it does not take is refused naming optax.contrib.muon."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
if not hasattr(optax.contrib, "muon"):
    pytest.skip("optax.contrib.muon needs optax 0.2.5+", allow_module_level=True)
import jax.numpy as jnp  # noqa: E402

import mtapply.optax as mtx  # noqa: E402

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
SHAPES = {"a": (32, 64), "b": (64, 32), "c": (32, 64), "d": (48, 48), "bias": (7,),
          "e": (16, 80), "f": (64, 32), "conv": (3, 3, 4)}  # 6 matrices of 4 shapes, 2 others
OPTIONS = [{}, dict(nesterov=False), dict(weight_decay=0.1, consistent_rms=0.2),
           dict(adaptive=True), dict(mu_dtype=jnp.bfloat16), dict(beta=0.5, eps=1e-5,
                                                                   ns_steps=3),
           dict(adam_learning_rate=1e-3, adam_weight_decay=0.01, adam_b1=0.8),
           dict(weight_decay=0.1, weight_decay_mask=lambda p: jax.tree.map(
               lambda x: x.shape[0] != 64, p))]


def _tree(rng, device, scale=1.0):
    return jax.device_put({k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
                           for k, s in SHAPES.items()}, jax.devices(device)[0])


def _run(tx, params, grads_seq, state=None):
    update = jax.jit(tx.update)
    state = tx.init(params) if state is None else state
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _assert_close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(sorted(o)) or "defaults")
def test_muon_steps_as_optax_contrib_muon(options, device):
    rng = np.random.default_rng(0)
    params, grads_seq = _tree(rng, device, 0.1), [_tree(rng, device) for _ in range(4)]
    # float32 products on both sides (a GPU's default may take TF32, batched or not alike)
    with jax.default_matmul_precision("float32"):
        ours = _run(mtx.muon(0.02, **options), params, grads_seq)
        theirs = _run(optax.contrib.muon(0.02, **options), params, grads_seq)
    assert jax.tree.structure(ours[1]) == jax.tree.structure(theirs[1])
    # adaptive scales each update by a sum over its matrix, taken here in another order
    _assert_close(ours, theirs, *((2e-4, 1e-5) if options.get("adaptive") else ()))
    assert not np.allclose(np.asarray(ours[0]["a"]), np.asarray(params["a"]))  # it moved


def test_checkpoints_move_both_ways():
    rng = np.random.default_rng(1)
    params, grads_seq = _tree(rng, "cpu", 0.1), [_tree(rng, "cpu") for _ in range(6)]
    ours, theirs = mtx.muon(0.02, weight_decay=0.1), optax.contrib.muon(0.02, weight_decay=0.1)
    want = _run(theirs, params, grads_seq)
    for first, second in ((ours, theirs), (theirs, ours)):
        middle_params, middle_state = _run(first, params, grads_seq[:3])
        _assert_close(_run(second, middle_params, grads_seq[3:], state=middle_state), want)


def test_one_batched_product_per_newton_schulz_term_and_shape():
    """6 matrices of 4 shapes: 4 x 3 products per step of the iteration (optax: 6 x 3)."""
    params = _tree(np.random.default_rng(2), "cpu")
    tx = mtx.scale_by_muon(ns_steps=5)
    matrices = {k: v for k, v in params.items() if v.ndim == 2}
    jaxpr = jax.make_jaxpr(tx.update)(matrices, tx.init(matrices))
    dots = str(jaxpr).count("dot_general")
    assert dots == 4 * 3 * 5, dots


def test_ns_steps_through_inject_hyperparams():
    rng = np.random.default_rng(3)
    params, grads_seq = _tree(rng, "cpu", 0.1), [_tree(rng, "cpu") for _ in range(2)]
    ours = _run(optax.inject_hyperparams(mtx.muon)(learning_rate=0.02, ns_steps=3), params,
                grads_seq)
    theirs = _run(optax.inject_hyperparams(optax.contrib.muon)(learning_rate=0.02, ns_steps=3),
                  params, grads_seq)
    _assert_close(ours[0], theirs[0])


def test_what_it_does_not_take_is_refused():
    with pytest.raises(NotImplementedError, match="preconditioning='spectral'.*optax.contrib.muon"):
        mtx.muon(0.02, preconditioning="spectral")
    for coefficients in ("dion", ((3.0, -4.0, 2.0), (3.0, -4.0, 2.0))):
        with pytest.raises(NotImplementedError, match="use optax.contrib.muon"):
            mtx.muon(0.02, ns_coeffs=coefficients)
    with pytest.raises(NotImplementedError, match="muon_weight_dimension_numbers"):
        mtx.muon(0.02, muon_weight_dimension_numbers=optax.contrib.MuonDimensionNumbers())
    with pytest.raises(ValueError, match="ns_steps must be a whole number"):
        mtx.muon(0.02, ns_steps=2.5)
    with pytest.raises(ValueError, match=r"matrices only: \['bias'\]"):
        mtx.scale_by_muon().init({"bias": jnp.ones(3)})
    mtx.scale_by_muon(preconditioning="frobenius", weight_dimension_numbers=None)  # optax's
    for option in (dict(preconditioning="spectral"),
                   dict(weight_dimension_numbers=optax.contrib.MuonDimensionNumbers())):
        with pytest.raises(NotImplementedError, match="use optax.contrib.scale_by_muon for it"):
            mtx.scale_by_muon(**option)
