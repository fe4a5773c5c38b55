"""The planner (mtapply._blocks) without a GPU: chunk maps, bounds, groups and table bytes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtapply import _source
from mtapply._blocks import (RECORD_ALIGN, Group, chunk_bounds, chunk_map, first_blocks,
                              group_tensors)

CHUNK = _source.CHUNK_ELEMENTS

chunks = st.sampled_from([8, 16, 24, 64, 128])  # small, so that the property test is cheap
numel_lists = st.lists(st.integers(0, 300), max_size=40)


def coverage(numels, chunk: int) -> list[np.ndarray]:
    """How many blocks cover each element of each tensor."""
    numels = np.asarray(numels, dtype=np.int64)
    blocks = chunk_map(numels, chunk)
    begin, end = chunk_bounds(blocks, numels, chunk)
    counts = [np.zeros(n, dtype=np.int64) for n in numels]
    for t, b, e in zip(blocks[:, 0], begin, end):
        counts[t][b:e] += 1
    return counts


@given(numels=numel_lists, chunk=chunks)
def test_every_element_covered_exactly_once(numels, chunk):
    for t, counts in enumerate(coverage(numels, chunk)):
        assert np.all(counts == 1), f"tensor {t} of {numels[t]} elements: coverage {counts}"


@given(numels=numel_lists, chunk=chunks, data=st.data())
def test_first_blocks_are_each_tensors_first_chunks_in_order(numels, chunk, data):
    counts = data.draw(st.lists(st.integers(0, 50), min_size=len(numels), max_size=len(numels)))
    jobs = first_blocks(np.asarray(numels, np.int64), chunk, counts)
    want = [(t, c) for t, n in enumerate(numels) for c in range(min(counts[t], -(-n // chunk)))]
    assert jobs.dtype == np.int32
    assert [tuple(pair) for pair in chunk_map(numels, chunk)[jobs]] == want


@given(numels=numel_lists, chunk=chunks)
def test_blocks_are_whole_chunks_in_order(numels, chunk):
    numels = np.asarray(numels, dtype=np.int64)
    blocks = chunk_map(numels, chunk)
    assert blocks.dtype == np.int32 and blocks.shape == (int(((numels + chunk - 1) // chunk).sum()), 2)
    begin, end = chunk_bounds(blocks, numels, chunk)
    assert np.all(begin < end), "a block with no elements"
    assert np.all(begin % chunk == 0) and np.all(end - begin <= chunk)
    # blocks are sorted by (tensor, chunk): a launch walks tensors in list order
    keys = blocks[:, 0].astype(np.int64) * 2**32 + blocks[:, 1]
    assert np.all(np.diff(keys) > 0)
    # only the last chunk of a tensor may be partial
    partial = end - begin < chunk
    assert np.all(end[partial] == numels[blocks[partial, 0]])


@pytest.mark.parametrize("size,expected_blocks,last_len", [
    (0, 0, None), (1, 1, 1), (CHUNK - 1, 1, CHUNK - 1), (CHUNK, 1, CHUNK), (CHUNK + 1, 2, 1),
    (2 * CHUNK - 1, 2, CHUNK - 1), (2 * CHUNK, 2, CHUNK), (2 * CHUNK + 1, 3, 1),
] + [  # the guide's odd sizes: 2048*32 +- 1, a prime, 7777*77, 555^2
    (n, -(-n // CHUNK), n - (-(-n // CHUNK) - 1) * CHUNK)
    for n in (2048 * 32 - 1, 2048 * 32 + 1, 278011, 7777 * 77, 555**2)
])
def test_chunk_boundaries(size, expected_blocks, last_len):
    numels = np.array([size], dtype=np.int64)
    blocks = chunk_map(numels, CHUNK)
    assert len(blocks) == expected_blocks
    if expected_blocks:
        begin, end = chunk_bounds(blocks, numels, CHUNK)
        assert begin[0] == 0 and end[-1] == size and end[-1] - begin[-1] == last_len
        assert np.all(begin[1:] == end[:-1])  # contiguous, no gap, no overlap


@pytest.mark.parametrize("empty_at", [[0], [2], [4], [0, 2, 4], [0, 1, 2, 3, 4]])
def test_empty_tensors_get_no_block_and_disturb_nothing(empty_at):
    sizes = [5, CHUNK + 3, 77, 2 * CHUNK, 1]
    numels = np.array([0 if i in empty_at else n for i, n in enumerate(sizes)], dtype=np.int64)
    blocks = chunk_map(numels, CHUNK)
    assert not set(blocks[:, 0].tolist()) & set(empty_at)
    # same blocks, after renumbering, as planning the non-empty tensors alone
    kept = [i for i in range(len(sizes)) if i not in empty_at]
    alone = chunk_map(numels[kept], CHUNK)
    assert len(alone) == len(blocks)
    np.testing.assert_array_equal(np.asarray(kept, dtype=np.int64)[alone[:, 0]], blocks[:, 0])
    np.testing.assert_array_equal(alone[:, 1], blocks[:, 1])
    group = Group(device=("cuda", 0), dtypes=("float32",), indices=np.arange(5), numels=numels,
                  pointers=np.arange(1, 6, dtype=np.uint64).reshape(5, 1) * 4096, chunk=CHUNK)
    assert group.n_blocks == len(blocks)


@pytest.mark.parametrize("chunk", sorted({CHUNK, 16384}))
def test_tensor_above_2_31_elements_is_planned_without_allocating_it(chunk):
    big = 2**31 + 5
    numels = np.array([3, big, 7], dtype=np.int64)
    blocks = chunk_map(numels, chunk)
    n_big = -(-big // chunk)
    assert n_big == 2**31 // chunk + 1
    assert len(blocks) == 1 + n_big + 1
    begin, end = chunk_bounds(blocks, numels, chunk)
    mine = blocks[:, 0] == 1
    assert begin[mine][0] == 0 and end[mine][0] == chunk
    assert begin[mine][-1] == 2**31 and end[mine][-1] == big  # the range is 64-bit, not wrapped
    assert blocks[mine][-1, 1] == n_big - 1
    assert tuple(blocks[-1]) == (2, 0) and end[-1] == 7
    group = Group(device=("cuda", 0), dtypes=("float32",) * 4, indices=np.arange(3), numels=numels,
                  pointers=np.zeros((3, 4), dtype=np.uint64), chunk=chunk)
    assert group.n_blocks == len(blocks)
    records = group.table()[group.records_offset:].view(np.int64).reshape(3, 5)
    assert records[1, 0] == big


def test_more_chunks_than_a_grid_holds_is_refused():
    with pytest.raises(ValueError, match="grid limit"):
        chunk_map(np.array([2**40], dtype=np.int64), 8)


keys = st.tuples(st.sampled_from([("cuda", 0), ("cuda", 1), ("cpu", 0)]),
                 st.sampled_from([("float32",) * 4, ("bfloat16", "bfloat16", "float32", "float32"),
                                  ("float16",) * 4, ("float64",) * 4]))


@given(members=st.lists(keys, max_size=60), data=st.data())
def test_group_tensors_by_device_and_dtypes_preserving_indices(members, data):
    n = len(members)
    numels = data.draw(st.lists(st.integers(0, 2**33), min_size=n, max_size=n))
    pointers = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=4 * n, max_size=4 * n)),
                        dtype=np.uint64).reshape(n, 4)
    groups = group_tensors([d for d, _ in members], [t for _, t in members], numels, pointers, 64)
    assert len(groups) == len(set(members))
    assert [(g.device, g.dtypes) for g in groups] == list(dict.fromkeys(members))  # first-seen order
    seen = np.concatenate([g.indices for g in groups]) if groups else np.zeros(0, dtype=np.int64)
    assert sorted(seen.tolist()) == list(range(n))
    for g in groups:
        assert np.all(np.diff(g.indices) > 0), "indices keep list order"
        assert all(members[i] == (g.device, g.dtypes) for i in g.indices)
        np.testing.assert_array_equal(g.numels, np.asarray(numels, dtype=np.int64)[g.indices])
        np.testing.assert_array_equal(g.pointers, pointers[g.indices])
        assert g.chunk == 64


def decode(table: np.ndarray, n_blocks: int, n_tensors: int, n_slots: int):
    """(blocks, numels, pointers) read back from a table's bytes as the kernel reads them."""
    blocks = table[:n_blocks * 8].view(np.int32).reshape(n_blocks, 2)
    offset = -(-n_blocks * 8 // RECORD_ALIGN) * RECORD_ALIGN
    records = table[offset:].view(np.int64).reshape(n_tensors, n_slots + 1)
    return blocks, table[n_blocks * 8:offset], records[:, 0], records[:, 1:].view(np.uint64)


@given(numels=st.lists(st.integers(0, 5000), max_size=30), n_slots=st.integers(1, 6),
       chunk=chunks, data=st.data())
def test_table_bytes_decode_to_blocks_and_records(numels, n_slots, chunk, data):
    n = len(numels)
    pointers = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n * n_slots,
                                           max_size=n * n_slots)), dtype=np.uint64).reshape(n, n_slots)
    group = Group(device=("cuda", 0), dtypes=("float32",) * n_slots, indices=np.arange(n),
                  numels=np.asarray(numels, dtype=np.int64), pointers=pointers, chunk=chunk)
    table = group.table()
    assert table.dtype == np.uint8
    assert group.records_offset % RECORD_ALIGN == 0
    assert table.nbytes == group.records_offset + n * (n_slots + 1) * 8
    blocks, padding, got_numels, got_pointers = decode(table, group.n_blocks, n, n_slots)
    np.testing.assert_array_equal(blocks, chunk_map(group.numels, chunk))
    assert not padding.any()
    np.testing.assert_array_equal(got_numels, numels)
    np.testing.assert_array_equal(got_pointers, pointers)  # high-bit addresses survive int64 storage


