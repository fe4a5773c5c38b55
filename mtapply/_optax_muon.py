"""mtapply.optax.muon: optax.contrib.muon with the Newton-Schulz products of every matrix of one
shape run as one batch.

optax.contrib.muon orthogonalizes leaf by leaf; here the momentum's matrices are grouped by
shape and dtype (transposes apart: a tall matrix is orthogonalized as its transpose, as optax
does), stacked, and each group takes one batched product per Newton-Schulz term. The rest (the
momentum and its bias correction, the shape scaling, weight decay, the learning rate, AdamW for
the other leaves) is optax's own, so that the state is optax.contrib.muon's, leaf for leaf, and
checkpoints move between the two. Under jit XLA fuses the elementwise parts itself; what
batching saves is the launches and the small products of many matrices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonState

from ._optax_make import _refuse

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def scale_by_muon(ns_coeffs=NS_COEFFICIENTS, ns_steps: int = 5, beta=0.95, eps=1e-8,
                  mu_dtype=None, *, nesterov: bool = True, adaptive: bool = False,
                  preconditioning: str = "frobenius",
                  weight_dimension_numbers=None) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon (Frobenius preconditioning, 2-D leaves) with the matrices of
    one shape orthogonalized as one batch; the same state, `MuonState(count, mu, ns_coeffs)`.
    Other preconditionings and weight_dimension_numbers are refused naming
    optax.contrib.scale_by_muon."""
    _refuse("scale_by_muon", "optax.contrib.scale_by_muon",
            preconditioning=(preconditioning, "frobenius"),
            weight_dimension_numbers=(weight_dimension_numbers, None))
    _check_coefficients(ns_coeffs, ns_steps)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init(params):
        _check_matrices(params)
        return MuonState(count=jnp.zeros([], jnp.int32),
                         mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                         ns_coeffs=jnp.asarray(ns_coeffs))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta,
                                                             optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        orthogonal = orthogonalize_by_shape(mu_hat, state.ns_coeffs, ns_steps, eps)
        if adaptive:
            orthogonal = jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat,
                                      orthogonal)
        return orthogonal, MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype),
                                     ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def orthogonalize_by_shape(tree, coefficients, steps: int, eps):
    """Newton-Schulz (Frobenius-normalized, `steps` quintic iterations) of every matrix leaf of
    `tree`, the leaves of one shape and dtype stacked into one batch."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict = {}
    for k, leaf in enumerate(leaves):
        groups.setdefault((leaf.shape, leaf.dtype), []).append(k)
    out = list(leaves)
    for members in groups.values():
        done = _newton_schulz(jnp.stack([leaves[k] for k in members]), coefficients, steps, eps)
        for j, k in enumerate(members):
            out[k] = done[j]
    return treedef.unflatten(out)


def _newton_schulz(x, coefficients, steps: int, eps):
    """The iteration on a (batch, rows, cols) stack: X <- c0 X + (c1 A + c2 A A) X with
    A = X X^H, on the wide side (a tall stack as its transpose)."""
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    x = x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + eps)
    c = coefficients.astype(x.dtype)

    def iteration(_, x):
        a = x @ jnp.swapaxes(x, 1, 2).conj()
        return c[0] * x + (c[1] * a + c[2] * a @ a) @ x

    if isinstance(steps, int):  # unrolled
        for k in range(steps):
            x = iteration(k, x)
    else:  # a step count traced under jit (optax.inject_hyperparams): a loop
        x = jax.lax.fori_loop(0, steps, iteration, x)
    return jnp.swapaxes(x, 1, 2) if tall else x


def scale_by_shape(consistent_rms=None) -> optax.GradientTransformation:
    """optax.contrib's scale_by_shape for matrices (fan_in the rows, fan_out the columns):
    sqrt(max(1, fan_out / fan_in)), or sqrt(max(fan_in, fan_out)) * consistent_rms."""

    def scale(update):
        fan_in, fan_out = update.shape
        if consistent_rms is None:
            return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * update
        return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * update

    def update(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def muon(learning_rate, ns_coeffs=NS_COEFFICIENTS, ns_steps: int = 5, beta=0.95, eps=1e-8,
         weight_decay=0.0, weight_decay_mask=None, mu_dtype=None, *, nesterov: bool = True,
         adaptive: bool = False, preconditioning: str = "frobenius", adam_b1=0.9,
         adam_b2=0.999, adam_eps_root=0.0, adam_weight_decay=0.0, adam_learning_rate=None,
         muon_weight_dimension_numbers=None,
         consistent_rms=None) -> optax.GradientTransformation:
    """optax.contrib.muon (its arguments, semantics and state) with the Newton-Schulz products
    of every matrix of one shape run as one batch (see the module docstring): Muon for the 2-D
    leaves, optax's AdamW for the others. Not supported here, each refused naming
    optax.contrib.muon: preconditioning other than "frobenius", ns_coeffs as a preset name or
    per-step rows, muon_weight_dimension_numbers."""
    _refuse("muon", "optax.contrib.muon", preconditioning=(preconditioning, "frobenius"),
            muon_weight_dimension_numbers=(muon_weight_dimension_numbers, None))
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate

    def labels(params):
        return jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)

    return optax.partition(
        {"muon": optax.chain(
            scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
                          adaptive=adaptive),
            scale_by_shape(consistent_rms),
            optax.add_decayed_weights(weight_decay, weight_decay_mask),
            optax.scale_by_learning_rate(learning_rate)),
         "adam": optax.adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                             eps_root=adam_eps_root, weight_decay=adam_weight_decay,
                             mu_dtype=mu_dtype, nesterov=nesterov)},
        labels)


def _check_coefficients(coefficients, steps) -> None:
    if isinstance(coefficients, str) or jnp.ndim(jnp.asarray(coefficients)) != 1 or len(
            coefficients) != 3:
        raise NotImplementedError(
            f"mtapply.optax.muon: ns_coeffs={coefficients!r} is not supported (only three "
            f"numbers (a, b, c) for every step); use optax.contrib.muon for presets and per-step "
            f"coefficients")
    if isinstance(steps, bool) or not (
            isinstance(steps, int) and steps >= 0
            or hasattr(steps, "dtype") and jnp.ndim(steps) == 0
            and jnp.issubdtype(steps.dtype, jnp.integer)):
        raise ValueError(f"mtapply.optax.muon: ns_steps must be a whole number >= 0, got "
                         f"{steps!r}")


def _check_matrices(params) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if jnp.ndim(leaf) != 2:
            raise ValueError(f"mtapply.optax.scale_by_muon takes matrices only: "
                             f"{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}")
