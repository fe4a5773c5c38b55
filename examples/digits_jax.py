"""Trains a small MLP on scikit-learn's digits with optax.adamw, mtapply.optax.adamw and fused_adamw.

A 64-128-10 MLP in pure JAX (params a pytree, gradients from jax.grad), trained three times from
the same weights on the same batches, each step one `jax.jit`-ed function:

- optax.adamw, applied with optax.apply_updates (the reference);
- mtapply.optax.adamw, the same optax.GradientTransformation contract on mtapply's fused kernel;
- mtapply.optax.fused_adamw, whose `step(params, grads, state) -> (params, state)` writes the new
  params and state into the old buffers: the train step donates them (`donate_argnums`).

At every step, mtapply's two forms also step from optax's own params, state and grads, and their
new params and moments must equal optax's up to float32 rounding (the bound at `step_bound`).
Prints the three loss curves and their gaps, the worst step of each mtapply form as a fraction of
the bound, the largest gap between the final parameters and the test accuracies; saves a PNG of
the curves when matplotlib is installed. Exits with status 1 when a step leaves the bound.

The digits data ship inside scikit-learn (no download). Usage:

    python examples/digits_jax.py [--device cpu|cuda] [--epochs 20] [--seed 0] [--out examples/out]

Runs on the GPU when jax sees one (mtapply's update is then a CUDA launch on XLA's stream, which
needs CuPy), else on the CPU (mtapply's NumPy backend inside the jitted step; under a minute).
`--device gpu` is taken as `--device cuda`.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys

import numpy as np

# Before jax is imported: XLA would otherwise take most of the GPU's memory up front, leaving
# little to the CuPy pool that mtapply's launches use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mtapply.optax  # noqa: E402
from _curves import (add_out_argument, output_path, parser_for, relative_gaps,  # noqa: E402
                     save_plot)

# The check. Independent runs of two correct float32 AdamWs drift apart as training amplifies
# their rounding differences (and optax's: it computes the bias corrections 1 - b**t in float32,
# 1e-5 relative error at t=1, where mtapply computes them in float64), so how far apart their loss
# curves end up depends on the seed and the length of the run, and no tolerance on the curves
# holds for every run. What holds is a bound on one step: at every step, mtapply's two forms step
# from optax's own params, state and grads, and each new param and moment must lie within what
# float32 rounding allows of optax's (`step_bound`). The curves are printed and plotted beside.
U = 2.0 ** -24  # float32's unit roundoff
# XLA flushes subnormal float32 results to zero, and mtapply keeps them (as torch does), so a
# rounding near zero may differ by up to the smallest normal number.
TINY = 2.0 ** -126
# Roundings of one element in one AdamW step, counted generously: the moment updates (2 each),
# the bias-corrected ratio (a division, a square root, an addition, a division), the weight decay
# and the param update (2 each), the update's own rounding and apply_updates (1 each).
ROUNDINGS = 16
B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adamw's defaults, which all three runs take
NAMES = ("optax.adamw", "mtapply.optax.adamw", "mtapply.optax.fused_adamw")


def gpu_available() -> bool:
    """True when jax sees a GPU (this initializes jax's backends: call it only to decide)."""
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:  # a CPU-only jaxlib, or no driver or device
        return False


def parse_args(argv=None) -> argparse.Namespace:
    parser = parser_for(__doc__)
    # Default resolved in select_device: asking jax for a GPU here would initialize its backends
    # before `--device cpu` could restrict them. "gpu" (jax's name) is taken as "cuda".
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        type=lambda name: "cuda" if name == "gpu" else name,
                        help="where to run (default: cuda when jax sees a GPU, else cpu)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    return parser.parse_args(argv)


def select_device(args) -> jax.Device:
    """The jax device to run on; `--device cpu` keeps jax off any GPU (set before first use)."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        return jax.devices("cpu")[0]
    if args.device is None:
        args.device = "cuda" if gpu_available() else "cpu"
        return jax.devices("gpu" if args.device == "cuda" else "cpu")[0]
    if not gpu_available():
        sys.exit("error: --device cuda, but jax sees no GPU (install jax[cuda12], or --device cpu)")
    return jax.devices("gpu")[0]


def load_data(seed: int, device: jax.Device):
    """The digits (8x8 images, 10 classes) on `device`, split 75/25 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixels are 0..16; unit scale suits the init and the learning rate
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed,
                                                        stratify=y)
    as_x = lambda a: jax.device_put(np.asarray(a, dtype=np.float32), device)
    as_y = lambda a: jax.device_put(np.asarray(a, dtype=np.int32), device)
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def init_params(seed: int, device: jax.Device) -> dict:
    """{w1, b1, w2, b2}, uniform in +-1/sqrt(fan_in) as torch.nn.Linear draws them.

    jax's PRNG gives the same numbers on every backend, so CPU and GPU start alike.
    """
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {}
    for layer, (fan_in, fan_out) in enumerate(((64, 128), (128, 10)), start=1):
        bound = 1.0 / math.sqrt(fan_in)
        k_w, k_b = keys[2 * layer - 2], keys[2 * layer - 1]
        params[f"w{layer}"] = jax.random.uniform(k_w, (fan_in, fan_out), jnp.float32, -bound, bound)
        params[f"b{layer}"] = jax.random.uniform(k_b, (fan_out,), jnp.float32, -bound, bound)
    return jax.device_put(params, device)


