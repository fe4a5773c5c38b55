"""Blockwise dynamic 8-bit quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
Quantization"), the format of mtapply's 8-bit optimizer states, in NumPy.

A tensor is cut into blocks of `block` elements (the last may be shorter; a block never spans
two tensors). Each block keeps its absolute maximum in float32 and each element one byte: the
index of the value of the 256-entry `dynamic_map` nearest to element / absmax. Codes hold no
NaN or infinity: a non-finite element is stored as zero, so that it cannot set its block's
absmax and take the block's other elements with it.

The dynamic map follows the paper's dynamic tree: after the sign bit (signed maps only), the
number of leading zero bits E sets the magnitude 10**-E, the first one bit ends it, and the
remaining bits split [0.1, 1] linearly (bin midpoints). The signed map (first moments) has 127
magnitudes of each sign, 0 and 1; the unsigned one (second moments, never negative) gives the
sign bit to the fraction: 254 magnitudes, 0 and 1. Small values keep their relative precision
down to about 1e-6 of the block's maximum.
"""
from __future__ import annotations

import functools

import numpy as np

BLOCK = 256
EXPONENTS = 7  # magnitudes 10**0 .. 10**-6


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 float32 values of the dynamic map, ascending (read-only)."""
    values = [0.0, 1.0]
    for exponent in range(EXPONENTS):
        levels = 2 ** (EXPONENTS - 1 - exponent + (0 if signed else 1))
        edges = np.linspace(0.1, 1.0, levels + 1)
        magnitudes = 10.0 ** -exponent * (edges[:-1] + edges[1:]) / 2
        values += magnitudes.tolist() + ((-magnitudes).tolist() if signed else [])
    table = np.sort(np.asarray(values, np.float32))
    assert table.size == 256, table.size
    table.setflags(write=False)
    return table


def quantize_blockwise(values: np.ndarray, signed: bool, block: int = BLOCK):
    """(codes uint8 like values.reshape(-1), absmax float32 per block) of one tensor; its
    non-finite elements are stored as zero."""
    flat = np.asarray(values, np.float32).reshape(-1)
    finite = np.isfinite(flat)
    if not finite.all():
        flat = np.where(finite, flat, np.float32(0))
    absmax = block_absmax(flat, block)
    # times the float32 reciprocal of the block's absmax (one division a block, as the kernel),
    # or divided by it where that reciprocal overflows (a subnormal absmax)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.where(absmax > 0, np.float32(1) / np.where(absmax > 0, absmax, 1), 0)
    inverse = inverse.astype(np.float32)
    overflows = np.isinf(inverse)
    if flat.size == absmax.size * block:  # whole blocks: each block's factor broadcast
        blocks = flat.reshape(absmax.size, block)
        with np.errstate(invalid="ignore", over="ignore"):
            normalized = blocks * inverse[:, None]
        if overflows.any():
            normalized[overflows] = blocks[overflows] / absmax[overflows, None]
        return guided_code(normalized.reshape(-1), signed), absmax  # as `nearest_code`
    inverse = np.repeat(inverse, block)[:flat.size]
    scale = np.repeat(absmax, block)[:flat.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = np.where(np.isinf(inverse), flat / np.where(scale > 0, scale, 1),
                              flat * inverse)
    return guided_code(normalized, signed), absmax  # as `nearest_code`, by table (faster)


def dequantize_blockwise(codes: np.ndarray, absmax: np.ndarray, signed: bool,
                         block: int = BLOCK) -> np.ndarray:
    """float32 values of one tensor's codes (flat)."""
    codes = np.asarray(codes, np.uint8).reshape(-1)
    absmax = np.asarray(absmax, np.float32)
    values = dynamic_map(signed)[codes]
    if codes.size == absmax.size * block:  # whole blocks: each block's scale broadcast
        return (values.reshape(absmax.size, block) * absmax[:, None]).reshape(-1)
    return values * np.repeat(absmax, block)[:codes.size]


