"""`mtapply.quantization`'s blockwise 8-bit format, dequantized and quantized into arrays given
(the CPU's 8-bit step): the same codes and scales, bit for bit, in fewer NumPy passes.

Dequantizing looks each code up in the map and scales whole blocks at once. Quantizing finds
each block's absmax as an integer maximum of the magnitudes' bits, and each code with one
lookup and one addition, as the kernel does (`quantization.code_words`), but in a table of
every float32's top 16 bits, clamps and sign folded in. A range whose values are not
all finite, or whose absmax has an infinite reciprocal, is quantized by `quantize_blockwise`.
"""
from __future__ import annotations

import functools

import numpy as np

from . import quantization
from .quantization import BLOCK, CELL_HIGH, CELL_LOW, CELLS

_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INFINITY_BITS = 0x7F800000
_LARGEST, _SMALLEST = np.maximum.reduce, np.minimum.reduce


@functools.lru_cache(maxsize=None)
def top_words(signed: bool) -> np.ndarray:
    """Code words by a finite float32's top 16 bits (uint32, read-only): the code of value x
    (normalized) is bits 16-23 of words[bits >> 16] + key, with key the bits of x, its low 16
    flipped where x is negative and the map signed, as `guided_code` finds it."""
    top = np.arange(1 << 16, dtype=np.uint32)
    negative = (top >> np.uint32(15)).astype(bool)
    magnitude = top & np.uint32(0x7FFF)
    inside = (magnitude >= CELL_LOW) & (magnitude <= CELL_HIGH)
    if signed:
        cell = np.clip(magnitude, CELL_LOW, CELL_HIGH) - CELL_LOW + negative * np.uint32(CELLS)
        key_top = np.where(negative, top ^ np.uint32(0x7FFF), top)
    else:  # a negative value is clamped to the floor, as `guided_code` clamps it
        inside &= ~negative
        cell = np.clip(magnitude, CELL_LOW, CELL_HIGH) - CELL_LOW
        key_top = top
    words = quantization.code_words(signed)[cell] + (key_top << np.uint32(16)) \
        - (top << np.uint32(16))
    # a clamped value's code (its low bits zero): the key's low bits then never carry
    floor = (magnitude < CELL_LOW) | (negative & (not signed))
    ends = np.where(floor, np.float32(quantization.CELL_FLOOR), np.float32(1))
    clamped = np.where(negative & signed, -ends, ends)
    codes = quantization.guided_code(clamped, signed).astype(np.uint32)
    words = np.where(inside, words, (codes << np.uint32(16)) - (top << np.uint32(16)))
    words = words.astype(np.uint32)
    words.setflags(write=False)
    return words


def dequantize_into(codes: np.ndarray, absmax: np.ndarray, signed: bool,
                    out: np.ndarray) -> np.ndarray:
    """`quantization.dequantize_blockwise(codes, absmax, signed)` into `out` (float32, of the
    codes' size). The codes start a block."""
    quantization.dynamic_map(signed).take(codes, out=out, mode="wrap")
    _scale(out, absmax)
    return out


def _scale(values: np.ndarray, factors: np.ndarray) -> None:
    """values *= each block's factor (the last block may be short)."""
    whole = values.size // BLOCK
    blocks = values[:whole * BLOCK].reshape(whole, BLOCK)
    np.multiply(blocks, factors[:whole, None], out=blocks)
    if whole < factors.size:
        tail = values[whole * BLOCK:]
        np.multiply(tail, factors[whole], out=tail)


def quantize_into(values: np.ndarray, signed: bool, codes: np.ndarray, absmax: np.ndarray,
                  words: np.ndarray, index: np.ndarray) -> None:
    """`quantization.quantize_blockwise(values, signed)` written into `codes` (uint8) and
    `absmax` (float32, one per block); `values` (float32, starting a block) is overwritten;
    `words` (uint32) and `index` (intp) are scratch of the values' size."""
    bits = values.view(np.uint32)
    magnitudes = np.bitwise_and(bits, _MAGNITUDE, out=words)
    top = absmax.view(np.uint32)  # non-negative floats order as their bits
    _block_max(magnitudes, top)
    if _LARGEST(top) >= _INFINITY_BITS:  # a NaN or an infinity: zeros in its place
        codes[:], absmax[:] = quantization.quantize_blockwise(values, signed)
        return
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.divide(np.float32(1), absmax)
    if _SMALLEST(top) == 0:  # a block of zeros: times 0
        inverse[top == 0] = 0
    if _LARGEST(inverse) == np.inf:  # a subnormal absmax: divided by, as quantize_blockwise does
        codes[:], absmax[:] = quantization.quantize_blockwise(values, signed)
        return
    _scale(values, inverse)
    _codes_into(bits, signed, codes, words, index)


def _block_max(magnitudes: np.ndarray, out: np.ndarray) -> None:
    """The largest of each block's magnitude bits (the last block may be short)."""
    whole = magnitudes.size // BLOCK
    np.maximum.reduce(magnitudes[:whole * BLOCK].reshape(whole, BLOCK), axis=1, out=out[:whole])
    if whole < out.size:
        out[whole] = _LARGEST(magnitudes[whole * BLOCK:])


def _codes_into(bits: np.ndarray, signed: bool, codes: np.ndarray, words: np.ndarray,
                index: np.ndarray) -> None:
    """The codes of normalized values (their float32 bits, overwritten), by `top_words`."""
    np.right_shift(bits, 16, out=index, casting="unsafe")
    if signed:  # a negative value's low 16 bits flipped: 0xFFFF where the sign bit is set
        np.right_shift(bits.view(np.int32), 31, out=words.view(np.int32))
        np.right_shift(words, 16, out=words)
        np.bitwise_xor(bits, words, out=bits)
    top_words(signed).take(index, out=words, mode="wrap")
    np.add(words, bits, out=words)
    np.right_shift(words, 16, out=words)
    np.copyto(codes, words, casting="unsafe")  # bits 16-23: the code


__all__ = ["dequantize_into", "quantize_into", "top_words"]