def test_100000_tensors_plan_into_one_launch():
    n = 100_000
    rng = np.random.default_rng()
    numels = rng.integers(0, CHUNK + 1, n)  # at most one chunk each
    pointers = (np.arange(4 * n, dtype=np.uint64) * 4096 + 2**40).reshape(n, 4)
    groups = group_tensors([("cuda", 0)] * n, [("float32",) * 4] * n, numels, pointers, CHUNK)
    assert len(groups) == 1
    group = groups[0]
    np.testing.assert_array_equal(group.indices, np.arange(n))
    assert group.n_blocks == int(np.count_nonzero(numels))  # every tensor fits in one chunk
    blocks, _, got_numels, got_pointers = decode(group.table(), group.n_blocks, n, 4)
    np.testing.assert_array_equal(blocks[:, 0], np.flatnonzero(numels))
    assert not blocks[:, 1].any()
    np.testing.assert_array_equal(got_numels, numels)
    np.testing.assert_array_equal(got_pointers, pointers)


@given(numels=st.lists(st.integers(0, 3 * CHUNK), max_size=30),
       dtypes=st.sampled_from([("float32",) * 4, ("bfloat16",) * 4, ("float64",) * 4,
                               ("bfloat16", "bfloat16", "float32", "float32")]))
def test_a_block_is_one_warp_exactly_where_every_chunk_takes_one_vector_pass_of_it(numels, dtypes):
    threads = _source.block_threads(numels, CHUNK, dtypes)
    fits = max(numels, default=0) <= 32 * _source.vector_width(dtypes)
    if fits:
        assert threads == 32
    else:
        idle = _source.idle_share(numels, CHUNK, _source.BLOCK_THREADS * _source.vector_width(dtypes))
        narrow = idle > _source.IDLE_SHARE
        assert threads == (_source.NARROW_THREADS if narrow else _source.BLOCK_THREADS)