def block_absmax(flat: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The absolute maximum of each block of a flat tensor (float32)."""
    count = n_blocks(flat.size, block)
    if flat.size == count * block:
        magnitudes = np.abs(np.asarray(flat, np.float32)).reshape(count, block)
        return magnitudes.max(axis=1) if count else np.zeros(0, np.float32)
    padded = np.zeros(count * block, np.float32)
    padded[:flat.size] = np.abs(flat)
    return padded.reshape(count, block).max(axis=1) if count else np.zeros(0, np.float32)


def n_blocks(numel: int, block: int = BLOCK) -> int:
    """Blocks (and scales) of a tensor of numel elements."""
    return -(-numel // block)


@functools.lru_cache(maxsize=None)
def midpoints(signed: bool) -> np.ndarray:
    """The 255 float32 midpoints between neighbouring map values (read-only)."""
    table = dynamic_map(signed)
    middle = (table[:-1] + table[1:]) / 2
    middle.setflags(write=False)
    return middle


# The kernel finds a code with one table read and one addition. A value's magnitude, clamped to
# [2**-23, 1], falls in a cell: the top 16 bits of its float32 (exponent and 7 mantissa bits),
# and no cell of either map holds more than one midpoint. One 32-bit word per cell and sign
# holds, in its bits 16-23, the number of midpoints below the cell, and below them a threshold
# chosen so that adding the value's low 16 bits carries exactly when the cell's midpoint lies
# below the value. Each word has the cell's top 16 bits taken off, so the kernel adds the
# whole float (for negative values its magnitude bits flipped, which orders them as the values)
# and reads the code from bits 16-23 of the sum.
CELL_FLOOR = np.float32(2.0 ** -23)  # magnitudes below share the lowest cell (no midpoint there)
CELL_LOW, CELL_HIGH = 0x3400, 0x3F80  # top 16 bits of 2**-23 and of 1.0
CELLS = CELL_HIGH - CELL_LOW + 1  # cells per sign
_MAGNITUDE = 0x7FFFFFFF


@functools.lru_cache(maxsize=None)
def code_words(signed: bool) -> np.ndarray:
    """The kernel's code table (uint32, read-only): words[negative * CELLS + cell], with the
    negative half for signed maps only; `guided_code` shows how a code is read from it."""
    halves = [_cell_words(midpoints(signed), negative)
              for negative in ((False, True) if signed else (False,))]
    table = np.concatenate(halves).astype(np.uint32)
    table.setflags(write=False)
    return table


def _cell_words(middle: np.ndarray, negative: bool) -> np.ndarray:
    """The words of one sign's cells: the midpoints below each cell in bits 16-23, plus the
    threshold of the cell's midpoint (if any), less the cell's top 16 bits as the kernel adds
    them (a negative value's magnitude bits flipped)."""
    sign = np.uint32(0x80000000 if negative else 0)
    top = np.arange(CELL_LOW, CELL_HIGH + 1, dtype=np.uint32)
    # the value of each cell nearest minus infinity: its largest magnitude when negative
    edge = (top << np.uint32(16)) | np.uint32(0xFFFF if negative else 0) | sign
    below = np.searchsorted(middle, edge.view(np.float32), side="left").astype(np.uint32)
    inside = np.zeros(CELLS, np.uint32)  # no midpoint in the cell: never carries
    seen = np.zeros(CELLS, bool)
    middle_bits = middle.view(np.uint32)
    for magnitude in middle_bits[(middle_bits & np.uint32(0x80000000)) == sign] & np.uint32(_MAGNITUDE):
        cell = int(magnitude >> np.uint32(16)) - CELL_LOW
        assert cell >= 0 or magnitude == 0, "a midpoint below the lowest cell"
        if 0 <= cell < CELLS:
            assert not seen[cell], "two midpoints in one cell"
            seen[cell] = True
            low = magnitude & np.uint32(0xFFFF)
            # positive values carry when their low 16 bits exceed the midpoint's; negative ones,
            # whose low bits the kernel flips, when theirs are below it
            inside[cell] = low if negative else np.uint32(0xFFFF) - low
    key_top = (top ^ np.uint32(0x7FFF)) if negative else top
    return (below << np.uint32(16)) + inside - (key_top << np.uint32(16))


def guided_code(normalized: np.ndarray, signed: bool) -> np.ndarray:
    """`nearest_code` found as the kernel finds it, from `code_words` (for tests of the table).

    The kernel's values never exceed 1 + 2**-7 in magnitude (the cell of 1.0), where the clamp
    at 1 changes no code; it codes no NaN (non-finite values are stored as zero), here 255.
    """
    x = np.asarray(normalized, np.float32).reshape(-1)
    # (each step in place on the arrays made here)
    if signed:
        negative = x.view(np.uint32) >> np.uint32(31)
        magnitude = np.abs(x)
    else:  # second moments are never negative
        negative, magnitude = None, x
    # as the kernel's fmaxf, a NaN gives the floor
    clamped = np.fmax(magnitude, CELL_FLOOR, out=magnitude if signed else None)
    bits = np.fmin(clamped, np.float32(1), out=clamped).view(np.uint32)
    cell = bits >> np.uint32(16)
    cell -= np.uint32(CELL_LOW)
    key = bits
    if signed:
        key = negative * np.uint32(_MAGNITUDE)
        key ^= bits
        negative *= np.uint32(CELLS)
        cell += negative
    codes = code_words(signed)[cell]
    codes += key
    codes >>= np.uint32(16)
    codes &= np.uint32(0xFF)
    codes = codes.astype(np.uint8)
    nan = np.isnan(x)
    if nan.any():
        codes[nan] = 255
    return codes


def nearest_code(normalized: np.ndarray, signed: bool) -> np.ndarray:
    """The index of the map value nearest to each value in [-1, 1] (ties to the lower)."""
    return np.searchsorted(midpoints(signed), normalized, side="left").astype(np.uint8)


__all__ = ["BLOCK", "CELLS", "CELL_FLOOR", "CELL_HIGH", "CELL_LOW", "block_absmax", "code_words",
           "dequantize_blockwise", "dynamic_map", "guided_code", "midpoints", "n_blocks",
           "nearest_code", "quantize_blockwise"]
