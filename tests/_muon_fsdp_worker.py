"""Run by tests/test_torch_muon_fsdp.py under torchrun (CPU, gloo): a small MLP under FSDP2,
over a flat mesh of the ranks or a 2 x (ranks / 2) HSDP mesh, stepped by Muon (matrices) with
AdamW (biases); every rank sees the same batches, so the averaged grads are the one-process
grads exactly. Rank 0 then trains the same model in one process and writes to REPORT the
largest difference between the final params, or "FAILED <error>"."""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import mtapply.torch as mt
from _gloo import end_worker


def make_model():
    torch.manual_seed(0)  # 70 rows over 4 ranks: 18, 18, 18, 16; 5 rows: 2, 2, 1, 0
    return torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.GELU(), torch.nn.Linear(70, 5))


def train(model) -> list:
    params = list(model.parameters())
    opt = mt.Muon([{"params": [p for p in params if p.ndim == 2]},
                   {"params": [p for p in params if p.ndim != 2], "use_muon": False, "lr": 3e-3}],
                  lr=0.02)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(16, 40, generator=g)).square().mean().backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params]


def main(mesh_kind: str, report: str) -> None:
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    try:
        mesh = (init_device_mesh("cpu", (2, ranks // 2), mesh_dim_names=("replicate", "shard"))
                if mesh_kind == "hsdp" else init_device_mesh("cpu", (ranks,)))
        model = make_model()
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        got = train(model)
        said = None
        if dist.get_rank() == 0:
            want = train(make_model())
            said = str(max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)))
    except BaseException as error:  # the test reads the report
        said = f"FAILED {type(error).__name__}: {str(error)[:300]}"
    end_worker(report, said)


if __name__ == "__main__":
    main(*sys.argv[1:3])
