"""Trains a small MLP on scikit-learn's digits with CuPy arrays only, updated by mtapply.adam_plan.

A 64-128-10 MLP with a hand-written forward and backward pass, trained twice from the same
weights on the same batches: once with an `mtapply.adam_plan` (AdamW, one fused launch per step)
and once with AdamW written in plain array operations as torch.optim.AdamW defines it. Prints
both loss curves, their largest gap, the largest gap between the final parameters and both test
accuracies; saves a PNG of the curves when matplotlib is installed. Exits with status 1 when an
epoch's mean training losses differ by more than 1e-4 (relative).

On the GPU (`--device cuda`, which needs CuPy) everything runs on one non-blocking CuPy stream.
`--device cpu` runs the same code with NumPy in place of CuPy (mtapply's NumPy backend), with no
GPU or CuPy needed. The digits
data ship inside scikit-learn (no download). Usage:

    python examples/digits_cupy.py [--device cpu|cuda] [--epochs 20] [--out examples/out]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys

import numpy as np

import mtapply
from _curves import (add_device_argument, add_out_argument, output_path, parser_for,
                     relative_gaps, save_plot)

# Relative tolerance on each epoch's mean training loss: fp32 rounding differences between the
# fused kernel and the one-operation-per-line reference are about 1e-7 relative per step, and
# stay far below 1e-4 over a short training run; a real difference in semantics (coupled weight
# decay, bias correction one step off) moves the curves by 1e-2 or more. See digits_torch.py.
RTOL = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver or no device all mean: use the CPU
        return False


def parse_args(argv=None) -> argparse.Namespace:
    parser = parser_for(__doc__)
    add_device_argument(parser, gpu_available())
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not gpu_available():
        parser.error("--device cuda needs CuPy and a CUDA device, and CuPy is not installed or "
                     "sees no device: use --device cpu (NumPy), or install cupy-cuda12x or "
                     "cupy-cuda13x")
    return args


def array_module(device: str):
    """CuPy on the GPU, NumPy on the CPU: the rest of the script is written against either."""
    if device == "cpu":
        return np
    import cupy

    return cupy


def load_data(xp, seed: int):
    """The digits (8x8 images, 10 classes) as float32 arrays, split 75/25 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixels are 0..16; unit scale suits the init and the learning rate
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed,
                                                        stratify=y)
    as_x = lambda a: xp.asarray(a, dtype=xp.float32)
    as_y = lambda a: xp.asarray(a, dtype=xp.int64)
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def init_params(xp, seed: int) -> list:
    """[w1, b1, w2, b2], uniform in +-1/sqrt(fan_in) as torch.nn.Linear draws them.

    Drawn with NumPy on the host so that the CPU and the GPU start from the same weights.
    """
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in ((64, 128), (128, 10)):
        bound = 1.0 / math.sqrt(fan_in)
        params.append(rng.uniform(-bound, bound, (fan_in, fan_out)))
        params.append(rng.uniform(-bound, bound, fan_out))
    return [xp.asarray(p, dtype=xp.float32) for p in params]


def forward(xp, params, x):
    """Hidden pre-activations, hidden activations and logits."""
    w1, b1, w2, b2 = params
    hidden = x @ w1 + b1
    activations = xp.maximum(hidden, 0)
    return hidden, activations, activations @ w2 + b2


def loss_and_grads(xp, params, grads, x, y):
    """The batch's mean cross-entropy (a device scalar); writes its gradient into `grads`.

    The gradient goes into the preallocated buffers in place (`out=`), because a plan is bound
    to those very buffers: new arrays each step would need a `plan.rebind`.
    """
    hidden, activations, logits = forward(xp, params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)  # stable log-softmax
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    rows = xp.arange(len(y))
    loss = -log_probs[rows, y].mean()
    d_logits = xp.exp(log_probs)  # softmax - one_hot, over the batch size
    d_logits[rows, y] -= 1
    d_logits /= len(y)
    g_w1, g_b1, g_w2, g_b2 = grads
    xp.matmul(activations.T, d_logits, out=g_w2)
    d_logits.sum(axis=0, out=g_b2)
    d_hidden = d_logits @ params[2].T
    d_hidden *= hidden > 0  # ReLU's gradient
    xp.matmul(x.T, d_hidden, out=g_w1)
    d_hidden.sum(axis=0, out=g_b1)
    return loss


def reference_adamw(xp, params, grads, exp_avgs, exp_avg_sqs, *, lr, step, weight_decay):
    """One AdamW step as torch.optim.AdamW defines it, one array operation at a time."""
    beta1, beta2 = BETAS
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p *= 1 - lr * weight_decay  # decoupled weight decay
        m += (1 - beta1) * (g - m)  # torch's lerp
        v *= beta2
        v += (1 - beta2) * g * g
        denom = xp.sqrt(v) / bias_correction2_sqrt + EPS
        p -= (lr / bias_correction1) * m / denom


