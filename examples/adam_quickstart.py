"""Updates a list of tensors with mtapply.adam_step and checks it against torch.optim.AdamW.

Five tensors (one of them empty) start alike in two copies; each step draws random grads, which
torch.optim.AdamW (foreach=False) applies to one copy and mtapply.adam_step (decoupled weight
decay: AdamW) to the other, with its own lists of moments. Prints the largest difference
between the copies after each step; saves a PNG of the params' norms and that difference when
matplotlib is installed. Exits with status 1 when, after any step, an element of the two copies
differs by more than 1e-5 (float32 rounding of the same update is about 1e-7 here).

Runs on the GPU when torch sees one (one fused launch for the whole list), else on the CPU (the
NumPy backend). Usage:

    python examples/adam_quickstart.py [--device cpu|cuda] [--steps 10] [--out examples/out]
"""
from __future__ import annotations

import sys

import torch
from _curves import add_device_argument, add_out_argument, output_path, parser_for, save_plot

import mtapply

SHAPES = [(256, 128), (128,), (0,), (1000, 10), (7,)]
HYPER = dict(lr=1e-2, weight_decay=0.01)
ATOL = 1e-5


def parse_args(argv=None):
    parser = parser_for(__doc__)
    add_device_argument(parser, torch.cuda.is_available())
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (a CPU-only torch build, or "
                     "no GPU): use --device cpu")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def norm(tensors) -> float:
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    params = [torch.randn(s, device=args.device) for s in SHAPES]
    reference = [p.clone().requires_grad_() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    torch_adamw = torch.optim.AdamW(reference, foreach=False, **HYPER)

    print(f"device={args.device} tensors={len(params)} steps={args.steps} lr={HYPER['lr']} "
          f"weight_decay={HYPER['weight_decay']}")
    print(f"{'step':>4} {'max |mtapply - torch.optim.AdamW|':>34}")
    norms, gaps = ([], []), []
    for step in range(1, args.steps + 1):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        torch_adamw.step()
        mtapply.adam_step(params, grads, exp_avgs, exp_avg_sqs, step=step,
                          decoupled_weight_decay=True, **HYPER)
        gaps.append(max((p - r.detach()).abs().max().item()
                        for p, r in zip(params, reference) if p.numel()))
        norms[0].append(norm(r.detach() for r in reference))
        norms[1].append(norm(params))
        print(f"{step:>4} {gaps[-1]:>34.2e}")

    save_plot(output_path(args.out, "adam_quickstart.png"), list(norms),
              ["torch.optim.AdamW", "mtapply.adam_step"], f"{len(SHAPES)} tensors, {args.device}",
              ATOL, xlabel="step", ylabel="norm of all params", gaps=[gaps],
              gap_label="max |param difference|")
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    agree = gaps[worst] <= ATOL
    print(f"{'OK' if agree else 'FAIL'}: after each of {args.steps} steps, every element of "
          f"mtapply.adam_step's params is {'within' if agree else 'NOT within'} {ATOL:g} of "
          f"torch.optim.AdamW's (largest difference {gaps[worst]:.2e}, step {worst + 1})")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