def _idle_by_walking(numels, chunk, stride):
    """The idle element slots of a walk in strides, counted chunk by chunk and stride by stride."""
    used = slots = 0
    for n in numels:
        for begin in range(0, n, chunk):
            for start in range(begin, min(begin + chunk, n), stride):
                slots += stride
                used += min(stride, min(begin + chunk, n) - start)
    return 1 - used / slots if slots else 0.0


@given(numels=st.lists(st.integers(0, 3 * CHUNK), max_size=20),
       stride=st.sampled_from([128, 512, 1024, 2048]))
def test_the_idle_share_is_that_of_walking_every_chunk_in_strides(numels, stride):
    assert _source.idle_share(numels, CHUNK, stride) == pytest.approx(_idle_by_walking(numels, CHUNK, stride))


def test_lists_of_short_chunks_get_blocks_of_128_threads_and_their_kernels_say_so():
    from mtapply import REGISTRY

    adam, fp32 = REGISTRY["adam"](), ("float32",) * 4
    ragged = np.random.default_rng(0).integers(256, 4097, size=1000)  # 18% of 256-thread strides idle
    full = np.array([768 * 2304, 768 * 768, 50257 * 768, 768])  # gpt2's shapes: full chunks
    assert adam.threads_for(fp32, ragged) == _source.NARROW_THREADS == 128
    assert adam.threads_for(fp32, full) == _source.BLOCK_THREADS
    assert "#define MTA_BLOCK 128\n" in adam.source(fp32, 128)
    for threads in (32, 256):  # a warp runs the whole block's kernel: its chunk ends in one stride
        assert "#define MTA_BLOCK 256\n" in adam.source(fp32, threads)
    assert REGISTRY["lars"]().threads_for(fp32, ragged) == _source.BLOCK_THREADS  # block sums


