"""The factor pass's tiles and the combine pass (kernels/factored.cuh), emulated on the CPU with
the kernels' index arithmetic: every partial sum lies in the room the host reserves for it
(_factored_cuda.factor_partials), is written once, and the combined sums are the row and column
sums of the stack."""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from mtapply.rules import _factored_cuda

KERNEL = pathlib.Path(__file__).parent.parent / "kernels" / "factored.cuh"
WARPS = 8  # a block of 256 threads


def test_the_host_and_the_kernel_cut_the_same_tiles():
    source = KERNEL.read_text()
    match = re.search(r"constexpr int TILE = (\d+), MAX_TILE_COLS = (\d+);", source)
    assert match, "kernels/factored.cuh declares TILE and MAX_TILE_COLS"
    assert (int(match[1]), int(match[2])) == (_factored_cuda.TILE, _factored_cuda.MAX_TILE_COLS)


def test_the_host_and_the_kernel_lay_out_the_same_shape_words():
    match = re.search(r"constexpr int SHAPE_WORDS = (\d+);", KERNEL.read_text())
    assert match and int(match[1]) == _factored_cuda.SHAPE_WORDS


def tiles_of(batch, rows, cols, n_row):
    """tiles_of's fields (row_parts at 0 of the tensor's partials)."""
    tile_cols = min((cols + 31) // 32 * 32, _factored_cuda.MAX_TILE_COLS)
    tile_rows = _factored_cuda.TILE // tile_cols
    row_groups, col_groups = -(-rows // tile_rows), -(-cols // tile_cols)
    return dict(tile_rows=tile_rows, tile_cols=tile_cols, row_groups=row_groups,
                col_groups=col_groups, col_parts=n_row * col_groups * batch * rows)


def factor_tile(t, tile, batch, rows, cols, terms, n_row, n_col, parts, written):
    """factor_tile's stores, each sum added in the kernel's order (float64 here)."""
    group, band = tile % t["col_groups"], tile // t["col_groups"]
    matrix, row_group = band // t["row_groups"], band % t["row_groups"]
    row0 = matrix * rows + row_group * t["tile_rows"]
    col0 = group * t["tile_cols"]
    n_rows = min(t["tile_rows"], rows - row_group * t["tile_rows"])
    n_cols = min(t["tile_cols"], cols - col0)
    flat = terms.reshape(batch * rows, cols)
    for k in range(n_row):
        for r in range(n_rows):
            j = row0 + r
            at = (k * t["col_groups"] + group) * batch * rows + j
            parts[at] = flat[j, col0:col0 + n_cols].sum()
            written[at] += 1
    for k in range(n_col):
        for c in range(n_cols):
            at = (t["col_parts"] + (k * t["row_groups"] + row_group) * batch * cols
                  + matrix * cols + col0 + c)
            parts[at] = flat[row0:row0 + n_rows, col0 + c].sum()
            written[at] += 1


def combine(t, batch, rows, cols, n_row, n_col, parts):
    """combine_walk's totals: per stack row, then per stack column, the groups in order."""
    row_totals = [[sum(parts[(k * t["col_groups"] + g) * batch * rows + j]
                       for g in range(t["col_groups"])) for j in range(batch * rows)]
                  for k in range(n_row)]
    col_totals = [[sum(parts[t["col_parts"] + (k * t["row_groups"] + g) * batch * cols + c]
                       for g in range(t["row_groups"])) for c in range(batch * cols)]
                  for k in range(n_col)]
    return np.array(row_totals), np.array(col_totals)


SHAPES = [(1, 1, 1), (1, 7, 5), (3, 5, 7), (2, 33, 97), (1, 200, 128), (1, 40, 300),
          (4, 3, 1000), (1, 1000, 3), (2, 129, 65), (1, 4096, 1), (1, 1, 4096)]


@pytest.mark.parametrize("chunk", [4096, _factored_cuda.CHUNK])
@pytest.mark.parametrize("n_row, n_col", [(1, 1), (2, 0), (0, 2)])
@pytest.mark.parametrize("batch, rows, cols", SHAPES)
def test_each_partial_is_stored_once_within_its_room_and_combines_to_the_sums(
        batch, rows, cols, n_row, n_col, chunk):
    room = _factored_cuda.factor_partials(batch, rows, cols, n_row, n_col)
    parts, written = np.zeros(room), np.zeros(room, np.int64)
    terms = np.random.default_rng(rows * cols).random((batch, rows, cols))
    t = tiles_of(batch, rows, cols, n_row)
    chunks = -(-batch * rows * cols // chunk)
    count = batch * t["row_groups"] * t["col_groups"]
    for block in range(chunks):  # factor_walk: a block's tiles
        for tile in range(block, count, chunks):
            factor_tile(t, tile, batch, rows, cols, terms, n_row, n_col, parts, written)
    assert np.all(written == 1)  # every reserved value, each once
    row_totals, col_totals = combine(t, batch, rows, cols, n_row, n_col, parts)
    for k in range(n_row):
        np.testing.assert_allclose(row_totals[k], terms.sum(axis=2).ravel())
    for k in range(n_col):
        np.testing.assert_allclose(col_totals[k], terms.sum(axis=1).ravel())


def test_the_tiles_hold_at_most_a_tile_of_elements_in_whole_warp_rows():
    for cols in (1, 31, 32, 33, 64, 65, 96, 127, 128, 129, 3072):
        t = tiles_of(1, 10, cols, 1)
        assert t["tile_cols"] % 32 == 0 and t["tile_cols"] <= _factored_cuda.MAX_TILE_COLS
        assert t["tile_rows"] * t["tile_cols"] <= _factored_cuda.TILE


def test_the_workspace_reserves_the_partials_after_each_params_means():
    words, total = _factored_cuda.shape_words([(768, 3072), (5,), (2, 3, 4)], 1, 1, 1)
    first = 1 + _factored_cuda.factor_partials(1, 768, 3072, 1, 1)
    assert list(words[:, 3]) == [0, 0, first]
    assert total == first + 2 + _factored_cuda.factor_partials(2, 3, 4, 1, 1)


def share(n, blocks, index):
    each = -(-n // blocks)
    first = min(index * each, n)
    return first, min(first + each, n)


def busy_blocks(n, groups, blocks):
    """A warp a row for many groups, unless the blocks have too few warps (kernels/factored.cuh,
    by_warps)."""
    warps = groups >= 32 and (groups >= 64 or n <= WARPS * blocks)
    each = WARPS if warps else WARPS * 32
    return min(blocks, -(-n // each))


def takes_each_once(n, busy, blocks):
    taken = [j for index in range(blocks) for j in range(*share(n, busy, index))]
    return sorted(taken) == list(range(n)) and busy <= blocks


@pytest.mark.parametrize("chunk", [4096, _factored_cuda.CHUNK])
@pytest.mark.parametrize("batch, rows, cols", SHAPES + [(1, 50257, 768), (12, 768, 3072)])
def test_the_busy_blocks_of_the_combine_and_matrix_passes_take_each_row_once(batch, rows, cols, chunk):
    blocks = -(-batch * rows * cols // chunk)  # the tensor's chunks
    t = tiles_of(batch, rows, cols, 1)
    for n, groups in ((batch * rows, t["col_groups"]), (batch * cols, t["row_groups"])):
        assert takes_each_once(n, busy_blocks(n, groups, blocks), blocks)
    assert takes_each_once(batch, matrix_blocks(batch, blocks), blocks)


def matrix_blocks(batch, blocks):
    """matrix_walk's blocks with work: a block a matrix where there are no more matrices than
    blocks, else a warp a matrix."""
    return batch if batch <= blocks else min(blocks, -(-batch // WARPS))


@pytest.mark.parametrize("chunk", [4096, 32768, _factored_cuda.CHUNK])
@pytest.mark.parametrize("batch, rows, cols", SHAPES + [(1, 50257, 768), (12, 768, 3072),
                                                        (40, 30, 20), (1, 17000, 40)])
def test_the_vector_passes_launch_over_every_block_with_work(batch, rows, cols, chunk):
    blocks = -(-batch * rows * cols // chunk)
    t = tiles_of(batch, rows, cols, 1)
    busy = max(busy_blocks(batch * rows, t["col_groups"], blocks),
               busy_blocks(batch * cols, t["row_groups"], blocks), matrix_blocks(batch, blocks))
    shape = (batch, rows, cols) if batch > 1 else (rows, cols)
    words, _ = _factored_cuda.shape_words([(7,), shape], 1, 1, 1)
    assert list(_factored_cuda.vector_blocks(words, 1, 1, 1, chunk, 32 * WARPS)) == [0, busy]


def test_the_host_and_the_kernel_cut_the_same_whole_row_tiles():
    source = KERNEL.read_text()
    match = re.search(r"constexpr int ROW_TILE = (\d+), ROW_VECTORS = (\d+);", source)
    assert match, "kernels/factored.cuh declares ROW_TILE and ROW_VECTORS"
    assert int(match[1]) == _factored_cuda.ROW_TILE
    # a block's threads take a row of at most 4 elements x ROW_VECTORS each
    assert int(match[2]) == _factored_cuda.ROW_VECTORS
    assert _factored_cuda.MAX_ROW_COLS == 4 * 32 * WARPS * int(match[2])


def row_share(vectors, threads=32 * WARPS, most=3):
    """kernels/factored.cuh's row_share: vectors a thread takes a row (0: none fits)."""
    best, idle = 0, threads
    for q in range(-(-vectors // threads), most + 1):
        if vectors % q or (vectors // q) % 32:
            continue
        if threads % (vectors // q) < idle:
            best, idle = q, threads % (vectors // q)
    return best


def test_the_host_takes_whole_only_the_rows_that_fit_a_block():
    """Rows of whole warps of threads, at most 3 vectors of 4 each (gpt2's 768, 2304, 3072);
    not 1408 = 4 x 32 x 11 columns (no share fits)."""
    taken = []
    for cols in range(4, 2 * _factored_cuda.MAX_ROW_COLS, 4):
        q = row_share(cols // 4) if cols % 128 == 0 else 0
        assert _factored_cuda.rowwise(cols, 2) == bool(q), cols
        if q:
            assert (cols // 4 // q) % 32 == 0 and cols // 4 // q <= 32 * WARPS
            taken.append(cols)
        assert not _factored_cuda.rowwise(cols, 0)
    assert {768, 2304, 3072} <= set(taken) and 1408 not in taken


@pytest.mark.parametrize("shape, whole", [((100, 768), True), ((3, 50, 256), True),
                                          ((17, 3200), False), ((64, 48), False),
                                          ((9, 100), False)])
def test_whole_rows_are_for_product_sums_and_rows_that_fit(shape, whole):
    words, total = _factored_cuda.shape_words([shape], 1, 1, 1, n_products=2)
    assert bool(words[0, 10]) == whole
    batch, rows, cols = (1,) * (3 - len(shape)) + shape
    groups = (-(-rows // -(-_factored_cuda.ROW_TILE // cols)), 1) if whole else None
    if whole:
        assert _factored_cuda.tile_groups(rows, cols, True) == groups
        # per matrix: its mean, 2 products and a check word; rows' sums, and per column and
        # row group its column sum and 2 products
        assert total == batch * (1 + 3) + batch * (rows + 3 * cols * groups[0])
    words, _ = _factored_cuda.shape_words([shape], 1, 1, 1)  # no product sums: never
    assert words[0, 10] == 0


def factor_rows(t, tile, batch, rows, cols, terms, n_row, n_col, products, factor, parts,
                written):
    """factor_rows' stores (kernels/factored.cuh), thread by thread: `products` holds each
    product's element values and whether it has column factors; `factor(j, row_sum)` a row's
    value R_j."""
    threads, vectors = 32 * WARPS, cols // 4
    share = row_share(vectors)
    per_row = vectors // share
    at_once = threads // per_row
    matrix, row_group = tile // t["row_groups"], tile % t["row_groups"]
    row0 = matrix * rows + row_group * t["tile_rows"]
    n_rows = min(t["tile_rows"], rows - row_group * t["tile_rows"])
    flat = terms.reshape(batch * rows, cols)
    first = row_group * batch * cols + matrix * cols
    apart = t["row_groups"] * batch * cols
    sums = {}  # (thread, q, e) -> [column sums..., product sums...]
    totals = np.zeros(len(products))
    for r0 in range(0, n_rows, at_once):
        for thread in range(threads):
            sub, v0 = divmod(thread, per_row)
            r = r0 + sub
            if sub >= at_once or r >= n_rows:
                continue
            j = row0 + r
            if v0 == 0:  # the row's sums, once
                for k in range(n_row):
                    at = k * batch * rows + j
                    parts[at] = flat[j].sum()
                    written[at] += 1
            for q in range(share):
                for e in range(4):
                    c = 4 * (v0 + q * per_row) + e
                    mine = sums.setdefault((thread, q, e), np.zeros(n_col + len(products)))
                    mine[:n_col] += flat[j, c]
                    for k, (values, columns) in enumerate(products):
                        share_of = values.reshape(batch * rows, cols)[j, c] * factor(j, flat[j].sum())
                        if columns:
                            mine[n_col + k] += share_of
                        else:
                            totals[k] += share_of
    outputs = [t["col_parts"] + k * apart for k in range(n_col)] + [
        t["col_parts"] + n_col * apart + k * apart for k in range(len(products))]
    for k, (_, columns) in enumerate(products):
        if not columns:
            for c in range(cols):
                at = outputs[n_col + k] + first + c
                parts[at] = totals[k] if c == 0 else 0.0
                written[at] += 1
    for thread in range(per_row):  # a trip's row 0 adds its rows' sums in order
        for q in range(share):
            for e in range(4):
                c = 4 * (thread + q * per_row) + e
                total = sum(sums.get((s * per_row + thread, q, e), 0.0)
                            for s in range(at_once))
                for k in range(n_col + len(products)):
                    if k >= n_col and not products[k - n_col][1]:
                        continue
                    at = outputs[k] + first + c
                    parts[at] = total[k] if not np.isscalar(total) else 0.0
                    written[at] += 1


@pytest.mark.parametrize("batch, rows, cols", [(1, 100, 768), (3, 50, 256), (1, 1, 3072),
                                               (1, 70, 1152), (1, 600, 128), (2, 33, 384),
                                               (1, 300, 2304)])
def test_whole_row_tiles_store_each_partial_once_and_combine_to_the_sums(batch, rows, cols):
    """Two products (one summed per column, one without column factors, as Adafactor's u^2
    and p^2): every reserved value written once; the combine pass's totals are the row and
    column sums, and each product's sum over the rows of E R per column (or in all)."""
    n_row, n_col = 1, 1
    room = _factored_cuda.factor_partials(batch, rows, cols, n_row, n_col, 2)
    parts, written = np.zeros(room), np.zeros(room, np.int64)
    rng = np.random.default_rng(rows + cols)
    terms = rng.random((batch, rows, cols))
    products = [(rng.random((batch, rows, cols)), True), (rng.random((batch, rows, cols)), False)]
    factor = lambda j, row_sum: 1.0 / (1.0 + row_sum) + j % 3  # noqa: E731
    row_groups, _ = _factored_cuda.tile_groups(rows, cols, True)
    tile_rows = -(-_factored_cuda.ROW_TILE // cols)
    t = dict(row_groups=row_groups, col_groups=1, tile_rows=tile_rows,
             col_parts=n_row * batch * rows)
    for tile in range(batch * row_groups):
        factor_rows(t, tile, batch, rows, cols, terms, n_row, n_col, products, factor, parts,
                    written)
    assert np.all(written == 1)  # every reserved value, each once
    apart = row_groups * batch * cols
    by_group = parts[t["col_parts"]:].reshape(n_col + 2, row_groups, batch * cols).sum(axis=1)
    np.testing.assert_allclose(parts[:batch * rows], terms.sum(axis=2).ravel())
    np.testing.assert_allclose(by_group[0], terms.sum(axis=1).ravel())
    r = np.array([factor(j, s) for j, s in enumerate(terms.reshape(-1, cols).sum(axis=1))])
    weighted = [(v.reshape(-1, cols) * r[:, None]) for v, _ in products]
    np.testing.assert_allclose(by_group[1], weighted[0].reshape(batch, rows, cols)
                               .sum(axis=1).ravel())
    np.testing.assert_allclose(by_group[2].sum(), weighted[1].sum())
    assert apart * (n_col + 2) + t["col_parts"] == room
