"""Data-parallel training with mtapply's optimizer: DDP, or FSDP2 (sharded DTensor params).

    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode ddp
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer lamb
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer lamb8bit
    python examples/distributed_torch.py --mode single
    torchrun --nproc_per_node=2 examples/distributed_torch.py --mode fsdp2 --optimizer adamw8bit \
        --checkpoint /tmp/optimizer-checkpoint

Every rank trains the same small MLP on its half of each global batch of fixed synthetic data;
gradients are averaged (DDP) or reduce-scattered (FSDP2, where each rank then updates only its
own shard of every param: mtapply's optimizers step the local shards, and LARS and LAMB sum
their per-tensor norms over the shards with an all-reduce). `--mode single` trains the same
model on whole batches in one process. Under torchrun, rank 0 then runs that one-process
training too and checks the distributed run against it: it prints the largest difference between
the final params and exits with status 1 when it is above the tolerance (1e-4 with float
states; 2e-3 with 8-bit states, where a rounding may put a value on the neighbouring code and
that element's later steps then differ by up to a few lr; 1e-2 with Muon, where such a
rounding may flip a bfloat16 rounding of an update, which Newton-Schulz spreads over the
matrix: about 1% of a step, 12 steps of lr 0.02). The losses printed and plotted are
the mean over the ranks of their half-batch losses: the whole batch's loss, as one process sees
it. Rank 0 saves the final full params and those losses to `--out`/distributed_MODE_OPTIMIZER.pt
and the plot beside them (.png). `--checkpoint FOLDER` saves the optimizer's state halfway
(torch.distributed.checkpoint; 8-bit states included) and goes on with a new optimizer that
loads it: the results are the same as without. A configuration mtapply refuses ends with its
message and exit status 2.

On GPUs (one per rank, NCCL) when torch sees them, else on the CPU (`--device cpu`: gloo, and
mtapply's NumPy backend), DDP and FSDP2 alike (LARS's and LAMB's norms and Prodigy's sums
summed over the shards between their passes, on the CPU too). `--optimizer` NAME8bit keeps the
optimizer's state in 8 bits (state_bits=8; SGD, LARS, LAMB, RMSprop, Adagrad, AdEMAMix, Lion,
AdamW and Muon). `--optimizer muon` is Muon for the weight matrices with AdamW for the biases,
in one optimizer: over FSDP2 each rank gathers the whole matrices for Newton-Schulz.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _curves import add_device_argument, add_out_argument, output_path, parser_for, save_plot

import mtapply.torch as mt

WIDTH, CLASSES, BATCH, STEPS = 96, 10, 64, 12
# The largest difference allowed between a final param of the distributed run and the one-process
# run's. The ranks' half-batch gradients are averaged, a few float32 roundings per step apart
# from the whole batch's; with float states the params agree to 1.4e-7 on the CPU (1e-4 leaves
# room for reductions in other orders on GPUs, and LARS's larger steps). With 8-bit states such
# a rounding may put a moment on the neighbouring code, and that element's later steps then
# differ by up to a few lr (3e-3 for AdamW, 3e-4 for Lion). Muon's Newton-Schulz runs in
# bfloat16: a rounding that goes the other way moves the matrix's update by some 1% of a step.
ATOL, ATOL_8BIT, ATOL_MUON = 1e-4, 2e-3, 1e-2


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
    "sgd8bit": lambda params: mt.SGD(params, lr=0.05, momentum=0.9, state_bits=8,
                                     min_8bit_size=1024),
    "lars8bit": lambda params: mt.LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-3,
                                       trust_coefficient=0.02, state_bits=8, min_8bit_size=1024),
    "lamb8bit": lambda params: mt.LAMB(params, lr=3e-3, weight_decay=0.05, max_grad_norm=1.0,
                                       state_bits=8, min_8bit_size=1024),
    "rmsprop8bit": lambda params: mt.RMSprop(params, lr=1e-4, state_bits=8, min_8bit_size=1024),
    "adagrad8bit": lambda params: mt.Adagrad(params, lr=1e-3, state_bits=8, min_8bit_size=1024),
    "ademamix8bit": lambda params: mt.AdEMAMix(params, lr=1e-3, weight_decay=0.05, state_bits=8,
                                               min_8bit_size=1024),
    "prodigy": lambda params: mt.Prodigy(params, lr=1.0, weight_decay=0.01),
    "muon": lambda params: muon(params),
    "muon8bit": lambda params: muon(params, state_bits=8, min_8bit_size=1024),
}


def muon(params, **options):
    """Muon for the weight matrices and AdamW for the biases, in one optimizer (over FSDP2 each
    rank gathers the whole matrices for Newton-Schulz and steps its own shards)."""
    params = list(params)
    return mt.Muon([{"params": [p for p in params if p.ndim == 2]},
                    {"params": [p for p in params if p.ndim != 2], "use_muon": False, "lr": 3e-3}],
                   lr=0.02, weight_decay=0.01, **options)


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


def train(model, optimizer: str, device, rank: int = 0, world: int = 1,
          checkpoint: str | None = None) -> tuple:
    """Trains `model` (wrapped or not) on each rank's part of every global batch; returns its
    full final params, its losses (this rank's part's) and its optimizer state's dtypes."""
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
        losses.append(loss.detach())
    kinds = sorted({str(value.dtype) for entry in opt.state.values() for value in entry.values()})
    return full_params(model), torch.stack(losses), kinds


