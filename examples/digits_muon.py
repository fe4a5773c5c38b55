"""Trains an MLP on scikit-learn's digits with Muon for its weight matrices and AdamW for its biases.

The reference is torch's pair, torch.optim.Muon for the matrices and torch.optim.AdamW for the
biases; beside it runs mtapply.torch.Muon, one optimizer whose `use_muon=False` group is the
AdamW. Both start from the same weights and see the same batches. Prints the curves and the
test accuracies; saves a PNG when matplotlib is installed. Exits with status 1 when the mean
training losses of the first 4 epochs differ by more than 1e-2 (relative), or when mtapply's
test accuracy is more than 0.03 below torch's (later epochs, at losses of 1e-2 and below, wander
apart like any two runs: Newton-Schulz in bfloat16 rounds some elements the other way).

    python examples/digits_muon.py [--device cpu|cuda] [--epochs 20] [--out examples/out]
"""
from __future__ import annotations

import copy
import sys

import torch
from _curves import output_path, relative_gaps, save_plot
from digits_torch import (accuracy, curve_check, example_parser, load_data, lockstep,
                         parse_example_args)

import mtapply.torch

# Both run Newton-Schulz in bfloat16 on the same updates, batched here and matrix by matrix
# there: the products' other summation orders round some bfloat16 elements the other way, some
# 1e-3 of a step, which the training carries along like any perturbation. Measured on the CPU,
# seeds 0 to 4: the first EARLY_EPOCHS epoch losses agree to 4.7e-3 at most; later, at losses
# of 1e-2 and below, where Muon's steps of fixed size keep the loss jumping, the curves wander
# apart like any two runs (relative gaps up to 2.8), so they are printed, not checked. The test
# accuracies then lie within 0.009 of each other (seeds 0 to 5); ACCURACY_GAP catches a run
# that trains clearly worse.
EARLY_EPOCHS, EARLY_RTOL, ACCURACY_GAP = 4, 1e-2, 0.03
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


class Pair:
    """torch's two optimizers stepped as one."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def split(model) -> tuple:
    return ([p for p in model.parameters() if p.dim() == 2],
            [p for p in model.parameters() if p.dim() != 2])


def optimizers(args, models) -> dict:
    (matrices, biases), (ours_matrices, ours_biases) = split(models[0]), split(models[1])
    torch_pair = Pair(torch.optim.Muon(matrices, lr=args.lr), torch.optim.AdamW(biases, **ADAMW))
    ours = mtapply.torch.Muon([{"params": ours_matrices},
                               {"params": ours_biases, "use_muon": False, **ADAMW}], lr=args.lr)
    return {"torch.optim.Muon + AdamW": (models[0], torch_pair),
            "mtapply.torch.Muon": (models[1], ours)}


def main(argv=None) -> int:
    args = parse_example_args(example_parser(__doc__, 0.02), argv)
    x_train, y_train, x_test, y_test = load_data(args.seed, args.device)
    torch.manual_seed(args.seed)
    first = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(args.device)
    runs = optimizers(args, [first, copy.deepcopy(first)])
    curves = lockstep(runs, x_train, y_train, args)
    names = list(curves)
    print(f"device={args.device} epochs={args.epochs} lr={args.lr}")
    print("epoch " + " ".join(f"{name:>26}" for name in names))
    for epoch in range(args.epochs):
        print(f"{epoch + 1:>5} " + " ".join(f"{curves[n][epoch]:>26.6f}" for n in names))
    accuracies = [accuracy(runs[n][0], x_test, y_test) for n in names]
    print("test accuracy: " + ", ".join(f"{n} {a:.4f}" for n, a in zip(names, accuracies)))
    gaps = relative_gaps(*(curves[n] for n in names))
    early = max(gaps[:EARLY_EPOCHS])
    print(f"largest relative loss gap, mtapply against torch: {early:.3e} over the first "
          f"{min(EARLY_EPOCHS, args.epochs)} epochs (tolerance {EARLY_RTOL:g}); {max(gaps):.3e} "
          f"over all (not checked: see the comment at EARLY_RTOL)")
    save_plot(output_path(args.out, "digits_muon.png"), [curves[n] for n in names], names,
              f"digits, 64-256-256-10 MLP, Muon + AdamW, {args.device}")
    close, line = curve_check(names[1], names[0], gaps, EARLY_RTOL, EARLY_EPOCHS)
    accurate = accuracies[1] >= accuracies[0] - ACCURACY_GAP
    agree = close and accurate
    print(f"{'OK' if agree else 'FAIL'}: {line.split(': ', 1)[1]}, and its test accuracy "
          f"{accuracies[1]:.4f} is {'at most' if accurate else 'MORE than'} {ACCURACY_GAP:g} below "
          f"torch's {accuracies[0]:.4f}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
