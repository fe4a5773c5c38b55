"""Blockwise dynamic quantization (the 8-bit optimizer states' format): the maps, and
properties of quantize/dequantize over hypothesis-drawn tensors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mtapply import quantization
from mtapply.quantization import (BLOCK, block_absmax, dequantize_blockwise, dynamic_map,
                                  nearest_code, quantize_blockwise)


@pytest.mark.parametrize("signed", [True, False])
def test_maps_follow_the_dynamic_tree(signed):
    table = dynamic_map(signed)
    assert table.dtype == np.float32 and table.size == 256
    assert np.all(np.diff(table) > 0), "ascending and distinct"
    assert table[-1] == 1.0 and 0.0 in table
    assert (table.min() < 0) == signed
    magnitudes = np.abs(table[table != 0])
    # each decade 10**-E holds 2**(7 - E) magnitudes (2**(6 - E) of each sign when signed),
    # all but the 1.0 strictly inside [0.1, 1) * 10**-E
    for exponent in range(7):
        low, high = 0.1 * 10.0 ** -exponent, 10.0 ** -exponent
        inside = np.sum((magnitudes > low * (1 - 1e-6)) & (magnitudes < high))
        assert inside == 2 ** (7 - exponent), exponent
    # the smallest: the midpoint of the lowest bin of the last decade
    assert magnitudes.min() == pytest.approx(1e-6 * (0.1 + 0.9 / (2 if signed else 4)), rel=1e-5)


@pytest.mark.parametrize("signed", [True, False])
def test_map_values_survive_a_round_trip(signed):
    table = dynamic_map(signed)
    codes = nearest_code(table, signed)
    np.testing.assert_array_equal(codes, np.arange(256, dtype=np.uint8))


_VALUES = hnp.arrays(np.float32, st.integers(0, 3 * BLOCK + 7),
                     elements=st.floats(-1e4, 1e4, width=32, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(values=_VALUES, signed=st.booleans(), block=st.sampled_from([64, 256, 2048]))
def test_each_element_gets_the_nearest_value_of_its_blocks_scale(values, signed, block):
    if not signed:
        values = np.abs(values)
    codes, absmax = quantize_blockwise(values, signed, block)
    assert codes.dtype == np.uint8 and codes.size == values.size
    assert absmax.size == -(-values.size // block)
    np.testing.assert_array_equal(absmax, block_absmax(values, block))
    got = dequantize_blockwise(codes, absmax, signed, block)
    table = dynamic_map(signed)
    scale = np.repeat(absmax, block)[:values.size]
    for x, s, q in zip(values, scale, got):
        if s == 0:
            assert q == 0
            continue
        best = np.min(np.abs(table * s - x))
        assert abs(q - x) <= best * (1 + 1e-5) + 1e-30 * s


@settings(max_examples=40, deadline=None)
@given(values=_VALUES, signed=st.booleans())
def test_error_is_within_half_a_gap_of_the_map(values, signed):
    """|x - dequantized| <= absmax * (half the map's largest gap) everywhere; the block's
    maximum itself is exact when positive (1.0 is in both maps)."""
    if not signed:
        values = np.abs(values)
    codes, absmax = quantize_blockwise(values, signed)
    got = dequantize_blockwise(codes, absmax, signed)
    half_gap = np.max(np.diff(dynamic_map(signed))) / 2
    scale = np.repeat(absmax, BLOCK)[:values.size]
    assert np.all(np.abs(got - values) <= scale * half_gap * (1 + 1e-5) + 1e-30)
    for k, top in enumerate(absmax):
        block = values[k * BLOCK:(k + 1) * BLOCK]
        if top > 0 and block.max() == top:
            assert got[k * BLOCK + int(np.argmax(block))] == top


def test_blocks_do_not_straddle_tensors():
    """Two tensors quantized one after the other keep their own scales: a large value in one
    leaves the other's precision alone."""
    small = np.full(100, 1e-3, np.float32)
    large = np.full(100, 1e3, np.float32)
    for tensor in (small, large):
        codes, absmax = quantize_blockwise(tensor, signed=True)
        np.testing.assert_array_equal(dequantize_blockwise(codes, absmax, True), tensor)


def test_8bit_adamw_tracks_fp32_adamw_on_a_quadratic():
    """The reference 8-bit AdamW step (blockwise states) against fp32 AdamW on a random
    overdetermined least-squares problem (one minimizer) of a thousand weights, 300 steps: the
    losses agree within 1% and the weights within 8%."""
    from mtapply import reference
    from mtapply.quantization import quantize_blockwise

    rng = np.random.default_rng(0)
    n, rows = 1000, 2000
    a = rng.standard_normal((rows, n)).astype(np.float32) / np.sqrt(n)
    target = rng.standard_normal(rows).astype(np.float32)
    loss = lambda w: float(np.mean((a @ w - target) ** 2))  # noqa: E731
    grad = lambda w: (2.0 / rows * a.T @ (a @ w - target)).astype(np.float32)  # noqa: E731
    w32 = w8 = rng.standard_normal(n).astype(np.float32) * 0.1
    m32 = v32 = np.zeros(n, np.float32)
    m8 = quantize_blockwise(np.zeros(n, np.float32), signed=True)
    v8 = quantize_blockwise(np.zeros(n, np.float32), signed=False)
    hyper = dict(lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True)
    optimum = loss(np.linalg.lstsq(a, target, rcond=None)[0])
    for step in range(1, 301):
        w32, m32, v32, _ = reference.adam(w32, grad(w32), m32, v32, step=step,
                                          dtype=np.float32, **hyper)
        w8, m8, v8 = reference.adam8bit(w8, grad(w8), m8, v8, step=step, **hyper)
        assert m8[0].dtype == np.uint8 and v8[1].dtype == np.float32
    assert loss(w32) < 1.05 * optimum  # both near the minimum: 0.5208 against 0.5139
    assert abs(loss(w8) - loss(w32)) <= 0.01 * loss(w32)  # 0.2% apart
    assert np.linalg.norm(w8 - w32) <= 0.08 * np.linalg.norm(w32)  # 4.7%: the states' rounding


@pytest.mark.parametrize("signed", [True, False])
def test_the_kernels_code_table_finds_the_nearest_code(signed):
    """The kernel's code table (one word per cell of sign, exponent and top mantissa bits, read
    with one addition) gives the same code as the sorted search, for any float32: random bit
    patterns (denormals, huge, inf, NaN), values of [-1, 1], and each midpoint, its negation
    and their neighbours."""
    rng = np.random.default_rng(7)
    middle = quantization.midpoints(signed)
    edges = np.concatenate([middle, -middle])
    values = np.concatenate([
        rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        rng.uniform(-1, 1, 300_000).astype(np.float32),
        edges, np.nextafter(edges, np.float32(2)), np.nextafter(edges, np.float32(-2)),
        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 2.0**-23, 2.0**-24, -2.0**-23,
                  1.0078, -1.0078], np.float32)])
    words = quantization.code_words(signed)
    assert words.dtype == np.uint32 and words.size == (2 if signed else 1) * quantization.CELLS
    np.testing.assert_array_equal(quantization.guided_code(values, signed),
                                  quantization.nearest_code(values, signed))


@pytest.mark.parametrize("signed", [True, False])
def test_a_subnormal_block_maximum_still_gives_the_nearest_codes(signed):
    """1 / absmax overflows for a subnormal absmax: such a block divides instead, so a zero
    stays zero (times an infinite reciprocal it would be NaN)."""
    values = np.array([1e-45, 0.0, 0.0, 3e-45, 2e-39, 0.0], np.float32)
    codes, absmax = quantize_blockwise(values, signed, 2)
    got = dequantize_blockwise(codes, absmax, signed, 2)
    with np.errstate(divide="ignore", over="ignore"):
        assert np.isinf(np.float32(1) / absmax).all()
    table = dynamic_map(signed)
    scale = np.repeat(absmax, 2)[:values.size]
    for x, s, q in zip(values, scale, got):
        assert abs(q - x) == np.min(np.abs(table * s - x))
    assert got[1] == got[2] == got[5] == 0
