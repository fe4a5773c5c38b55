"""Trains a small MLP on scikit-learn's digits twice: with torch.optim.AdamW and mtapply.torch.AdamW.

Both copies start from the same weights and see the same batches, so any gap between their loss
curves comes from the optimizers alone. Prints both curves, their largest gap, the largest gap
between the final parameters and both test accuracies; saves a PNG of the curves when matplotlib
is installed. Exits with status 1 when an epoch's mean training losses differ by more than
1e-4 (relative).

The digits data ship inside scikit-learn (no download). Usage:

    python examples/digits_torch.py [--device cpu|cuda] [--epochs 20] [--out examples/out]

Runs on the GPU when one is present (one fused launch per step), else on the CPU (the NumPy
backend; under a minute).
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from _curves import (add_device_argument, add_out_argument, output_path, parser_for,
                     relative_gaps, save_plot)

import mtapply.torch

# Relative tolerance on each epoch's mean training loss. Two fp32 AdamW implementations round
# differently (operation order, fused multiply-adds), by about 1e-7 relative per step, and
# training carries those differences forward. With the defaults the curves stay within about
# 3e-7 of each other, as do torch's own for-loop and fused AdamW; a real difference in semantics
# moves them far more (weight decay coupled into the gradient: 0.7; bias correction one step
# off: 2e-2). 1e-4 sits between the two. Long runs that drive the loss toward zero amplify
# rounding (Adam divides by the square root of tiny second moments), so any two implementations
# drift apart there: torch's for-loop and fused AdamW differ by 2e-2 after 100 epochs at lr=1e-2.
RTOL = 1e-4


def example_parser(doc: str, lr: float) -> argparse.ArgumentParser:
    """The options every torch digits example takes: device, epochs, batch size, lr, seed, out;
    `--help` prints the example's whole docstring `doc`."""
    parser = parser_for(doc)
    add_device_argument(parser, torch.cuda.is_available())
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    return parser


def parse_example_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The parsed options; `--device cuda` refused plainly where torch sees no CUDA device."""
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (a CPU-only torch build, or "
                     "no GPU): use --device cpu")
    return args


def curve_check(name: str, reference: str, gaps: list, rtol: float, first: int | None = None):
    """(whether `name`'s mean training loss stays within `rtol` of `reference`'s in each epoch,
    or in each of the first `first` epochs; the closing line that says so)."""
    checked = gaps[:first] if first else gaps
    worst = max(range(len(checked)), key=checked.__getitem__)
    agree = checked[worst] <= rtol
    epochs = f"each of the {'first ' if first else ''}{len(checked)} epochs"
    line = (f"{'OK' if agree else 'FAIL'}: {name}'s mean training loss is "
            f"{'within' if agree else 'NOT within'} {rtol:g} (relative) of {reference}'s in "
            f"{epochs} (largest gap {checked[worst]:.2e}, epoch {worst + 1})")
    return agree, line


def parse_args(argv=None) -> argparse.Namespace:
    parser = example_parser(__doc__, 3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    return parse_example_args(parser, argv)


def load_data(seed: int, device: str):
    """The digits (8x8 images, 10 classes) as float32 tensors, split 75/25 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixels are 0..16; unit scale suits the default init and learning rate
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed,
                                                        stratify=y)
    as_x = lambda a: torch.as_tensor(a, dtype=torch.float32, device=device)
    as_y = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_models(seed: int, device: str):
    """Two identical 64-128-10 MLPs: the second is a deep copy of the first, so same init."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10)).to(device)
    return model, copy.deepcopy(model)


def batches(n: int, batch_size: int, generator: torch.Generator):
    """One epoch of shuffled index batches, drawn on the CPU so both devices see the same order."""
    order = torch.randperm(n, generator=generator)
    return order.split(batch_size)


def train_step(model, optimizer, x, y) -> torch.Tensor:
    """One AdamW step on a batch; returns the batch loss (still on the device: no sync)."""
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def lockstep(runs: dict, x_train, y_train, args) -> dict:
    """Trains every (model, optimizer) of `runs` on the same batches, epoch by epoch; returns
    name -> the mean training loss of each epoch (one host read per epoch and run)."""
    generator = torch.Generator().manual_seed(args.seed)
    curves = {name: [] for name in runs}
    for _ in range(args.epochs):
        sums = {name: torch.zeros((), device=args.device) for name in runs}
        index_batches = batches(len(x_train), args.batch_size, generator)
        for index in index_batches:
            index = index.to(args.device)
            for name, (model, optimizer) in runs.items():
                sums[name] += train_step(model, optimizer, x_train[index], y_train[index])
        for name, total in sums.items():
            curves[name].append(total.item() / len(index_batches))
    return curves


def train(args, data):
    """Trains both copies in lockstep; returns their per-epoch mean losses and the models."""
    x_train, y_train, _, _ = data
    reference, candidate = make_models(args.seed, args.device)
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    optimizers = [torch.optim.AdamW(reference.parameters(), **hyper),
                  mtapply.torch.AdamW(candidate.parameters(), **hyper)]
    generator = torch.Generator().manual_seed(args.seed)
    curves = ([], [])
    for _ in range(args.epochs):
        sums = [torch.zeros((), device=args.device) for _ in optimizers]
        index_batches = batches(len(x_train), args.batch_size, generator)
        for index in index_batches:
            index = index.to(args.device)
            x, y = x_train[index], y_train[index]
            for total, model, optimizer in zip(sums, (reference, candidate), optimizers):
                total += train_step(model, optimizer, x, y)
        for curve, total in zip(curves, sums):  # one host read per epoch
            curve.append(total.item() / len(index_batches))
    return curves, reference, candidate


@torch.no_grad()
def accuracy(model, x, y) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


@torch.no_grad()
def max_param_gap(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def report(args, curves, reference, candidate, data) -> tuple:
    """Prints the curves, the gaps and the accuracies; returns (whether the curves agree, the
    closing line that says so)."""
    ref, new = curves
    gaps = relative_gaps(ref, new)
    print(f"device={args.device} epochs={args.epochs} lr={args.lr} weight_decay={args.weight_decay}")
    print(f"{'epoch':>5} {'torch.optim.AdamW':>18} {'mtapply.torch.AdamW':>20} {'relative gap':>13}")
    for epoch, (a, b, gap) in enumerate(zip(ref, new, gaps), start=1):
        print(f"{epoch:>5} {a:>18.7f} {b:>20.7f} {gap:>13.2e}")
    x_test, y_test = data[2], data[3]
    print(f"max |loss gap| = {max(abs(a - b) for a, b in zip(ref, new)):.3e} "
          f"(relative {max(gaps):.3e}, tolerance {RTOL:g})")
    print(f"max |parameter gap| after training = {max_param_gap(reference, candidate):.3e}")
    print(f"test accuracy: torch.optim.AdamW {accuracy(reference, x_test, y_test):.4f}, "
          f"mtapply.torch.AdamW {accuracy(candidate, x_test, y_test):.4f}")
    return curve_check("mtapply.torch.AdamW", "torch.optim.AdamW", gaps, RTOL)


def main(argv=None) -> int:
    args = parse_args(argv)
    data = load_data(args.seed, args.device)
    curves, reference, candidate = train(args, data)
    agree, closing = report(args, curves, reference, candidate, data)
    save_plot(output_path(args.out, "digits_torch.png"), list(curves),
              ["torch.optim.AdamW", "mtapply.torch.AdamW"], f"digits, 64-128-10 MLP, {args.device}",
              RTOL)
    print(closing)
    return 0 if agree else 1

if __name__ == "__main__":
    sys.exit(main())