def test_chunks_that_each_have_an_sm_to_themselves_get_whole_blocks():
    from mtapply import REGISTRY

    adam, fp32 = REGISTRY["adam"](), ("float32",) * 4
    norms_and_biases = np.array([768, 2304, 3072, 768] * 24 + [768, 768])  # gpt2-124M's, 98
    assert adam.threads_for(fp32, norms_and_biases) == _source.NARROW_THREADS  # GPU unknown
    assert adam.threads_for(fp32, norms_and_biases, sms=132) == _source.BLOCK_THREADS
    assert adam.threads_for(fp32, norms_and_biases, sms=97) == _source.NARROW_THREADS
    # a tensor longer than a chunk takes a block per chunk
    assert _source.n_chunks([CHUNK + 1, CHUNK, 0, 1], CHUNK) == 4
    ragged = np.array([2 * CHUNK + 300] + [300] * 10)  # 13 chunks, 11 of them mostly idle
    assert adam.threads_for(fp32, ragged, sms=12) == _source.NARROW_THREADS
    assert adam.threads_for(fp32, ragged, sms=13) == _source.BLOCK_THREADS
    assert adam.threads_for(fp32, np.array([100]), sms=132) == 32  # one warp's stride still


def test_small_tensors_get_narrow_blocks_unless_a_pass_sums_over_the_block():
    from mtapply import REGISTRY
    from mtapply.ops import Adam8bitSpec

    fp32, tiny, mixed = ("float32",) * 4, np.full(2000, 100), np.array([100, 50_000])
    adam = REGISTRY["adam"]()
    assert adam.threads_for(fp32, tiny) == 32  # 100 elements: 25 threads of 4
    assert adam.threads_for(fp32, np.array([128])) == 32
    assert adam.threads_for(fp32, np.array([129])) == _source.NARROW_THREADS  # one stride, 87% idle
    assert adam.threads_for(("bfloat16",) * 4, np.array([256])) == 32  # vectors of 8
    assert adam.threads_for(fp32, mixed) == _source.BLOCK_THREADS
    assert adam.threads_for(fp32, np.array([], np.int64)) == 32
    for name in ("lars", "lamb"):  # per-tensor norms: block sums over whole blocks
        assert REGISTRY[name]().threads_for(fp32, tiny) == _source.BLOCK_THREADS
    quantized = ("float32", "float32", "uint8", "uint8", "float32", "float32")
    assert Adam8bitSpec().threads_for(quantized, tiny) == _source.BLOCK_THREADS
    assert Adam8bitSpec().threads_for(("float32",) * 6, tiny) == 32
    from mtapply.rules import library  # an 8-bit rule's groups of codes, however small
    eight = library.lion().with_state_bits(8, threshold=1).spec()
    assert eight.threads_for(("float32", "float32", "uint8", "float32"), tiny) == _source.BLOCK_THREADS
    assert eight.threads_for(("float32",) * 4, tiny) == 32


