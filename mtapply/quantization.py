"""Blockwise dynamic 8-bit quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
Quantization"), the format of mtapply's 8-bit optimizer states, in NumPy.

A tensor is cut into blocks of `block` elements (the last may be shorter; a block never spans
two tensors). Each block keeps its absolute maximum in float32 and each element one byte: the
index of the value of the 256-entry `dynamic_map` nearest to element / absmax.

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
    """(codes uint8 like values.reshape(-1), absmax float32 per block) of one tensor."""
    flat = np.asarray(values, np.float32).reshape(-1)
    absmax = block_absmax(flat, block)
    # times the float32 reciprocal of the block's absmax (one division a block, as the kernel),
    # or divided by it where that reciprocal overflows (a subnormal absmax)
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.where(absmax > 0, np.float32(1) / np.where(absmax > 0, absmax, 1), 0)
    inverse = np.repeat(inverse.astype(np.float32), block)[:flat.size]
    scale = np.repeat(absmax, block)[:flat.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = np.where(np.isinf(inverse), flat / np.where(scale > 0, scale, 1),
                              flat * inverse)
    return nearest_code(normalized, signed), absmax


def dequantize_blockwise(codes: np.ndarray, absmax: np.ndarray, signed: bool,
                         block: int = BLOCK) -> np.ndarray:
    """float32 values of one tensor's codes (flat)."""
    codes = np.asarray(codes, np.uint8).reshape(-1)
    scale = np.repeat(np.asarray(absmax, np.float32), block)[:codes.size]
    return dynamic_map(signed)[codes] * scale


def block_absmax(flat: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The absolute maximum of each block of a flat tensor (float32)."""
    count = n_blocks(flat.size, block)
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


# The kernel finds a code in a few steps: a guide table indexed by the sign, exponent and top
# GUIDE_BITS mantissa bits of the normalized value (magnitudes clamped to [2**-23, 1]) gives the
# number of midpoints below the cell; the few midpoints inside the cell are then compared. With
# 7 bits no cell holds more than one midpoint of either map, for tables of 5.9 kB per map.
GUIDE_BITS = 7
GUIDE_LOW, GUIDE_HIGH = (127 - 23) << GUIDE_BITS, 127 << GUIDE_BITS
GUIDE_CELLS = GUIDE_HIGH - GUIDE_LOW + 1  # cells per sign


@functools.lru_cache(maxsize=None)
def code_guide(signed: bool) -> tuple:
    """(guide, steps): guide[sign * GUIDE_CELLS + cell] (uint8) is the number of midpoints
    below every value of the cell, and no cell holds more than `steps` midpoints, so
    guide + #{j < steps: midpoints[guide + j] < x} (midpoints past the last one being +inf)
    is `nearest_code` of any x in the cell."""
    middle = midpoints(signed).astype(np.float64)
    first = np.arange(GUIDE_CELLS, dtype=np.uint32) + np.uint32(GUIDE_LOW)
    starts = (first << np.uint32(23 - GUIDE_BITS)).view(np.float32).astype(np.float64)
    low, high = starts.copy(), np.append(starts[1:], np.inf)
    low[0] = 0.0  # the first cell holds every smaller magnitude, the last every larger one
    guide, steps = [], 0
    for lo, hi in ((low, high), (-high, -low)):  # positive values, then negative ones
        below = np.searchsorted(middle, lo, side="left")
        steps = max(steps, int((np.searchsorted(middle, hi, side="right") - below).max()))
        guide.append(below)
    table = np.concatenate(guide).astype(np.uint8)
    table.setflags(write=False)
    return table, steps


def guided_code(normalized: np.ndarray, signed: bool) -> np.ndarray:
    """`nearest_code` found as the kernel finds it (for tests of the guide)."""
    guide, steps = code_guide(signed)
    x = np.asarray(normalized, np.float32).reshape(-1)
    bits = x.view(np.uint32)
    magnitude = np.clip((bits & np.uint32(0x7FFFFFFF)) >> np.uint32(23 - GUIDE_BITS),
                        GUIDE_LOW, GUIDE_HIGH) - GUIDE_LOW
    code = guide[(bits >> np.uint32(31)) * GUIDE_CELLS + magnitude].astype(np.int64)
    padded = np.append(midpoints(signed), np.full(steps, np.inf, np.float32))
    found = code + sum((padded[code + j] < x) for j in range(steps))
    return np.where(np.isnan(x), 255, found).astype(np.uint8)


def nearest_code(normalized: np.ndarray, signed: bool) -> np.ndarray:
    """The index of the map value nearest to each value in [-1, 1] (ties to the lower)."""
    return np.searchsorted(midpoints(signed), normalized, side="left").astype(np.uint8)


__all__ = ["BLOCK", "GUIDE_BITS", "GUIDE_CELLS", "block_absmax", "code_guide",
           "dequantize_blockwise", "dynamic_map", "guided_code", "midpoints", "n_blocks",
           "nearest_code", "quantize_blockwise"]
