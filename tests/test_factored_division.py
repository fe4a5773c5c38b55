"""The exact quotients of kernels/factored.cuh's Divider (the walker's passes divide each element's
index by its tensor's cols, and its row by the rows) from the words the host makes
(_factored_cuda.divider_words), emulated in 32- and 64-bit words as the device computes them: the
unsigned 32-bit quotient for every index below 2^32 and divisor, the 64-bit one for every index
below 2^63."""
from __future__ import annotations

import numpy as np
import pytest

from mtapply.rules import _factored_cuda, library

LIMIT = 1 << 32  # the narrow quotient's indices: below 2^32
WORD = (1 << 64) - 1


def divider_of(d: int) -> dict:
    """The Divider's words for divisor d (1 <= d < 2^63), as divider_words makes them."""
    wide, narrow, shifts = (w & WORD for w in _factored_cuda.divider_words(d))
    return dict(wide_magic=wide, magic=narrow & 0xffffffff, shift=narrow >> 32,
                wide_first=shifts & 0xffffffff, wide_second=shifts >> 32)


def magic_of(d: int) -> tuple:
    words = divider_of(d)
    return words["magic"], words["shift"]


def quotient(n: np.ndarray, d: int) -> np.ndarray:
    """Divider::quotient(unsigned) on indices n (uint64, each below 2^32)."""
    magic, shift = magic_of(d)
    x = n.astype(np.uint64)
    high = (x * np.uint64(magic)) >> np.uint64(32)  # __umulhi: the product is below 2^64
    return (high + x) >> np.uint64(shift)


def wide_quotient(n: int, d: int) -> int:
    """Divider::quotient(long long) on an index n below 2^63, in 64-bit words."""
    words = divider_of(d)
    t = (words["wide_magic"] * n) >> 64  # __umul64hi
    return ((t + (((n - t) & WORD) >> words["wide_first"])) & WORD) >> words["wide_second"]


def _indices(d: int, rng) -> np.ndarray:
    """Indices below 2^32 where a quotient is most likely to be off: around multiples of d,
    near 2^31 and 2^32, and at random."""
    top = LIMIT - 1
    multiples = np.unique(np.concatenate([
        np.arange(0, 64, dtype=np.uint64), rng.integers(0, top // d + 1, 2000, dtype=np.uint64),
        np.array([top // d, (1 << 31) // d, max(top // d - 1, 0)], dtype=np.uint64)]))
    around = (multiples[:, None] * np.uint64(d)).astype(np.uint64)
    near = np.concatenate([around.ravel() + np.uint64(k) for k in (0, 1, d - 1)] +
                          [around.ravel() - np.uint64(1)])
    edges = np.array([0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, top - 1, top], np.uint64)
    chosen = np.concatenate([near, edges, rng.integers(0, LIMIT, 20000, dtype=np.uint64)])
    return chosen[chosen < np.uint64(LIMIT)]


DIVISORS = ([1, 2, 3, 5, 7, 10, 31, 32, 33, 64, 768, 1024, 2304, 3072, 50257, 65535, 65536,
             65537, 1 << 20, (1 << 20) + 1, 2147483647, 2147483648, 2147483649, 4294967291,
             4294967295, 1 << 32, (1 << 32) + 1, 1 << 40, 1099511627791]
            + [1 << k for k in range(32)] + [(1 << k) + 1 for k in range(1, 32)]
            + [(1 << k) - 1 for k in range(2, 33)])


@pytest.mark.parametrize("d", sorted(set(DIVISORS)))
def test_the_narrow_quotient_is_exact(d):
    rng = np.random.default_rng(d)
    n = _indices(d, rng)
    assert np.array_equal(quotient(n, d), n // np.uint64(d))


def test_the_narrow_quotient_is_exact_for_random_divisors():
    rng = np.random.default_rng(0)
    for d in np.concatenate([rng.integers(1, 5000, 200), rng.integers(1, LIMIT, 200)]):
        n = _indices(int(d), rng)
        assert np.array_equal(quotient(n, int(d)), n // np.uint64(d)), d


WIDE_DIVISORS = sorted(set(DIVISORS + [(1 << 62) - 1, 1 << 62, (1 << 62) + 1, (1 << 63) - 25,
                                      (1 << 63) - 1]))


@pytest.mark.parametrize("d", WIDE_DIVISORS)
def test_the_wide_quotient_is_exact(d):
    rng = np.random.default_rng(d % (1 << 32))
    top = (1 << 63) - 1
    edges = [0, 1, d - 1, d, d + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             (1 << 32) + 1, (1 << 40) - 1, 1 << 40, (1 << 52) + 1, top - 1, top]
    multiples = [int(q) for q in rng.integers(0, top // d + 1, 300, dtype=np.int64)] + [top // d]
    near = [m * d + k for m in multiples for k in (-1, 0, 1, d - 1)]
    randoms = [int(v) for v in rng.integers(0, top, 2000, dtype=np.int64)]
    for n in edges + near + randoms:
        if 0 <= n <= top:
            assert wide_quotient(n, d) == n // d, (n, d)


@pytest.mark.parametrize("d", WIDE_DIVISORS)
def test_the_magic_numbers_fit_their_words(d):
    words = divider_of(d)
    assert 1 <= words["wide_magic"] <= WORD
    assert words["wide_first"] + words["wide_second"] == (d - 1).bit_length()
    if d < LIMIT:
        assert 1 <= words["magic"] < LIMIT and words["shift"] == (d - 1).bit_length() <= 32
    else:
        assert (words["magic"], words["shift"]) == (0, 32)


def test_a_param_that_is_not_factored_divides_by_one():
    words, _ = _factored_cuda.shape_words([(5,), (3, 4)], 1, 1, 1)
    assert words.shape[1] == _factored_cuda.SHAPE_WORDS
    assert tuple(words[0, 4:7]) == tuple(words[0, 7:10]) == _factored_cuda.divider_words(1)
    assert tuple(words[1, 4:10]) == (_factored_cuda.divider_words(3)
                                     + _factored_cuda.divider_words(4))


def test_every_index_of_a_small_tensor_finds_its_row_column_and_matrix():
    """The walker's prologue (f_row, f_matrix, f_col) on every index of stacks of matrices."""
    for batch, rows, cols in ((1, 1, 1), (3, 1, 7), (2, 5, 1), (4, 33, 17), (1, 768, 3072 // 64)):
        index = np.arange(batch * rows * cols, dtype=np.uint64)
        row = quotient(index, cols)
        matrix = quotient(row, rows)
        col = matrix * np.uint64(cols) + (index - row * np.uint64(cols))
        b, r, c = np.unravel_index(index.astype(np.int64), (batch, rows, cols))
        assert np.array_equal(row, b * rows + r)
        assert np.array_equal(matrix, b)
        assert np.array_equal(col, b * cols + c)
        for i in index[::97]:  # and as the 64-bit quotient
            assert wide_quotient(int(i), cols) == int(i) // cols


def test_the_walker_passes_divide_with_the_divider():
    source = library.adafactor().cuda_source()
    assert "by_cols.quotient(row_of)" in source and "by_rows.quotient(f_row)" in source
    assert "index / cols" not in source and "index % cols" not in source
    assert "template <class Index>" in source and "Index index" in source
