"""Data-parallel training with mtapply's optimizer: DDP, or FSDP2 (sharded DTensor params).

    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode ddp --out result.pt
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer lamb
    python examples/distributed_torch.py --mode single --out reference.pt

Every rank trains the same small MLP on its half of each global batch of fixed synthetic data;
gradients are averaged (DDP) or reduce-scattered (FSDP2, where each rank then updates only its
own shard of every param: mtapply's optimizers step the local shards, and LARS and LAMB sum
their per-tensor norms over the shards with an all-reduce). `--mode single` trains
the same model on whole batches on one GPU: the results must agree to rounding. The final full
params are saved by rank 0.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import mtapply.torch as mt

WIDTH, CLASSES, BATCH, STEPS = 96, 10, 64, 12


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.GELU(),
                               torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                               torch.nn.Linear(WIDTH, CLASSES)).to(device)


def batches(device):
    """The same global batches on every rank (fixed seed), drawn on the CPU."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield (torch.randn(BATCH, 32, generator=g).to(device),
               torch.randint(0, CLASSES, (BATCH,), generator=g).to(device))


def wrap(model, mode: str):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        return fully_shard(model)
    return model


def full_params(model) -> list:
    """Every param in full (FSDP2 shards gathered), on the CPU."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for p in model.parameters()]


OPTIMIZERS = {
    "adamw": lambda params: mt.AdamW(params, lr=3e-3, weight_decay=0.05),
    "lars": lambda params: mt.LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-3,
                                   trust_coefficient=0.02),
    "lamb": lambda params: mt.LAMB(params, lr=3e-3, weight_decay=0.05, max_grad_norm=1.0),
}


def train(mode: str, optimizer: str) -> list:
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "single" else (0, 1)
    device = torch.device("cuda", rank if mode != "single" else 0)
    model = wrap(make_model(device), mode)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for x, y in batches(device):
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[part]), y[part])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return full_params(model), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp2", "single"), default="ddp")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    parser.add_argument("--out", default="distributed_result.pt")
    args = parser.parse_args()
    if args.mode != "single":
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    params, losses = train(args.mode, args.optimizer)
    if args.mode == "single" or dist.get_rank() == 0:
        torch.save({"params": params, "losses": losses}, args.out)
        print(f"{args.mode} {args.optimizer}: {len(params)} params, final loss on rank 0 {losses[-1]:.6f} -> {args.out}")
    if args.mode != "single":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
