"""Data-parallel training with mtapply's optimizer: DDP, or FSDP2 (sharded DTensor params).

    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode ddp
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer lamb
    python examples/distributed_torch.py --mode single
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer adamw8bit \
        --checkpoint /tmp/optimizer-checkpoint

Every rank trains the same small MLP on its half of each global batch of fixed synthetic data;
gradients are averaged (DDP) or reduce-scattered (FSDP2, where each rank then updates only its
own shard of every param: mtapply's optimizers step the local shards, and LARS and LAMB sum
their per-tensor norms over the shards with an all-reduce). `--mode single` trains the same
model on whole batches in one process: the results must agree to rounding. Rank 0 saves the
final full params and its losses to `--out`/distributed_MODE_OPTIMIZER.pt. `--checkpoint FOLDER`
saves the optimizer's state halfway (torch.distributed.checkpoint; 8-bit states included) and
goes on with a new optimizer that loads it: the results are the same as without.

On GPUs (one per rank, NCCL) when torch sees them, else on the CPU (`--device cpu`: gloo, and
mtapply's NumPy backend), DDP and FSDP2 alike; LARS and LAMB over FSDP2 shards need GPUs (on the
CPU their per-tensor norms are not summed over the shards).
"""
from __future__ import annotations

import argparse
import os
import sys

from pathlib import Path

import torch
import torch.distributed as dist

import mtapply.torch as mt

OUT = Path(__file__).resolve().parent / "out"  # git-ignored

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


def wrap(model, mode: str, device_type: str):
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # named, or FSDP2 shards onto CUDA wherever a GPU is visible
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
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
    "lion": lambda params: mt.Lion(params, lr=3e-4, weight_decay=0.1),
    # 8-bit states: each weight's shard (1,536 and 4,608 elements on two ranks) holds whole
    # blocks of 256, so its blocks are the whole tensor's; under 1,024 elements stays float32
    "adamw8bit": lambda params: mt.AdamW8bit(params, lr=3e-3, weight_decay=0.05,
                                             min_8bit_size=1024),
    "lion8bit": lambda params: mt.Lion(params, lr=3e-4, weight_decay=0.1, state_bits=8,
                                       min_8bit_size=1024),
}


def resumed(model, opt, optimizer: str, folder: str):
    """A new optimizer holding `opt`'s state, saved to `folder` and loaded back through
    torch.distributed.checkpoint (each rank writes and reads its own shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
    opt.zero_grad(set_to_none=True)  # (torch makes a new optimizer's state where no grad is)
    fresh = OPTIMIZERS[optimizer](model.parameters())
    loaded = {"optim": get_optimizer_state_dict(model, fresh)}  # its fresh state, to load into
    dcp.load(loaded, checkpoint_id=folder)
    set_optimizer_state_dict(model, fresh, loaded["optim"])
    return fresh


def train(mode: str, optimizer: str, device_type: str, checkpoint: str | None = None) -> tuple:
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "single" else (0, 1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    model = wrap(make_model(device), mode, device_type)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for step, (x, y) in enumerate(batches(device)):
        if checkpoint and step == STEPS // 2:
            opt = resumed(model, opt, optimizer, checkpoint)
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[part]), y[part])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    kinds = sorted({str(value.dtype) for entry in opt.state.values() for value in entry.values()})
    return full_params(model), losses, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp2", "single"), default="ddp")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    parser.add_argument("--checkpoint", metavar="FOLDER",
                        help="halfway, save the optimizer's state there and go on with a new "
                             "optimizer that loads it (torch.distributed.checkpoint)")
    parser.add_argument("--out", default=str(OUT),
                        help="folder for the result (default: examples/out/, git-ignored)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu" and args.mode == "fsdp2" and args.optimizer in ("lars", "lamb"):
        parser.error(f"--optimizer {args.optimizer} with --mode fsdp2 needs GPUs: on the CPU "
                     f"mtapply does not sum its per-tensor norms over the shards (use --mode "
                     f"ddp, or another --optimizer)")
    if args.mode != "single":
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    params, losses, state_dtypes = train(args.mode, args.optimizer, args.device, args.checkpoint)
    if args.mode == "single" or dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"distributed_{args.mode}_{args.optimizer}.pt"
        torch.save({"params": params, "losses": losses, "state_dtypes": state_dtypes}, path)
        print(f"{args.mode} {args.optimizer} on {args.device}: {len(params)} params, final loss "
              f"on rank 0 {losses[-1]:.6f} -> {path}")
    if args.mode != "single":
        dist.destroy_process_group()
        if args.device == "cpu":
            # gloo's worker threads may still be releasing finished collectives, which hold
            # Python tensors, while the interpreter shuts down; taking the GIL then aborts the
            # process ("terminate called without an active exception": torch 2.13 with plain
            # torch.optim too, in about one run of ten). Nothing is left to do: leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