def refuse(message: str, usage: str = "") -> None:
    """Ends the process with `message` as its last line on stderr and status 2. Under torchrun
    every rank says it (torchrun stops the others once one has ended), and writes it to its
    error file, so torchrun's failure summary that follows shows it as the root cause instead
    of a pointer to its documentation."""
    print(f"{usage}distributed_torch.py: error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the format of torchrun's own @record, with the message for a traceback
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    sys.stdout.flush()
    os._exit(2)  # at once: under gloo, leaving through the interpreter may abort (see main)


def parse_args(argv=None):
    parser = parser_for(__doc__)
    parser.add_argument("--mode", choices=("ddp", "fsdp2", "single"), default="ddp")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    parser.add_argument("--checkpoint", metavar="FOLDER",
                        help="halfway, save the optimizer's state there and go on with a new "
                             "optimizer that loads it (torch.distributed.checkpoint)")
    add_out_argument(parser)
    add_device_argument(parser, torch.cuda.is_available())
    args = parser.parse_args(argv)
    usage = parser.format_usage()
    if args.device == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda, but torch sees no CUDA device: use --device cpu (gloo)", usage)
    if args.mode != "single" and "RANK" not in os.environ:
        refuse(f"--mode {args.mode} runs under torchrun, one process per rank: torchrun "
               f"--nproc_per_node=2 examples/distributed_torch.py --mode {args.mode} (or --mode "
               f"single, in one process)", usage)
    return args


def run(args) -> int:
    """Trains as `args` say, and under torchrun checks the result on rank 0 against one
    process; returns the exit status (0 agreed, 1 differed)."""
    distributed = args.mode != "single"
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    model = wrap(make_model(device), args.mode, args.device)
    params, losses, state_dtypes = train(model, args.optimizer, device, rank, world,
                                         args.checkpoint)
    if distributed:  # the mean of the ranks' half-batch losses: the whole batch's
        dist.all_reduce(losses)
        losses /= world
    losses = losses.tolist()
    if rank != 0:
        return 0
    whose = "mean over ranks" if distributed else "one process"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = f"distributed_{args.mode}_{args.optimizer}"
    path = Path(args.out) / f"{stem}.pt"
    torch.save({"params": params, "losses": losses, "state_dtypes": state_dtypes}, path)
    print(f"{args.mode} {args.optimizer} on {args.device}, {world} process(es): {len(params)} "
          f"params, {STEPS} steps; loss ({whose}) {losses[0]:.6f} at the first step, "
          f"{losses[-1]:.6f} at the last -> {path}")
    if not distributed:
        save_plot(output_path(args.out, f"{stem}.png"), [losses], ["one process"],
                  f"{args.optimizer}, one process, {args.device}", xlabel="step",
                  ylabel="training loss")
        print(f"OK: trained in one process ({STEPS} steps, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}); nothing compared here: under torchrun, --mode ddp or fsdp2 "
              f"checks itself against this run")
        return 0
    reference = make_model(device)
    one_params, one_losses, _ = train(reference, args.optimizer, device)
    one_losses = one_losses.tolist()
    gap = max((p - q).abs().max().item() for p, q in zip(params, one_params, strict=True))
    atol = (ATOL_MUON if args.optimizer.startswith("muon") else
            ATOL_8BIT if "torch.uint8" in state_dtypes else ATOL)
    print(f"one process, same optimizer and batches: loss {one_losses[-1]:.6f} at the last step; "
          f"max |final param difference| = {gap:.3e} (tolerance {atol:g})")
    save_plot(output_path(args.out, f"{stem}.png"), [one_losses, losses],
              ["one process", f"{args.mode}, {world} ranks (mean over ranks)"],
              f"{args.optimizer}, {args.mode} against one process, {args.device}",
              xlabel="step", ylabel="training loss")
    agree = gap <= atol
    print(f"{'OK' if agree else 'FAIL'}: every final param of the {args.mode} run over {world} "
          f"ranks is {'within' if agree else 'NOT within'} {atol:g} of one process's, trained "
          f"with the same optimizer ({args.optimizer}) on the same batches (largest difference "
          f"{gap:.2e})")
    return 0 if agree else 1


def main(argv=None) -> None:
    args = parse_args(argv)
    distributed = args.mode != "single"
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        status = run(args)
    except (ValueError, TypeError) as error:  # mtapply's refusals: its message, no traceback
        refuse(f"rank {dist.get_rank()}: {error}" if distributed else str(error))
    if distributed:
        dist.destroy_process_group()
        if args.device == "cpu":
            # gloo's worker threads may still be releasing finished collectives, which hold
            # Python tensors, while the interpreter shuts down; taking the GIL then aborts the
            # process ("terminate called without an active exception": torch 2.13 with plain
            # torch.optim too, in about one run of ten). Nothing is left to do: leave at once.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
