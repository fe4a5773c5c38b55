"""Trains a small MLP on scikit-learn's digits with optax.adamw, mtapply.optax.adamw and fused_adamw.

A 64-128-10 MLP in pure JAX (params a pytree, gradients from jax.grad), trained three times from
the same weights on the same batches, each step one `jax.jit`-ed function:

- optax.adamw, applied with optax.apply_updates (the reference);
- mtapply.optax.adamw, the same optax.GradientTransformation contract on mtapply's fused kernel;
- mtapply.optax.fused_adamw, whose `step(params, grads, state) -> (params, state)` writes the new
  params and state into the old buffers: the train step donates them (`donate_argnums`).

Prints the three loss curves, the largest gap of each mtapply curve from optax's, the largest gap
between the final parameters and the test accuracies; saves a PNG of the curves when matplotlib
is installed. Exits with status 1 when a curve disagrees with optax's beyond the tolerance below.

The digits data ship inside scikit-learn (no download). Usage:

    python examples/digits_jax.py [--device cpu|gpu] [--epochs 5] [--plot digits_jax.png]

Runs on the GPU when jax sees one (mtapply's update is then a CUDA launch on XLA's stream, which
needs CuPy), else on the CPU (mtapply's NumPy backend inside the jitted step; under a minute).
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
from _curves import relative_gaps, save_plot  # noqa: E402

# Relative tolerance on each epoch's mean training loss, as in digits_torch.py: rounding-level
# differences between two fp32 AdamW implementations stay far below it over a short run, while a
# real difference in semantics (weight decay coupled into the gradient: 0.7; bias correction one
# step off: 2e-2) moves the curves far more. Against optax the rounding-level gap is larger than
# against torch, for a reason on optax's side: it computes the bias corrections 1 - b**t in
# float32, where 1 - 0.999**t cancels (1.3e-5 relative error at t=1, 6e-7 at t=100), while
# mtapply's CPU backend computes them in float64. That moves optax's early steps by ~1e-5
# relative; the first epochs' curves differ by 2e-6 to 1e-5, and training amplifies the
# difference: with seed 0 it passes 1e-4 at epoch 14 (4e-4 at epoch 20); with seed 3 already at
# epoch 4. (A jax.numpy AdamW written as torch.optim.AdamW defines it, with float64 bias
# corrections, matches mtapply within 3e-7 over 20 epochs and optax no better than mtapply
# does; with float32 bias corrections it matches optax within 6e-6.) Hence the default of 5
# epochs here, where seeds 0, 1, 2 and 4 stay within 1e-5.
RTOL = 1e-4
NAMES = ("optax.adamw", "mtapply.optax.adamw", "mtapply.optax.fused_adamw")


def gpu_available() -> bool:
    """True when jax sees a GPU (this initializes jax's backends: call it only to decide)."""
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:  # a CPU-only jaxlib, or no driver or device
        return False


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Default resolved in select_device: asking jax for a GPU here would initialize its backends
    # before `--device cpu` could restrict them.
    parser.add_argument("--device", choices=("cpu", "gpu"), default=None,
                        help="default: gpu when jax sees one, else cpu")
    parser.add_argument("--epochs", type=int, default=5, help="default 5: see the comment at RTOL in this file")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="digits_jax.png", help="PNG path for the loss curves")
    return parser.parse_args(argv)


def select_device(args) -> jax.Device:
    """The jax device to run on; `--device cpu` keeps jax off any GPU (set before first use)."""
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        return jax.devices("cpu")[0]
    if args.device is None:
        args.device = "gpu" if gpu_available() else "cpu"
        return jax.devices(args.device)[0]
    if not gpu_available():
        sys.exit("error: --device gpu, but jax sees no GPU (install jax[cuda12], or --device cpu)")
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


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """One epoch of shuffled index batches, drawn on the host so every run sees the same order."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train(args, data, device):
    """Trains the three copies in lockstep; returns their per-epoch mean losses and params."""
    x_train, y_train = data[0], data[1]
    hyper = dict(weight_decay=args.weight_decay)
    optimizers = [optax.adamw(args.lr, **hyper), mtapply.optax.adamw(args.lr, **hyper),
                  mtapply.optax.fused_adamw(args.lr, **hyper)]
    steps = [transformation_step(optimizers[0]), transformation_step(optimizers[1]),
             fused_step(optimizers[2])]
    start = init_params(args.seed, device)
    # Each run its own copy: the fused step donates (invalidates) the arrays it is given.
    params = [jax.tree.map(jnp.copy, start) for _ in steps]
    states = [optimizer.init(p) for optimizer, p in zip(optimizers, params)]
    rng = np.random.default_rng(args.seed)
    curves = ([], [], [])
    for _ in range(args.epochs):
        sums = [jnp.zeros((), jnp.float32) for _ in steps]
        epoch = batches(len(x_train), args.batch_size, rng)
        for index in epoch:
            index = jax.device_put(index, device)
            x, y = x_train[index], y_train[index]
            for k, step in enumerate(steps):
                params[k], states[k], loss = step(params[k], states[k], x, y)
                sums[k] = sums[k] + loss  # stays on the device: no sync per step
        for curve, total in zip(curves, sums):  # one host read per epoch
            curve.append(float(total) / len(epoch))
    return curves, params


def accuracy(params, x, y) -> float:
    return float((forward(params, x).argmax(axis=1) == y).mean())


def max_param_gap(a, b) -> float:
    return max(float(jnp.abs(p - q).max()) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def report(args, device, curves, params, data) -> bool:
    """Prints the curves, the gaps and the accuracies; True when both mtapply curves agree with
    optax's."""
    ref = curves[0]
    gaps = [relative_gaps(ref, curve) for curve in curves[1:]]
    print(f"device={args.device} ({device}) epochs={args.epochs} lr={args.lr} "
          f"weight_decay={args.weight_decay}")
    print(f"{'epoch':>5} {NAMES[0]:>12} {NAMES[1]:>20} {'rel. gap':>9} {NAMES[2]:>26} "
          f"{'rel. gap':>9}")
    for epoch, (a, b, gap_b, c, gap_c) in enumerate(
            zip(ref, curves[1], gaps[0], curves[2], gaps[1]), start=1):
        print(f"{epoch:>5} {a:>12.7f} {b:>20.7f} {gap_b:>9.2e} {c:>26.7f} {gap_c:>9.2e}")
    for name, curve, gap, final in zip(NAMES[1:], curves[1:], gaps, params[1:]):
        print(f"{name}: max |loss gap| = {max(abs(a - b) for a, b in zip(ref, curve)):.3e} "
              f"(relative {max(gap):.3e}, tolerance {RTOL:g}); max |parameter gap| after "
              f"training = {max_param_gap(params[0], final):.3e}")
    x_test, y_test = data[2], data[3]
    print("test accuracy: " + ", ".join(f"{name} {accuracy(p, x_test, y_test):.4f}"
                                        for name, p in zip(NAMES, params)))
    return all(max(gap) <= RTOL for gap in gaps)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = select_device(args)
    data = load_data(args.seed, device)
    curves, params = train(args, data, device)
    agree = report(args, device, curves, params, data)
    if args.plot:
        save_plot(args.plot, list(curves), list(NAMES), f"digits, 64-128-10 MLP, {args.device}",
                  RTOL)
    print("OK: the loss curves agree" if agree else "FAIL: the loss curves disagree")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
