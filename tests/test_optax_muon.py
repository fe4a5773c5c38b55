"""mtapply.optax.muon against optax.contrib.muon: the same results (to float32 rounding), the
same state leaf for leaf (checkpoints move both ways), every option (preconditionings, preset
and per-step coefficients, dimension numbers for leaves of more axes), under jit and
optax.inject_hyperparams; the matrices of one shape take one batched product per
Newton-Schulz term, whatever leaves they come from; bad options are refused by name."""
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


def _compare(options, shapes=None, steps=4, seed=4, device="cpu", rtol=2e-5, atol=2e-6):
    """mtapply.optax.muon and optax.contrib.muon over the same steps: the same params and
    state, leaf for leaf."""
    rng = np.random.default_rng(seed)
    shapes = shapes or SHAPES

    def tree(scale):
        return jax.device_put({k: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
                               for k, s in shapes.items()}, jax.devices(device)[0])

    params, grads_seq = tree(0.1), [tree(1.0) for _ in range(steps)]
    with jax.default_matmul_precision("float32"):
        ours = _run(mtx.muon(0.02, **options), params, grads_seq)
        theirs = _run(optax.contrib.muon(0.02, **options), params, grads_seq)
    assert jax.tree.structure(ours[1]) == jax.tree.structure(theirs[1])
    _assert_close(ours, theirs, rtol, atol)
    for key in params:
        assert not np.allclose(np.asarray(ours[0][key]), np.asarray(params[key])), key
    return ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preconditioning", ["spectral", "aol", "schatten"])
def test_every_preconditioning_steps_as_optax_contrib_muon(preconditioning, device):
    """Spectral divides each matrix by its largest singular value; AOL and Schatten rescale
    X and X X^T within the first iteration (per row, or by the Frobenius norm of X X^T)."""
    _compare(dict(preconditioning=preconditioning), device=device)


@pytest.mark.parametrize("options", [
    dict(ns_coeffs="dion"), dict(ns_coeffs="standard", ns_steps=3),
    dict(ns_coeffs=((3.0, -3.2, 1.2), (2.9, -3.1, 1.2)), ns_steps=4),
    dict(ns_coeffs="dion", ns_steps=8, preconditioning="aol")],
    ids=["dion", "standard", "two rows", "dion aol"])
def test_named_and_per_step_coefficients_step_as_optax_contrib_muon(options):
    """A preset's name, or one row of coefficients a step (as many steps as rows, whatever
    ns_steps above them)."""
    _compare(options)


DIMENSION_SHAPES = {"qkv": (16, 3, 8), "heads": (4, 8, 24), "conv": (3, 3, 2, 16),
                    "w": (32, 16), "wt": (16, 16), "bias": (16,), "plain": (8, 24)}
# "wt": a square leaf whose numbers swap its axes, orthogonalized as it lies (as optax does; AOL's
# row rescaling tells), scaled by the fans its numbers give
DIMENSIONS = {"qkv": ((0,), (1, 2)), "heads": (1, 2), "conv": ((0, 1, 2), -1), "w": (0, 1),
              "wt": (1, 0), "bias": None, "plain": None}


def _dimension_numbers(spec=DIMENSIONS):
    numbers = optax.contrib.MuonDimensionNumbers
    return {k: None if v is None else numbers(*v) for k, v in spec.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, dict(consistent_rms=0.2, weight_decay=0.1),
                                     dict(preconditioning="aol", nesterov=False)],
                         ids=["defaults", "consistent_rms", "aol"])
def test_dimension_numbers_step_as_optax_contrib_muon(options, device):
    """Leaves of 3 and 4 axes as the matrices their dimension numbers make (batch axes apart,
    several reduction or output axes joined, negative axes from the end), scaled by their fans;
    a 2-D leaf whose numbers swap its axes; a leaf given None steps with AdamW."""
    if not hasattr(optax.contrib, "MuonDimensionNumbers"):
        pytest.skip("MuonDimensionNumbers needs a newer optax")
    ours = _compare(dict(muon_weight_dimension_numbers=_dimension_numbers(), **options),
                    DIMENSION_SHAPES, device=device)
    muon_state, adam_state = (ours[1].inner_states[label].inner_state for label in
                              ("muon", "adam"))
    muon_leaves = {k for k, v in muon_state[0].mu.items() if not isinstance(
        v, optax.MaskedNode)}
    assert muon_leaves == {"qkv", "heads", "conv", "w", "wt"}