def test_adam_decay_mask_scales_weight_decay_per_tensor_and_is_checked():
    """AdamSpec(decay_mask=...) (mtapply.optax.adamw's mask): no weight decay where a tensor's
    flag is False, as the float64 reference with weight_decay 0; a mask of another length is
    refused, naming it, before anything is written."""
    from mtapply import reference
    from mtapply.plan import Plan
    from mtapply.ops import AdamSpec

    rng = np.random.default_rng(7)
    tensors = {name: [rng.standard_normal(n).astype(np.float32) for n in (5, 9)]
               for name in ("params", "grads", "exp_avgs", "exp_avg_sqs")}
    for v in tensors["exp_avg_sqs"]:
        np.abs(v, out=v)
    want = [reference.adam(*(tensors[k][i].astype(np.float64) for k in tensors), None, lr=0.1,
                           step=3, weight_decay=wd, decoupled_weight_decay=True)
            for i, wd in enumerate((0.5, 0.0))]
    spec = AdamSpec(decoupled_weight_decay=True, decay_mask=[True, False])
    Plan(spec, tensors).step(lr=0.1, step=3, weight_decay=0.5)
    for i, (p, m, v, _) in enumerate(want):
        np.testing.assert_allclose(tensors["params"][i], p, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(tensors["exp_avg_sqs"][i], v, rtol=1e-6, atol=1e-7)
    before = [p.copy() for p in tensors["params"]]
    with pytest.raises(ValueError, match="decay_mask has 1 flags but params has 2"):
        Plan(AdamSpec(decoupled_weight_decay=True, decay_mask=[True]), tensors)
    assert all(np.array_equal(a, b) for a, b in zip(tensors["params"], before))


def test_adam_decay_factors_and_lr_labels_are_checked_before_anything_is_written():
    """decay_mask may give any factor >= 0 of weight_decay per tensor; lr_labels one label
    index per tensor. Bad values and wrong lengths are refused, naming them."""
    from mtapply import reference
    from mtapply.plan import Plan
    from mtapply.ops import AdamSpec

    rng = np.random.default_rng(8)
    tensors = {name: [rng.standard_normal(n).astype(np.float32) for n in (5, 9)]
               for name in ("params", "grads", "exp_avgs", "exp_avg_sqs")}
    for v in tensors["exp_avg_sqs"]:
        np.abs(v, out=v)
    want = [reference.adam(*(tensors[k][i].astype(np.float64) for k in tensors), None, lr=lr,
                           step=2, weight_decay=wd, decoupled_weight_decay=True)
            for i, (lr, wd) in enumerate(((0.1, 0.25), (0.01, 0.0)))]
    spec = AdamSpec(decoupled_weight_decay=True, decay_mask=[0.5, 0.0], lr_labels=[1, 0])
    assert dict(spec.flags)["LR_LABELS"] and "lr_label_array" in spec.arg_fields
    Plan(spec, tensors).step(lr=(0.1, 0.01), step=2, weight_decay=0.5)  # per tensor on the CPU
    for i, (p, _, v, _) in enumerate(want):
        np.testing.assert_allclose(tensors["params"][i], p, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(tensors["exp_avg_sqs"][i], v, rtol=1e-6, atol=1e-7)
    for bad, match in (({"decay_mask": [1.0, -0.5]}, r"decay_mask\[1\]"),
                       ({"decay_mask": [float("nan"), 1.0]}, r"decay_mask\[0\]"),
                       ({"lr_labels": [0, -1]}, r"lr_labels\[1\]"),
                       ({"lr_labels": [0, 1.5]}, r"lr_labels\[1\]")):
        with pytest.raises(ValueError, match=match):
            AdamSpec(decoupled_weight_decay=True, **bad)
    before = [p.copy() for p in tensors["params"]]
    with pytest.raises(ValueError, match="lr_labels has 3 labels but params has 2"):
        Plan(AdamSpec(lr_labels=[0, 1, 2]), tensors)
    assert all(np.array_equal(a, b) for a, b in zip(tensors["params"], before))
