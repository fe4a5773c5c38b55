"""python -m mtapply.bench.losses: loss curves of one GPT-2 trained with fp32 AdamW and with
8-bit AdamW (mtapply's, and bitsandbytes' and torchao's where installed), or (`--family
galore`) with GaLore AdamW (mtapply's, and galore-torch's where installed).

Every variant starts from the same weights (a transformers GPT2Config, GPT-2 small by default)
and sees the same batches: a fixed set of random token sequences, cycled, which the model learns
by heart, so the curves fall steadily and any gap comes from the optimizers. bf16 autocast on a
GPU. Prints the losses at a few steps and each curve's largest relative gap from fp32 AdamW's
over the last tenth of the run; writes JSON and, with matplotlib, a PNG.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys


def variants(lr: float, weight_decay: float, family: str = "8bit", rank: int = 128) -> dict:
    """name -> optimizer factory: fp32 AdamW first (the reference), then the 8-bit or the
    GaLore ones."""
    import torch

    from .train import eight_bit_optimizers

    fp32 = {"torch-adamw": lambda m: torch.optim.AdamW(m.parameters(), lr,
                                                       weight_decay=weight_decay)}
    if family == "galore":
        return {**fp32, **galore_optimizers(lr, weight_decay, rank)}
    return {**fp32, **eight_bit_optimizers(lr, weight_decay)}


def galore_optimizers(lr: float, weight_decay: float, rank: int) -> dict:
    """GaLore AdamW, mtapply's and galore-torch's (where installed), on the same groups: the
    blocks' 2-D weights projected to `rank` (a fresh projector every 200 steps, scale 0.25),
    the embeddings and 1-D params in plain AdamW, as galore-torch's examples group them."""
    import importlib.util

    import mtapply.torch as mt

    def groups(model):
        projected = [p for name, p in model.named_parameters()
                     if p.dim() == 2 and ".h." in f".{name}"]
        chosen = set(map(id, projected))
        rest = [p for p in model.parameters() if id(p) not in chosen]
        return [{"params": rest}, {"params": projected, "rank": rank, "update_proj_gap": 200,
                                   "scale": 0.25, "proj_type": "std"}]

    made = {"mtapply-galore": lambda m: mt.GaLoreAdamW(groups(m), lr, weight_decay=weight_decay)}
    if importlib.util.find_spec("galore_torch"):
        def galore_torch(m):
            import galore_torch

            return galore_torch.GaLoreAdamW(groups(m), lr, weight_decay=weight_decay)
        made["galore-torch"] = galore_torch
    return made


def curves(args) -> dict:
    """name -> the loss at each step."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    # dropout off: the same weights and batches then give the same losses until the
    # optimizers part them
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.tokens,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.tokens), generator=generator)
               .to(args.device) for _ in range(args.distinct_batches)]
    out = {}
    for name, make in variants(args.lr, args.weight_decay, args.family, args.rank).items():
        model = copy.deepcopy(base).to(args.device)
        optimizer = make(model)
        losses = []
        for step in range(args.steps):
            ids = batches[step % len(batches)]
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
                loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        out[name] = losses
        print(f"{name}: first {losses[0]:.4f}, last {losses[-1]:.4f}", flush=True)
    return out


def late_gaps(results: dict) -> dict:
    """name -> the largest relative gap from the reference over the last tenth of the steps."""
    names = list(results)
    reference = results[names[0]]
    tail = max(1, len(reference) // 10)
    return {name: max(abs(a - b) / max(abs(a), 1e-30)
                      for a, b in zip(reference[-tail:], results[name][-tail:]))
            for name in names[1:]}


def report(results: dict) -> str:
    names = list(results)
    steps = len(results[names[0]])
    marks = sorted({1, 10, 50, 100, 200, 300, 500, steps} & set(range(1, steps + 1)))
    lines = ["| step | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for step in marks:
        lines.append(f"| {step} | " + " | ".join(f"{results[n][step - 1]:.4f}" for n in names)
                     + " |")
    for name, gap in late_gaps(results).items():
        lines.append(f"\nlargest relative gap from {names[0]} over the last tenth, {name}: "
                     f"{gap:.3e}")
    return "\n".join(lines)


def plot(results: dict, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, losses in results.items():
        axes.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    axes.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv=None) -> int:
    args = _parse_args(argv)
    results = curves(args)
    print(report(results))
    with open(args.json, "w") as handle:
        json.dump({"config": vars(args), "losses": results, "late_gaps": late_gaps(results)},
                  handle, indent=1)
    title = f"GPT-2 ({args.layers} layers of {args.width}), {args.steps} steps, {args.device}"
    if args.plot and plot(results, args.plot, title):
        print(f"plot written to {args.plot}")
    print(f"results written to {args.json}")
    return 0


def _parse_args(argv):
    import torch

    parser = argparse.ArgumentParser(prog="python -m mtapply.bench.losses",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--distinct-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--family", choices=("8bit", "galore"), default="8bit",
                        help="the optimizers beside fp32 AdamW (default: 8bit)")
    parser.add_argument("--rank", type=int, default=128, help="GaLore's rank (default: 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="losses.json")
    parser.add_argument("--plot", default="losses.png")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