def forward(params: dict, x):
    """The logits."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_fn(params: dict, x, y):
    """The batch's mean cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()


def transformation_step(tx: optax.GradientTransformation):
    """A jitted train step for an optax.GradientTransformation: (params, state, x, y) ->
    (params, state, loss). The update goes through optax.apply_updates, as optax's users write."""

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def fused_step(opt: mtapply.optax.FusedOptimizer):
    """The same for a fused optimizer: params and state are donated, so the step writes the new
    values into their buffers (the arrays passed in are invalid afterwards)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, state = opt.step(params, grads, state)
        return params, state, loss

    return step


def bias_correction_error(decay: float, t):
    """A bound on the relative error of optax's bias correction 1 - decay**t in float32: decay
    is rounded to float32 (u), the power carries that error t times and adds roundings of its
    own (by squaring, 2 log2(t) u; through exp and log, a few u and t |log decay| u), at most
    (2t + 8) u in all, and 1 - decay**t turns the absolute error of decay**t into a relative
    one (mtapply takes decay**t in float64 and rounds the correction once)."""
    power = decay ** t
    return (2 * t + 8) * U * power / (1 - power) + U


def step_bound(lr: float, weight_decay: float, t, p, g, m, v, new_p):
    """Elementwise bounds on how far apart two correct float32 AdamW steps from the same param
    p, grad g and moments m, v (step t) may put the new param and moments: ROUNDINGS units of
    roundoff of the magnitudes each rounds (and as many of TINY, where a value rounds near zero:
    g * g, say), and optax's float32 bias corrections (mtapply's are exact to float32).

    The new moment m' = b1 m + (1 - b1) g may cancel, so its error is relative to
    |b1 m| + |(1 - b1) g|, not to |m'|; the update m'/(1 - b1**t) / (sqrt(v'/(1 - b2**t)) + eps)
    carries that error scaled like the update (`size`, at least |update|), the bias corrections'
    errors (the second's halved by the root), and its own roundings. The param adds the weight
    decay's and its own roundings. A semantic error (a step count one off, the weight decay
    left out) moves the params far more: see tests/test_examples.py."""
    m_terms = B1 * jnp.abs(m) + (1 - B1) * jnp.abs(g)
    v_terms = B2 * v + (1 - B2) * g * g
    size = m_terms / (1 - B1 ** t) / (jnp.sqrt(v_terms / (1 - B2 ** t)) + EPS)
    relative = ROUNDINGS * U + bias_correction_error(B1, t) + bias_correction_error(B2, t) / 2
    param = (lr * size * relative + lr * weight_decay * jnp.abs(p) * ROUNDINGS * U
             + ROUNDINGS * U * (jnp.abs(p) + jnp.abs(new_p)))
    return tuple(bound + ROUNDINGS * TINY for bound in (
        param, ROUNDINGS * U * m_terms, ROUNDINGS * U * v_terms))


def worst_ratio(bounds, reference: tuple, candidate: tuple):
    """The largest |candidate - reference| / bound over every element of the new params and
    moments: at most 1 when the candidate's step is optax's up to float32 rounding."""
    worst = jnp.zeros((), jnp.float32)
    for bound, ref, new in zip(bounds, reference, candidate):
        for b, r, c in zip(jax.tree.leaves(bound), jax.tree.leaves(ref), jax.tree.leaves(new)):
            gap = jnp.abs(c - r)  # equal values pass where the bound is 0 (a moment still zero)
            worst = jnp.maximum(worst, jnp.where(gap == 0, 0.0, gap / b).max())
    return worst


def checked_step(args, reference, transformation, fused):
    """optax's train step, (params, state, x, y) -> (params, state, loss, ratios), that also
    runs mtapply's transformation and fused step from optax's params, state and grads, and
    gives the worst ratio of each to `step_bound` (float32 rounding)."""

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, new_state = reference.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        adam, new_adam = state[0], new_state[0]  # optax.adamw: scale_by_adam comes first
        ours = mtapply.optax.flat_state(mtapply.optax.AdamState(adam.count, adam.mu, adam.nu),
                                        params)
        deltas, by_transformation = transformation.update(grads, ours, params)
        by_fused = fused.step(params, grads, ours)
        candidates = [(optax.apply_updates(params, deltas), by_transformation), by_fused]
        t = (adam.count + 1).astype(jnp.float32)
        bounds = jax.tree.transpose(
            jax.tree.structure(params), jax.tree.structure((0, 0, 0)),
            jax.tree.map(functools.partial(step_bound, args.lr, args.weight_decay, t),
                         params, grads, adam.mu, adam.nu, new_params))
        ratios = []
        for new_params_k, new_state_k in candidates:
            tree = mtapply.optax.tree_state(new_state_k, params)
            ratios.append(worst_ratio(bounds, (new_params, new_adam.mu, new_adam.nu),
                                      (new_params_k, tree.mu, tree.nu)))
        return new_params, new_state, loss, jnp.stack(ratios)

    return step


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """One epoch of shuffled index batches, drawn on the host so every run sees the same order."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train(args, data, device):
    """Trains the three copies in lockstep; returns their per-epoch mean losses, their params,
    and the worst ratio to `step_bound` of each mtapply form's steps from optax's."""
    x_train, y_train = data[0], data[1]
    hyper = dict(weight_decay=args.weight_decay)
    optimizers = [optax.adamw(args.lr, **hyper), mtapply.optax.adamw(args.lr, **hyper),
                  mtapply.optax.fused_adamw(args.lr, **hyper)]
    steps = [checked_step(args, *optimizers), transformation_step(optimizers[1]),
             fused_step(optimizers[2])]
    start = init_params(args.seed, device)
    # Each run its own copy: the fused step donates (invalidates) the arrays it is given.
    params = [jax.tree.map(jnp.copy, start) for _ in steps]
    states = [optimizer.init(p) for optimizer, p in zip(optimizers, params)]
    rng = np.random.default_rng(args.seed)
    curves = ([], [], [])
    worst = jnp.zeros(2, jnp.float32)
    for _ in range(args.epochs):
        sums = [jnp.zeros((), jnp.float32) for _ in steps]
        epoch = batches(len(x_train), args.batch_size, rng)
        for index in epoch:
            index = jax.device_put(index, device)
            x, y = x_train[index], y_train[index]
            params[0], states[0], loss, ratios = steps[0](params[0], states[0], x, y)
            worst = jnp.maximum(worst, ratios)  # stays on the device: no sync per step
            sums[0] = sums[0] + loss
            for k in (1, 2):
                params[k], states[k], loss = steps[k](params[k], states[k], x, y)
                sums[k] = sums[k] + loss
        for curve, total in zip(curves, sums):  # one host read per epoch
            curve.append(float(total) / len(epoch))
    return curves, params, [float(r) for r in worst]


def accuracy(params, x, y) -> float:
    return float((forward(params, x).argmax(axis=1) == y).mean())


def max_param_gap(a, b) -> float:
    return max(float(jnp.abs(p - q).max()) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def report(args, device, curves, params, ratios, data) -> bool:
    """Prints the curves, the gaps, the worst step ratios and the accuracies; True when every
    step of both mtapply forms is optax's up to float32 rounding."""
    ref = curves[0]
    gaps = [relative_gaps(ref, curve) for curve in curves[1:]]
    print(f"device={args.device} ({device}) epochs={args.epochs} lr={args.lr} "
          f"weight_decay={args.weight_decay} seed={args.seed}")
    print(f"{'epoch':>5} {NAMES[0]:>12} {NAMES[1]:>20} {'rel. gap':>9} {NAMES[2]:>26} "
          f"{'rel. gap':>9}")
    for epoch, (a, b, gap_b, c, gap_c) in enumerate(
            zip(ref, curves[1], gaps[0], curves[2], gaps[1]), start=1):
        print(f"{epoch:>5} {a:>12.7f} {b:>20.7f} {gap_b:>9.2e} {c:>26.7f} {gap_c:>9.2e}")
    for name, gap, final, ratio in zip(NAMES[1:], gaps, params[1:], ratios):
        print(f"{name}: each step from optax's params and state within {ratio:.3f} of the "
              f"float32 rounding bound (at most 1 passes); independent run: max relative loss "
              f"gap {max(gap):.3e}, max |parameter gap| after training "
              f"{max_param_gap(params[0], final):.3e}")
    x_test, y_test = data[2], data[3]
    print("test accuracy: " + ", ".join(f"{name} {accuracy(p, x_test, y_test):.4f}"
                                        for name, p in zip(NAMES, params)))
    return all(ratio <= 1 for ratio in ratios)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = select_device(args)
    data = load_data(args.seed, device)
    curves, params, ratios = train(args, data, device)
    agree = report(args, device, curves, params, ratios, data)
    save_plot(output_path(args.out, "digits_jax.png"), list(curves), list(NAMES),
              f"digits, 64-128-10 MLP, {args.device}")
    steps = args.epochs * math.ceil(len(data[0]) / args.batch_size)
    print(f"{'OK' if agree else 'FAIL'}: at each of {steps} steps from optax.adamw's params and "
          f"state, the new params and moments of mtapply.optax.adamw and fused_adamw are "
          f"{'within' if agree else 'NOT within'} float32 rounding of optax.adamw's (worst "
          f"elements at {ratios[0]:.3f} and {ratios[1]:.3f} of the bound, {ROUNDINGS} roundings "
          f"of each value plus optax's float32 bias corrections; at most 1 passes)")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
