"""8-bit states of FSDP2 shards (CPU, gloo, torchrun): shards of uneven sizes and an empty one
save and load through torch.distributed.checkpoint exactly; a checkpoint made over 4 shards
does not load over 2 (the codes quantize each shard's own memory) but fails loudly."""
import subprocess

import pytest

from _gloo import needs_gloo
from _one_rank import one_rank_mesh
from test_examples import _env, _needs_mtapply_torch, _torchrun

WORKER = str(__import__("pathlib").Path(__file__).resolve().parent / "_fsdp_state_worker.py")


def _run(ranks: int, optimizer: str, stage: str, folder) -> list:
    """Each rank's report (see the worker)."""
    done = subprocess.run(_torchrun() + ["--standalone", f"--nproc_per_node={ranks}", WORKER,
                                         optimizer, stage, str(folder)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    reports = [folder.parent / f"{folder.name}.{stage}.rank{r}" for r in range(ranks)]
    assert all(path.exists() for path in reports), done.stdout + done.stderr
    return [path.read_text() for path in reports]


@pytest.mark.parametrize("optimizer", ["adamw8bit", "lion8bit", "muon8bit"])
def test_uneven_and_empty_shards_checkpoint_and_another_sharding_is_refused(tmp_path, optimizer):
    _needs_mtapply_torch()
    needs_gloo()
    folder = tmp_path / "checkpoint"
    assert _run(4, optimizer, "save", folder) == ["OK"] * 4
    other = _run(2, optimizer, "load", folder)
    assert all("FAILED" in line and "Size mismatch" in line and "_absmax" in line
               for line in other), other


def test_load_state_dict_refuses_scales_made_over_another_sharding():
    """A param sharded over one rank here, given scales made for two shards: refused, naming
    the entry, before any state is taken."""
    _needs_mtapply_torch()
    import torch
    import mtapply.torch as mt

    with one_rank_mesh() as mesh:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 300), mesh, [Shard(0)]))
        opt = mt.AdamW8bit([param], lr=1e-2, min_8bit_size=256)
        param.grad = distribute_tensor(torch.randn(8, 300), mesh, [Shard(0)])
        opt.step()
        saved = opt.state_dict()
        assert tuple(saved["state"][0]["exp_avg_absmax"].shape) == (1, 10)
        other = DTensor.from_local(torch.ones(1, 5), mesh, [Shard(0)], run_check=False,
                                   shape=(2, 5), stride=(5, 1))  # two shards' rows
        saved["state"][0]["exp_avg_absmax"] = other
        before = opt.state[param]["exp_avg_absmax"].to_local().clone()
        with pytest.raises(ValueError, match=r"exp_avg_absmax.*another sharding"):
            opt.load_state_dict(saved)
        assert torch.equal(opt.state[param]["exp_avg_absmax"].to_local(), before)
