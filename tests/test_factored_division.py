"""The exact quotients of kernels/factored.cuh's Divider (the walker's passes divide each element's
index by its tensor's cols, and its row by the rows), emulated in 32- and 64-bit NumPy words as
the device computes them."""
from __future__ import annotations

import numpy as np
import pytest

from mtapply.rules import library

LIMIT = 1 << 32  # Divider's narrow path: indices (and divisors) below 2^32


def magic_of(d: int) -> tuple:
    """(magic, shift) as Divider::of computes them for divisor d (1 <= d < 2^32)."""
    if d == 1:
        return 1, 0
    shift = (d - 1).bit_length()  # 64 - __clzll(d - 1): ceil(log2 d)
    numerator = (((1 << shift) - d) << 32) & (2**64 - 1)
    assert ((1 << shift) - d) < LIMIT  # the shifted word keeps every bit
    magic = ((numerator // d) & (LIMIT - 1)) + 1
    assert magic < LIMIT  # the sum fits the unsigned word
    return magic, shift


def quotient(n: np.ndarray, d: int) -> np.ndarray:
    """Divider::quotient's narrow path on indices n (uint64, each below 2^32)."""
    magic, shift = magic_of(d)
    x = n.astype(np.uint64)
    high = (x * np.uint64(magic)) >> np.uint64(32)  # __umulhi: the product is below 2^64
    return (high + x) >> np.uint64(shift)


def _indices(d: int, rng) -> np.ndarray:
    """Indices below 2^32 where a quotient is most likely to be off: around multiples of d,
    near 2^31 and 2^32, and at random."""
    top = LIMIT - 1
    multiples = np.unique(np.concatenate([
        np.arange(0, 64, dtype=np.uint64), rng.integers(0, top // d + 1, 2000, dtype=np.uint64),
        np.array([top // d, (1 << 31) // d, (top // d) - 1], dtype=np.uint64)]))
    around = (multiples[:, None] * np.uint64(d)).astype(np.uint64)
    near = np.concatenate([around.ravel() + np.uint64(k) for k in (0, 1, d - 1)] +
                          [around.ravel() - np.uint64(1)])
    edges = np.array([0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, top - 1, top], np.uint64)
    chosen = np.concatenate([near, edges, rng.integers(0, LIMIT, 20000, dtype=np.uint64)])
    return chosen[chosen < np.uint64(LIMIT)]


DIVISORS = ([1, 2, 3, 5, 7, 10, 31, 32, 33, 64, 768, 1024, 2304, 3072, 50257, 65535, 65536,
             65537, 1 << 20, (1 << 20) + 1, 2147483647, 2147483648, 2147483649, 4294967291,
             4294967295]
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


def test_the_walker_passes_divide_with_the_divider():
    source = library.adafactor().cuda_source()
    assert "by_cols.quotient(index)" in source and "by_rows.quotient(f_row)" in source
    assert "index / cols" not in source and "index % cols" not in source
