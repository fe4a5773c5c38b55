"""The incremental overlap check of `Plan.rebind_addresses` agrees with the full check."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mtapply
from mtapply._validate import check_no_overlap


def _plan(sizes):
    """An Adam plan over NumPy arrays carved from one buffer, so addresses are easy to aim."""
    total = 4 * sum(sizes) + 64
    buffer = np.random.default_rng(0).standard_normal(total).astype(np.float32)
    views, offset = {s: [] for s in ("params", "grads", "exp_avgs", "exp_avg_sqs")}, 0
    for slot in views:
        for n in sizes:
            views[slot].append(buffer[offset:offset + n])
            offset += n
    return mtapply.adam_plan(**views), buffer


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8),
       shifts=st.data())
def test_incremental_check_matches_the_full_check(sizes, shifts):
    plan, buffer = _plan(sizes)
    base = buffer.ctypes.data
    span = buffer.nbytes
    # new grad addresses anywhere in (or beyond) the buffer, 4-byte aligned
    addresses = np.array([base + 4 * shifts.draw(st.integers(-10, span // 4 + 10))
                          for _ in sizes], dtype=np.uint64)
    full_error = None
    try:
        check_no_overlap(plan._extents({"grads": addresses}), plan.spec.written)
    except ValueError as error:
        full_error = error
    if full_error is None:
        plan._check_against_written("grads", addresses)
    else:
        with pytest.raises(ValueError, match="share memory"):
            plan._check_against_written("grads", addresses)
