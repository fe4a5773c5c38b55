"""A one-rank gloo process group and CPU device mesh, for tests of DTensor params on the CPU."""
import contextlib

from _gloo import needs_gloo


@contextlib.contextmanager
def one_rank_mesh():
    """The mesh of a process group of this process alone; skips where gloo is not available,
    and ends the group afterwards."""
    dist = needs_gloo()
    from torch.distributed.tensor import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