def batches(n: int, batch_size: int, rng: np.random.Generator):
    """One epoch of shuffled index batches, drawn on the host so both devices see the same order."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train(args, xp, data):
    """Trains both copies in lockstep; returns their per-epoch mean losses and final params."""
    x_train, y_train = data[0], data[1]
    start = init_params(xp, args.seed)
    fused, plain = [p.copy() for p in start], [p.copy() for p in start]
    fused_grads, plain_grads = [xp.empty_like(p) for p in start], [xp.empty_like(p) for p in start]
    plain_state = ([xp.zeros_like(p) for p in start], [xp.zeros_like(p) for p in start])
    # Bound once: each step is then one launch with O(1) host work. With no `stream=`, every
    # launch goes on CuPy's current stream, the one the forward and backward kernels use.
    plan = mtapply.adam_plan(fused, fused_grads, [xp.zeros_like(p) for p in start],
                             [xp.zeros_like(p) for p in start], decoupled_weight_decay=True)
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    rng = np.random.default_rng(args.seed)
    curves, step = ([], []), 0
    for _ in range(args.epochs):
        sums = [xp.zeros((), dtype=xp.float32), xp.zeros((), dtype=xp.float32)]
        epoch = batches(len(x_train), args.batch_size, rng)
        for index in epoch:
            index = xp.asarray(index)
            x, y, step = x_train[index], y_train[index], step + 1
            sums[0] += loss_and_grads(xp, fused, fused_grads, x, y)
            plan.step(step=step, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, **hyper)
            sums[1] += loss_and_grads(xp, plain, plain_grads, x, y)
            reference_adamw(xp, plain, plain_grads, *plain_state, step=step, **hyper)
        for curve, total in zip(curves, sums):  # one host read per epoch
            curve.append(float(total) / len(epoch))
    return curves, fused, plain


def accuracy(xp, params, x, y) -> float:
    return float((forward(xp, params, x)[2].argmax(axis=1) == y).mean())


def report(args, xp, curves, fused, plain, data) -> tuple:
    """Prints the curves, the gaps and the accuracies; returns (whether the curves agree, the
    closing line that says so)."""
    new, ref = curves
    gaps = relative_gaps(ref, new)
    print(f"device={args.device} ({xp.__name__}) epochs={args.epochs} lr={args.lr} "
          f"weight_decay={args.weight_decay}")
    print(f"{'epoch':>5} {'reference AdamW':>16} {'mtapply.adam_plan':>18} {'relative gap':>13}")
    for epoch, (a, b, gap) in enumerate(zip(ref, new, gaps), start=1):
        print(f"{epoch:>5} {a:>16.7f} {b:>18.7f} {gap:>13.2e}")
    param_gap = max(float(abs(p - q).max()) for p, q in zip(fused, plain))
    x_test, y_test = data[2], data[3]
    print(f"max |loss gap| = {max(abs(a - b) for a, b in zip(ref, new)):.3e} "
          f"(relative {max(gaps):.3e}, tolerance {RTOL:g})")
    print(f"max |parameter gap| after training = {param_gap:.3e}")
    print(f"test accuracy: reference AdamW {accuracy(xp, plain, x_test, y_test):.4f}, "
          f"mtapply.adam_plan {accuracy(xp, fused, x_test, y_test):.4f}")
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    agree = gaps[worst] <= RTOL
    return agree, (f"{'OK' if agree else 'FAIL'}: mtapply.adam_plan's mean training loss is "
                   f"{'within' if agree else 'NOT within'} {RTOL:g} (relative) of the reference "
                   f"AdamW's in each of the {len(gaps)} epochs (largest gap {gaps[worst]:.2e}, "
                   f"epoch {worst + 1})")


def device_stream(xp):
    """A non-blocking CuPy stream made current on the GPU (every CuPy kernel and every mtapply
    launch of the block goes on it); nothing on the CPU."""
    if xp is np:
        return contextlib.nullcontext()
    return xp.cuda.Stream(non_blocking=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    xp = array_module(args.device)
    with device_stream(xp):
        data = load_data(xp, args.seed)
        curves, fused, plain = train(args, xp, data)
        agree, closing = report(args, xp, curves, fused, plain, data)
    new, ref = curves
    save_plot(output_path(args.out, "digits_cupy.png"), [ref, new],
              ["reference AdamW (array ops)", "mtapply.adam_plan"],
              f"digits, 64-128-10 MLP, {args.device}", RTOL)
    print(closing)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
