"""A one-rank gloo process group and CPU device mesh, for tests of DTensor params on the CPU."""
import contextlib

import pytest


@contextlib.contextmanager
def one_rank_mesh():
    """The mesh of a process group of this process alone; skips where gloo is not available,
    and ends the group afterwards."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.tensor import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
