"""Run by tests/test_torch_fsdp_state.py under torchrun (CPU, gloo): FSDP2 shards of uneven
and empty sizes stepped by an optimizer with 8-bit state, saved through
torch.distributed.checkpoint, loaded into a new optimizer. Each rank writes one line to
FOLDER.STAGE.rankR: "OK" with the states equal, or "FAILED <error>"."""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mtapply.torch as mt
from _gloo import end_worker

OPTIMIZERS = {
    "adamw8bit": lambda params: mt.AdamW8bit(params, lr=1e-2, min_8bit_size=256),
    "lion8bit": lambda params: mt.Lion(params, lr=1e-3, state_bits=8, min_8bit_size=256),
    "muon8bit": lambda params: _muon(list(params), state_bits=8, min_8bit_size=256),
}


def _muon(params, **options):
    """Muon for the matrices, AdamW for the bias, in one optimizer."""
    return mt.Muon([{"params": [p for p in params if p.ndim == 2]},
                    {"params": [p for p in params if p.ndim != 2], "use_muon": False}],
                   lr=1e-2, **options)


def main(optimizer: str, stage: str, folder: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # 5 rows over 4 ranks: shards of 2, 2, 1 and 0 rows; 7 rows: uneven shards
    model = torch.nn.Sequential(torch.nn.Linear(1024, 5, bias=False), torch.nn.Linear(5, 7))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    make = OPTIMIZERS[optimizer]
    opt = make(model.parameters())
    g = torch.Generator().manual_seed(1)
    try:
        if stage == "save":
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 1024, generator=g)).square().sum().backward()
                opt.step()
            dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=folder)
            opt.zero_grad(set_to_none=True)
        fresh = make(model.parameters())
        loaded = {"optim": get_optimizer_state_dict(model, fresh)}  # (made by a step of lr 0)
        dcp.load(loaded, checkpoint_id=folder)
        set_optimizer_state_dict(model, fresh, loaded["optim"])
        if stage == "save":
            for p in model.parameters():
                for key, value in opt.state[p].items():
                    mine, theirs = value, fresh.state[p][key]
                    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                    assert torch.equal(local(mine), local(theirs)), (p.shape, key)
        said = "OK"
    except BaseException as error:  # (DCP's CheckpointException): the test reads the report
        causes = getattr(error, "failures", {}).values()  # DCP's: each rank's own error
        said = "; ".join(str(getattr(cause, "exc", cause)) for cause in causes) or str(error)
        said = f"FAILED {type(error).__name__}: {said[:300]}"
    end_worker(f"{folder}.{stage}.rank{rank}", said)


if __name__ == "__main__":
    main(*sys.argv[1:4])
