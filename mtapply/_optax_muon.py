"""mtapply.optax.muon: optax.contrib.muon with the Newton-Schulz products of every matrix of one
shape run as one batch.

optax.contrib.muon orthogonalizes leaf by leaf; here the momentum's matrices are grouped by
shape and dtype (transposes apart: a tall matrix is orthogonalized as its transpose, as optax
does), stacked, and each group takes one batched product per Newton-Schulz term. A leaf of
more axes is the stack of matrices its dimension numbers make (`_muon_dimensions`), and joins
the group of that matrix shape. The rest (the momentum and its bias correction, the shape
scaling, weight decay, the learning rate, AdamW for the other leaves) is optax's own, so that
the state is optax.contrib.muon's, leaf for leaf, and checkpoints move between the two. Under
jit XLA fuses the elementwise parts itself; what batching saves is the launches and the small
products of many matrices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonState

from ._muon_dimensions import MATRIX, as_matrices, fans, from_matrices, leaf_axes, leaf_specs

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# optax.contrib.muon's named coefficients: Dion's are one row a step
NS_PRESETS = {"standard": NS_COEFFICIENTS,
              "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                       (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                       (2.8366, -3.0525, 1.2012))}
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
RESCALING_FLOOR = 1e-8  # the floor of AOL's and Schatten's first-step rescaling (not `eps`)


def scale_by_muon(ns_coeffs=NS_COEFFICIENTS, ns_steps: int = 5, beta=0.95, eps=1e-8,
                  mu_dtype=None, *, nesterov: bool = True, adaptive: bool = False,
                  preconditioning: str = "frobenius",
                  weight_dimension_numbers=None) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon with the matrices of one shape orthogonalized as one batch;
    the same state, `MuonState(count, mu, ns_coeffs)`. `weight_dimension_numbers`: None (every
    leaf a matrix), or optax.contrib.MuonDimensionNumbers for the leaves (one for all, a tree
    of them with None for a matrix's default, or a callable making that tree from the
    updates)."""
    _check_preconditioning(preconditioning)
    ns_coeffs = _coefficients(ns_coeffs, ns_steps)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init(params):
        leaf_axes(weight_dimension_numbers, params, "mtapply.optax.scale_by_muon")
        return MuonState(count=jnp.zeros([], jnp.int32),
                         mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                         ns_coeffs=jnp.asarray(ns_coeffs))

    def update(updates, state, params=None):
        del params
        axes = leaf_axes(weight_dimension_numbers, updates, "mtapply.optax.scale_by_muon")
        # optax orthogonalizes a 2-D leaf as it lies, whatever its dimension numbers (which
        # still give its fans to scale_by_shape): for a square leaf whose numbers swap its
        # axes, AOL's row rescaling tells (a non-square one is taken on its wide side anyway)
        axes = [MATRIX if len(leaf.shape) == 2 else leaf_axis
                for leaf, leaf_axis in zip(jax.tree.leaves(updates), axes)]
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta,
                                                             optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        orthogonal = orthogonalize_by_shape(mu_hat, axes, state.ns_coeffs, ns_steps, eps,
                                            preconditioning)
        if adaptive:
            orthogonal = jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat,
                                      orthogonal)
        return orthogonal, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype),
                                     ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def orthogonalize_by_shape(tree, axes: list, coefficients, steps, eps,
                           preconditioning: str = "frobenius"):
    """Newton-Schulz (`steps` quintic iterations, or one a row of 2-D `coefficients`) of every
    matrix of `tree`'s leaves (each leaf the matrices its `axes` make), the matrices of one
    shape and dtype stacked into one batch."""
    leaves, treedef = jax.tree.flatten(tree)
    stacks = [as_matrices(leaf, leaf_axis) for leaf, leaf_axis in zip(leaves, axes)]
    groups: dict = {}
    for k, stack in enumerate(stacks):
        groups.setdefault((stack.shape[1:], stack.dtype), []).append(k)
    out = list(leaves)
    for members in groups.values():
        batch = jnp.concatenate([stacks[k] for k in members])
        done = _newton_schulz(batch, coefficients, steps, eps, preconditioning)
        start = 0
        for k in members:
            count = stacks[k].shape[0]
            out[k] = from_matrices(done[start:start + count], leaves[k].shape, axes[k])
            start += count
    return treedef.unflatten(out)


def _newton_schulz(x, coefficients, steps, eps, preconditioning: str):
    """The iteration on a (batch, rows, cols) stack: X <- c0 X + (c1 A + c2 A A) X with
    A = X X^H, on the wide side (a tall stack as its transpose). Frobenius and spectral
    preconditioning divide X by its norm first; AOL and Schatten rescale X and A within the
    first iteration."""
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    if preconditioning in ("frobenius", "spectral"):
        order = "fro" if preconditioning == "frobenius" else 2
        x = x / (jnp.linalg.norm(x, ord=order, axis=(1, 2), keepdims=True) + eps)
    c = coefficients.astype(x.dtype)

    def iteration(x, c, first: bool):
        a = x @ jnp.swapaxes(x, 1, 2).conj()
        if first:
            x, a = _rescaled(x, a, preconditioning)
        return c[0] * x + (c[1] * a + c[2] * a @ a) @ x

    rescales = preconditioning in ("aol", "schatten")
    if c.ndim == 2:  # a row of coefficients a step
        for k in range(c.shape[0]):
            x = iteration(x, c[k], rescales and k == 0)
    elif isinstance(steps, int):  # unrolled
        for k in range(steps):
            x = iteration(x, c, rescales and k == 0)
    else:  # a step count traced under jit (optax.inject_hyperparams): a loop
        start = 0
        if rescales:
            x = jax.lax.cond(steps > 0, lambda x: iteration(x, c, True), lambda x: x, x)
            start = 1
        x = jax.lax.fori_loop(start, jnp.maximum(steps, start),
                              lambda _, x: iteration(x, c, False), x)
    return jnp.swapaxes(x, 1, 2) if tall else x


