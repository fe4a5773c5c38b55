"""Stochastic rounding to bfloat16 (`mtapply.stochastic`): Philox4x32-10 against the published
known-answer vectors, and the rounding's properties."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mtapply.stochastic import philox4x32, random_bits16, round_to_bfloat16_stochastic

# Random123's known-answer vectors for philox4x32_10: (counter, key, result)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_matches_the_known_answers():
    for counter, key, want in KAT:
        got = philox4x32(np.array([counter], np.uint32), key)[0]
        assert [int(x) for x in got] == list(want), [hex(int(x)) for x in got]


def _neighbours(values):
    """The bfloat16 values just below and above each float32 value (by magnitude), as bits."""
    bits = values.view(np.uint32)
    low = (bits >> 16).astype(np.uint16)
    exact = (bits & 0xFFFF) == 0
    return low, np.where(exact, low, low + 1).astype(np.uint16)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), step=st.integers(1, 2**31), tensor=st.integers(0, 1000),
       values=st.lists(st.floats(-2.0**100, 2.0**100, width=32), min_size=1, max_size=300))
def test_results_are_a_neighbour_and_repeat(seed, step, tensor, values):
    values = np.asarray(values, np.float32)
    got = round_to_bfloat16_stochastic(values, seed, step, tensor)
    low, high = _neighbours(values)
    assert np.all((got == low) | (got == high))
    np.testing.assert_array_equal(got, round_to_bfloat16_stochastic(values, seed, step, tensor))


def test_rounding_is_unbiased_and_steps_draw_anew():
    value = np.float32(1.0 + 2.0**-8 + 2.0**-10)  # 5/8 of the way between two bfloat16s
    low, high = _neighbours(np.array([value]))
    draws = np.stack([round_to_bfloat16_stochastic(np.full(4096, value), seed=7, step=s)
                      for s in range(1, 9)])
    up = np.mean(draws == high[0])
    assert abs(up - 0.625) < 0.02, up
    assert not np.array_equal(draws[0], draws[1])
    as_float = (draws.astype(np.uint32) << 16).view(np.float32)
    assert abs(float(as_float.mean()) - float(value)) < 2e-5


def test_bits_differ_by_tensor_and_seed_and_special_values_keep():
    base = random_bits16(64, seed=1, step=1, tensor=0)
    assert np.all(base < 2**16)
    assert not np.array_equal(base, random_bits16(64, seed=1, step=1, tensor=1))
    assert not np.array_equal(base, random_bits16(64, seed=2, step=1, tensor=0))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    got = round_to_bfloat16_stochastic(special, seed=3, step=1)
    assert list(got[:2]) == [0x7F80, 0xFF80] and got[2] == 0x7FC0
    assert list(got[3:]) == [0x0000, 0x8000]
