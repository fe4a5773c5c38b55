"""Trains a small MLP on scikit-learn's digits with fp32 AdamW and with 8-bit-state AdamW.

The reference is torch.optim.AdamW; beside it run mtapply.torch.AdamW8bit (moments in 8 bits
with a scale per 256 elements; the 64x256 first layer's, 16,384 params, the others stay fp32
under the 4,096-element threshold, as in bitsandbytes) and, on a GPU with bitsandbytes
installed, bitsandbytes.optim.AdamW8bit. All start from the same weights and see the same
batches. Prints the curves, their gaps and the test accuracies; saves a PNG when matplotlib is
installed. Exits with status 1 when an epoch's mean training loss of mtapply's 8-bit AdamW
differs from fp32 AdamW's by more than 0.1 (relative).

    python examples/digits_8bit.py [--device cpu|cuda] [--epochs 20] [--out examples/out]
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
from _curves import output_path, relative_gaps, save_plot
from digits_torch import (accuracy, curve_check, example_parser, load_data, lockstep,
                         parse_example_args)

import mtapply.torch

# 8-bit moments are rounded each step to a map value at their block's scale, so the loss curve
# follows fp32 AdamW's closely but not to rounding level: the largest relative gap over 20
# epochs on the CPU is 1.6e-2 with the defaults, 3.1e-2 to 4.9e-2 with seeds 1 to 5.
RTOL = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    parser = example_parser(__doc__, 3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    return parse_example_args(parser, argv)


def optimizers(args, models) -> dict:
    """name -> (model, optimizer): the fp32 reference, mtapply's 8-bit, bitsandbytes' 8-bit."""
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    made = {"torch.optim.AdamW": torch.optim.AdamW(models[0].parameters(), **hyper),
            "mtapply.torch.AdamW8bit": mtapply.torch.AdamW8bit(models[1].parameters(), **hyper)}
    if args.device == "cuda":
        try:
            import bitsandbytes
        except ImportError:
            print("note: bitsandbytes is not installed; its row is skipped")
        else:
            made["bitsandbytes AdamW8bit"] = bitsandbytes.optim.AdamW8bit(models[2].parameters(),
                                                                         **hyper)
    return {name: (model, opt) for (name, opt), model in zip(made.items(), models)}


def train(args, data):
    x_train, y_train, _, _ = data
    torch.manual_seed(args.seed)
    first = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(args.device)
    runs = optimizers(args, [first] + [copy.deepcopy(first) for _ in range(2)])
    return lockstep(runs, x_train, y_train, args), runs


def main(argv=None) -> int:
    args = parse_args(argv)
    data = load_data(args.seed, args.device)
    curves, runs = train(args, data)
    names = list(curves)
    reference = curves[names[0]]
    print(f"device={args.device} epochs={args.epochs} lr={args.lr} weight_decay={args.weight_decay}")
    print("epoch " + " ".join(f"{name:>24}" for name in names))
    for epoch in range(args.epochs):
        print(f"{epoch + 1:>5} " + " ".join(f"{curves[name][epoch]:>24.6f}" for name in names))
    gaps = {name: max(relative_gaps(reference, curves[name])) for name in names[1:]}
    for name, gap in gaps.items():
        print(f"largest relative loss gap, {name} against {names[0]}: {gap:.3e}")
    opt = runs["mtapply.torch.AdamW8bit"][1]
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                      for k, t in s.items() if k != "step")
    n_params = sum(p.numel() for p in runs[names[0]][0].parameters())
    print(f"state bytes per param: mtapply.torch.AdamW8bit {state_bytes / n_params:.3f}, "
          f"torch.optim.AdamW 8.000")
    x_test, y_test = data[2], data[3]
    print("test accuracy: " + ", ".join(f"{name} {accuracy(runs[name][0], x_test, y_test):.4f}"
                                        for name in names))
    save_plot(output_path(args.out, "digits_8bit.png"), [curves[n] for n in names], names,
              f"digits, 64-256-10 MLP, {args.device}", RTOL)
    agree, closing = curve_check("mtapply.torch.AdamW8bit", names[0],
                                 relative_gaps(reference, curves["mtapply.torch.AdamW8bit"]), RTOL)
    print(closing)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
