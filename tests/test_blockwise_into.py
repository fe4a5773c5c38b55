"""The CPU's in-place 8-bit codec (`mtapply._blockwise_into`) gives the codes, scales and values
of `mtapply.quantization`, bit for bit."""
import numpy as np
import pytest

from mtapply import _blockwise_into as into
from mtapply import quantization


def _bits_under_test(signed: bool) -> np.ndarray:
    """Finite float32 bits: every top 16 bits with the low 16 at their ends and middle, each
    midpoint and its neighbours of either sign, and random bits."""
    top = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    middle = quantization.midpoints(signed).view(np.uint32)
    parts = [top | np.uint32(low) for low in (0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF)]
    for sign in (0, 0x80000000):
        parts += [(middle | np.uint32(sign)) + np.uint32(d) for d in (0, 1)]
        parts += [(middle | np.uint32(sign)) - np.uint32(1)]
    parts.append(np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
                 .astype(np.uint32))
    bits = np.concatenate(parts)
    return bits[np.isfinite(bits.view(np.float32))]


@pytest.mark.parametrize("signed", [True, False])
def test_codes_by_top_words_are_guided_codes(signed):
    bits = _bits_under_test(signed)
    expected = quantization.guided_code(bits.view(np.float32), signed)
    codes = np.empty(bits.size, np.uint8)
    into._codes_into(bits.copy(), signed, codes, np.empty(bits.size, np.uint32),
                     np.empty(bits.size, np.intp))
    np.testing.assert_array_equal(codes, expected)


def _moments(rng, n: int, signed: bool) -> np.ndarray:
    values = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    values *= np.float32(10.0) ** rng.integers(-6, 1, n).astype(np.float32)
    if n > 8:
        values[3], values[4] = 0.0, -0.0
    return values if signed else values * values


def _quantize(values: np.ndarray, signed: bool) -> tuple:
    codes = np.full(values.size, 7, np.uint8)
    absmax = np.full(quantization.n_blocks(values.size), -1, np.float32)
    into.quantize_into(values.copy(), signed, codes, absmax, np.empty(values.size, np.uint32),
                       np.empty(values.size, np.intp))
    return codes, absmax


@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1000, 4095, 4096, 5000, 65535, 65536])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_and_dequantize_as_quantization(n, signed):
    rng = np.random.default_rng(n)
    values = _moments(rng, n, signed)
    codes, absmax = _quantize(values, signed)
    want_codes, want_absmax = quantization.quantize_blockwise(values, signed)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(absmax.view(np.uint32), want_absmax.view(np.uint32))
    back = into.dequantize_into(codes, absmax, signed, np.empty(n, np.float32))
    want = quantization.dequantize_blockwise(want_codes, want_absmax, signed)
    np.testing.assert_array_equal(back.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("signed", [True, False])
def test_non_finite_and_subnormal_blocks_as_quantization(signed):
    values = _moments(np.random.default_rng(1), 1300, signed)
    values[5], values[600], values[601] = np.nan, np.inf, -np.inf
    values[768:1024] = np.float32(1e-42)  # a block of subnormal absmax: its reciprocal overflows
    codes, absmax = _quantize(values, signed)
    want_codes, want_absmax = quantization.quantize_blockwise(values, signed)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(absmax.view(np.uint32), want_absmax.view(np.uint32))
