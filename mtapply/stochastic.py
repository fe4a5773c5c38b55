"""Stochastic rounding to bfloat16 with counter-based random bits (Philox4x32-10), in NumPy:
the definition the kernels follow, so results are reproducible and CUDA-graph safe.

A float32 value between two neighbouring bfloat16 values rounds up with probability equal to
its distance from the lower one (over their gap): its 16 low bits are added to 16 random bits
and the sum truncated. The bits of element `index` of tensor `tensor` at `step` are those of
Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") keyed by the
64-bit seed, at counter (index // 4 low and high words, step, tensor), word index % 4, its low
16 bits. NaN and infinities keep their value.
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32(counter: np.ndarray, key: tuple) -> np.ndarray:
    """Philox4x32-10 of counters (..., 4) uint32 under key (k0, k1): (..., 4) uint32."""
    c = [np.asarray(counter, np.uint32)[..., k].astype(np.uint64) for k in range(4)]
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & _LOW, p1 >> np.uint64(32), p1 & _LOW
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        with np.errstate(over="ignore"):
            k0, k1 = k0 + _W0, k1 + _W1
    return np.stack([x.astype(np.uint32) for x in c], axis=-1)


def random_bits16(n: int, seed: int, step: int, tensor: int = 0) -> np.ndarray:
    """The 16 random bits of each of a tensor's n elements (uint32 values below 2**16)."""
    index = np.arange(n, dtype=np.uint64)
    group = index >> np.uint64(2)
    counter = np.stack([(group & _LOW).astype(np.uint32),
                        (group >> np.uint64(32)).astype(np.uint32),
                        np.full(n, step, np.uint32), np.full(n, tensor, np.uint32)], axis=-1)
    words = philox4x32(counter, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    return words[np.arange(n), (index & np.uint64(3)).astype(np.intp)] & np.uint32(0xFFFF)


def round_to_bfloat16_stochastic(values: np.ndarray, seed: int, step: int,
                                 tensor: int = 0) -> np.ndarray:
    """float32 values rounded stochastically to bfloat16, as raw uint16 bits (flat)."""
    flat = np.asarray(values, np.float32).reshape(-1)
    bits = flat.view(np.uint32)
    finite = np.isfinite(flat)
    with np.errstate(over="ignore"):
        summed = bits + np.where(finite, random_bits16(flat.size, seed, step, tensor), 0)
    rounded = (summed >> np.uint32(16)).astype(np.uint16)
    # a NaN keeps a quiet NaN's bits; an infinity (no low bits) truncates to itself
    return np.where(np.isnan(flat), np.uint16(0x7FC0), rounded)


__all__ = ["philox4x32", "random_bits16", "round_to_bfloat16_stochastic"]
