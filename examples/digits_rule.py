"""Trains the digits MLP with an optimizer written in a few lines (`mtapply.rule`) beside its
torch.optim twin.

The rule in this file is Adagrad as torch.optim.Adagrad defines it, written by hand: mtapply
checks the text once, generates a fused multi-tensor CUDA kernel and a NumPy path from it, and
`mtapply.torch.optimizer` makes it a torch.optim.Optimizer (param groups, schedulers,
state_dict). Both copies of the model start from the same weights and see the same batches.
Prints both loss curves, their largest gap and both test accuracies; saves a PNG of the curves
when matplotlib is installed. Exits with status 1 when an epoch's mean training losses differ
by more than 1e-4 (relative). Usage:

    python examples/digits_rule.py [--device cpu|cuda] [--epochs 20] [--out examples/out]
"""
from __future__ import annotations

import argparse
import sys

import torch

import mtapply
import mtapply.torch
from _curves import output_path, relative_gaps, save_plot
from digits_torch import (accuracy, batches, curve_check, example_parser, load_data, make_models,
                         parse_example_args, train_step)

ADAGRAD = mtapply.rule(
    "my_adagrad", slots="param:rw grad:r sum:rw",
    hyper=dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10),
    update="""
        g = grad + weight_decay * param
        sum = sum + g * g
        clr = lr / (1 + (step - 1) * lr_decay)
        param = param - clr * (g / (sqrt(sum) + eps))
    """)

# Two fp32 implementations of one update round differently (operation order, fused
# multiply-adds) by about 1e-7 relative per step; a difference in semantics (eps inside the
# root, say) moves the curves by far more than this tolerance.
RTOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = example_parser(__doc__, 3e-2)
    parser.add_argument("--lr-decay", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    return parse_example_args(parser, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = load_data(args.seed, args.device)
    reference, candidate = make_models(args.seed, args.device)
    hyper = dict(lr=args.lr, lr_decay=args.lr_decay, weight_decay=args.weight_decay)
    optimizers = [torch.optim.Adagrad(reference.parameters(), foreach=False, **hyper),
                  mtapply.torch.optimizer(ADAGRAD, candidate.parameters(), **hyper)]
    generator = torch.Generator().manual_seed(args.seed)
    curves = ([], [])
    for _ in range(args.epochs):
        sums = [torch.zeros((), device=args.device) for _ in optimizers]
        index_batches = batches(len(x_train), args.batch_size, generator)
        for index in index_batches:
            index = index.to(args.device)
            for total, model, optimizer in zip(sums, (reference, candidate), optimizers):
                total += train_step(model, optimizer, x_train[index], y_train[index])
        for curve, total in zip(curves, sums):  # one host read per epoch
            curve.append(total.item() / len(index_batches))
    gaps = relative_gaps(*curves)
    print(f"device={args.device} epochs={args.epochs} lr={args.lr} lr_decay={args.lr_decay}")
    print(f"{'epoch':>5} {'torch.optim.Adagrad':>20} {'mtapply.rule Adagrad':>21} "
          f"{'relative gap':>13}")
    for epoch, (a, b, gap) in enumerate(zip(*curves, gaps), start=1):
        print(f"{epoch:>5} {a:>20.7f} {b:>21.7f} {gap:>13.2e}")
    print(f"max relative loss gap {max(gaps):.3e} (tolerance {RTOL:g})")
    print(f"test accuracy: torch.optim.Adagrad {accuracy(reference, x_test, y_test):.4f}, "
          f"mtapply.rule Adagrad {accuracy(candidate, x_test, y_test):.4f}")
    save_plot(output_path(args.out, "digits_rule.png"), list(curves),
              ["torch.optim.Adagrad", "mtapply.rule Adagrad"], f"digits, 64-128-10 MLP, {args.device}",
              RTOL)
    agree, closing = curve_check("mtapply.rule Adagrad", "torch.optim.Adagrad", gaps, RTOL)
    print(closing)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
