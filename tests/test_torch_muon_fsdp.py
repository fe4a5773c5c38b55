"""mtapply.torch.Muon over FSDP2 shards on four CPU ranks (gloo, torchrun): uneven and empty
shards of a flat mesh, and a 2 x 2 HSDP mesh (replicated over one dimension, sharded over the
other). Every rank sees the same batches, so the averaged grads are the one-process grads
exactly, and the whole matrices gathered for Newton-Schulz give the one-process params to the
bit."""
import subprocess

import pytest

from _gloo import needs_gloo
from test_examples import _env, _needs_mtapply_torch, _torchrun

WORKER = str(__import__("pathlib").Path(__file__).resolve().parent / "_muon_fsdp_worker.py")


@pytest.mark.parametrize("mesh", ["flat", "hsdp"])
def test_muon_over_fsdp2_steps_as_one_process_to_the_bit(tmp_path, mesh):
    _needs_mtapply_torch()
    needs_gloo()
    report = tmp_path / "report"
    done = subprocess.run(_torchrun() + ["--standalone", "--nproc_per_node=4", WORKER, mesh,
                                         str(report)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert report.exists(), done.stdout + done.stderr
    assert report.read_text() == "0.0", report.read_text()