def test_dimension_numbers_made_by_a_callable_or_one_for_every_leaf():
    """A callable of the params, and one MuonDimensionNumbers standing for every leaf."""
    if not hasattr(optax.contrib, "MuonDimensionNumbers"):
        pytest.skip("MuonDimensionNumbers needs a newer optax")
    numbers = optax.contrib.MuonDimensionNumbers

    def by_rank(params):
        return jax.tree.map(lambda x: numbers((x.ndim - 2,), (x.ndim - 1,)) if x.ndim >= 2
                            else None, params)

    _compare(dict(muon_weight_dimension_numbers=by_rank), DIMENSION_SHAPES)
    _compare(dict(muon_weight_dimension_numbers=numbers(-1, 0)),
             {"a": (4, 6, 12), "b": (12, 4)})


def test_matrices_of_one_shape_share_one_product_whatever_their_leaves():
    """A (4, 32, 64) leaf's 4 matrices (axis 0 a batch), a (32, 64) matrix and the 2 matrices
    of a (2, 64, 32) leaf whose numbers swap its last two axes: one batch of 7, so 3 products
    an iteration."""
    if not hasattr(optax.contrib, "MuonDimensionNumbers"):
        pytest.skip("MuonDimensionNumbers needs a newer optax")
    numbers = optax.contrib.MuonDimensionNumbers
    tree = {"stack": jnp.ones((4, 32, 64)), "a": jnp.ones((32, 64)),
            "b": jnp.ones((2, 64, 32))}
    tx = mtx.scale_by_muon(ns_steps=5, weight_dimension_numbers={
        "stack": numbers(1, 2), "a": numbers(0, 1), "b": numbers(2, 1)})
    jaxpr = jax.make_jaxpr(tx.update)(tree, tx.init(tree))
    assert str(jaxpr).count("dot_general") == 3 * 5


def test_ns_steps_through_inject_hyperparams_with_a_first_step_rescaling():
    rng = np.random.default_rng(5)
    params, grads_seq = _tree(rng, "cpu", 0.1), [_tree(rng, "cpu") for _ in range(2)]
    with jax.default_matmul_precision("float32"):
        ours, theirs = (_run(optax.inject_hyperparams(muon)(
            learning_rate=0.02, ns_steps=3, preconditioning="schatten"), params, grads_seq)
            for muon in (mtx.muon, optax.contrib.muon))
    _assert_close(ours[0], theirs[0])


def test_what_it_does_not_take_is_refused():
    with pytest.raises(ValueError, match="preconditioning='newton' is not one of frobenius"):
        mtx.muon(0.02, preconditioning="newton")
    with pytest.raises(ValueError, match="ns_coeffs='polar' is not a preset name"):
        mtx.muon(0.02, ns_coeffs="polar")
    with pytest.raises(ValueError, match="ns_coeffs has 5 rows.*more than ns_steps=3"):
        mtx.muon(0.02, ns_coeffs="dion", ns_steps=3)
    with pytest.raises(ValueError, match=r"shape \(3,\) or \(n, 3\); got shape \(2,\)"):
        mtx.muon(0.02, ns_coeffs=(3.0, -4.0))
    with pytest.raises(ValueError, match="ns_steps must be a whole number"):
        mtx.muon(0.02, ns_steps=2.5)
    for coefficients in ((3.0, float("nan"), 2.0), ((3.0, -4.0, 2.0), (float("inf"), -4.0, 2.0))):
        with pytest.raises(ValueError, match="holds a non-finite value"):
            mtx.muon(0.02, ns_coeffs=coefficients)
    with pytest.raises(ValueError, match=r"\['bias'\] has shape \(3,\): without dimension "
                                         r"numbers Muon takes matrices only"):
        mtx.scale_by_muon().init({"bias": jnp.ones(3)})
    if hasattr(optax.contrib, "MuonDimensionNumbers"):
        numbers = optax.contrib.MuonDimensionNumbers
        with pytest.raises(ValueError, match=r"\['w'\]: its dimension numbers .* name an axis "
                                             r"twice"):
            mtx.scale_by_muon(weight_dimension_numbers={"w": numbers(0, -3)}).init(
                {"w": jnp.ones((2, 3, 4))})
        with pytest.raises(ValueError, match=r"\['b'\] has shape \(5,\): Muon's leaves have "
                                             r"2 or more axes"):
            mtx.muon(0.02, muon_weight_dimension_numbers=numbers()).init(
                {"a": jnp.ones((2, 3)), "b": jnp.ones(5)})