def _rescaled(x, a, preconditioning: str) -> tuple:
    """X and A = X X^H rescaled in the first iteration: AOL scales row i by
    1/sqrt(sum_j |A_ij|) (A on both sides), Schatten every matrix by 1/sqrt(||A||_F)
    (optax takes that A without the conjugate)."""
    if preconditioning == "aol":
        s = jax.lax.rsqrt(jnp.maximum(jnp.abs(a).sum(axis=-1), RESCALING_FLOOR))[..., None]
        return x * s, a * s * jnp.swapaxes(s, 1, 2)
    if jnp.iscomplexobj(x):
        a = x @ jnp.swapaxes(x, 1, 2)
    s = jax.lax.rsqrt(jnp.maximum(jnp.linalg.norm(a, axis=(1, 2)), RESCALING_FLOOR))
    s = s[:, None, None]
    return x * s, a * s ** 2


def scale_by_shape(weight_dimension_numbers=None,
                   consistent_rms=None) -> optax.GradientTransformation:
    """optax.contrib's scale_by_shape for Muon's leaves (fan_in and fan_out from each leaf's
    dimension numbers, a matrix's rows and columns by default): sqrt(max(1, fan_out /
    fan_in)), or sqrt(max(fan_in, fan_out)) * consistent_rms."""

    def scale(update, leaf_axis):
        fan_in, fan_out = fans(update.shape, leaf_axis)
        if consistent_rms is None:
            return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * update
        return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * update

    def update(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        axes = leaf_axes(weight_dimension_numbers, updates, "mtapply.optax.muon")
        return treedef.unflatten([scale(u, a) for u, a in zip(leaves, axes)]), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def muon(learning_rate, ns_coeffs=NS_COEFFICIENTS, ns_steps: int = 5, beta=0.95, eps=1e-8,
         weight_decay=0.0, weight_decay_mask=None, mu_dtype=None, *, nesterov: bool = True,
         adaptive: bool = False, preconditioning: str = "frobenius", adam_b1=0.9,
         adam_b2=0.999, adam_eps_root=0.0, adam_weight_decay=0.0, adam_learning_rate=None,
         muon_weight_dimension_numbers=None,
         consistent_rms=None) -> optax.GradientTransformation:
    """optax.contrib.muon (its arguments, semantics and state) with the Newton-Schulz products
    of every matrix of one shape run as one batch (see the module docstring): Muon for the 2-D
    leaves, or for the leaves `muon_weight_dimension_numbers` gives dimension numbers (None
    leaves out), optax's AdamW for the others."""
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    dimensions = muon_weight_dimension_numbers

    def labels(params):
        if dimensions is None:
            return jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)
        return jax.tree.structure(params).unflatten(
            ["adam" if spec is None else "muon" for spec in leaf_specs(dimensions, params)])

    return optax.partition(
        {"muon": optax.chain(
            scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
                          adaptive=adaptive, preconditioning=preconditioning,
                          weight_dimension_numbers=dimensions),
            scale_by_shape(dimensions, consistent_rms),
            optax.add_decayed_weights(weight_decay, weight_decay_mask),
            optax.scale_by_learning_rate(learning_rate)),
         "adam": optax.adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                             eps_root=adam_eps_root, weight_decay=adam_weight_decay,
                             mu_dtype=mu_dtype, nesterov=nesterov)},
        labels)


def _check_preconditioning(preconditioning) -> None:
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"mtapply.optax.muon: preconditioning={preconditioning!r} is not one "
                         f"of {', '.join(PRECONDITIONINGS)}")


def _coefficients(coefficients, steps):
    """Newton-Schulz's coefficients as the state keeps them: (a, b, c) for every step, or a
    row a step (a preset's name resolved); checked with `steps`."""
    if isinstance(coefficients, str):
        if coefficients not in NS_PRESETS:
            raise ValueError(f"mtapply.optax.muon: ns_coeffs={coefficients!r} is not a preset "
                             f"name (one of {', '.join(NS_PRESETS)}) nor coefficients")
        coefficients = NS_PRESETS[coefficients]
    if isinstance(steps, bool) or not (
            isinstance(steps, int) and steps >= 0
            or hasattr(steps, "dtype") and jnp.ndim(steps) == 0
            and jnp.issubdtype(steps.dtype, jnp.integer)):
        raise ValueError(f"mtapply.optax.muon: ns_steps must be a whole number >= 0, got "
                         f"{steps!r}")
    shape = jnp.shape(jnp.asarray(coefficients))
    if len(shape) not in (1, 2) or shape[-1] != 3:
        raise ValueError(f"mtapply.optax.muon: ns_coeffs must be (a, b, c) or one such row a "
                         f"step, shape (3,) or (n, 3); got shape {shape}")
    try:
        finite = np.isfinite(np.asarray(coefficients, np.float64)).all()
    except jax.errors.TracerArrayConversionError:  # traced: checked by no one, as in optax
        finite = True
    if not finite:
        raise ValueError(f"mtapply.optax.muon: ns_coeffs={coefficients!r} holds a non-finite "
                         f"value, which would make every update NaN: give finite numbers")
    if len(shape) == 2 and isinstance(steps, int) and shape[0] > steps:
        raise ValueError(f"mtapply.optax.muon: ns_coeffs has {shape[0]} rows, one a step, "
                         f"more than ns_steps={steps}: give at most ns_steps rows (they are "
                         f"the steps taken, whatever ns_steps)")
    return coefficients
