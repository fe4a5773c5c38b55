"""The jobs of a fused launch (mtapply._blocks.fused_jobs): every block's sums and update once,
each update after every sum of its tensor (what keeps walker.cuh's walk_fused free of deadlock)
and at least `lag` sums after its own."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mtapply._blocks import chunk_map, fused_jobs


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 40), max_size=30), chunk=st.integers(1, 8),
       lag=st.integers(0, 50))
def test_each_update_follows_its_tensors_sums(numels, chunk, lag):
    blocks = chunk_map(np.array(numels, np.int64), chunk)
    jobs = fused_jobs(blocks, lag)
    n = len(blocks)
    assert jobs.dtype == np.int32 and sorted(jobs.tolist()) == sorted([*range(n), *(~np.arange(n)).tolist()])
    position = {int(job): k for k, job in enumerate(jobs)}
    sums = [k for k in range(n)]
    assert [int(j) for j in jobs if j >= 0] == sums  # the sums in block order
    for k in range(n):
        same_tensor = np.flatnonzero(blocks[:, 0] == blocks[k, 0])
        assert position[~k] > max(position[int(b)] for b in same_tensor)
        assert position[~k] > position[min(k + lag, n - 1)]


def test_without_lag_an_update_comes_right_after_its_tensors_last_sums():
    blocks = chunk_map(np.array([3, 1, 4]), 2)  # tensor 0: blocks 0, 1; 1: 2; 2: 3, 4
    assert fused_jobs(blocks, 0).tolist() == [0, 1, ~0, ~1, 2, ~2, 3, 4, ~3, ~4]
