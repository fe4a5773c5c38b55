"""The XLA FFI handler library, built here with the machine's compiler against jaxlib's headers:
its bookkeeping of buffer addresses, which decides what a step uploads, without a GPU."""
import ctypes

import numpy as np
import pytest

pytest.importorskip("jax")

from mtapply import _native, _xla  # noqa: E402


@pytest.fixture(scope="module")
def lib():
    library = _native.library("xla_ffi")
    if library is None:
        pytest.fail("the XLA FFI handler did not build (see the warning for the compiler's "
                    "message); it must build wherever the tests run")
    _xla._configure(library)
    return library


def _elements(n):
    return np.full(n, 16, np.int64)


def _group(lib, plan, numels, operands, offsets, device=0, slots=2):
    numels = np.asarray(numels, np.int64)
    operands = np.ascontiguousarray(operands, np.int32)
    offsets = np.ascontiguousarray(offsets, np.int64)
    words = np.arange(20, dtype=np.uint64)
    functions = np.zeros(2, np.uint64)
    assert lib.mta_plan_add_group(plan, device, 2, functions.ctypes.data, 7, 256, len(words),
                                  words.ctypes.data, 0, len(numels), slots, numels.ctypes.data,
                                  operands.ctypes.data, offsets.ctypes.data) == 0


def _records(lib, plan, group, n, slots=2, device=0):
    out = np.zeros(n * (slots + 1), np.int64)
    assert lib.mta_plan_records(plan, device, group, out.ctypes.data) == 0
    return out.reshape(n, slots + 1)


def _refresh(lib, plan, addresses, groups, device=0):
    addresses = np.asarray(addresses, np.uint64)
    spans = np.zeros(2 * groups, np.int64)
    assert lib.mta_plan_refresh(plan, device, addresses.ctypes.data, spans.ctypes.data) == groups
    return spans.reshape(groups, 2)


def test_records_follow_the_buffers_and_only_moved_words_are_uploaded(lib):
    words, operands = np.array([14], np.int32), np.array([4], np.int32)
    plan = lib.mta_plan_create(1, words.ctypes.data, operands.ctypes.data, 5,
                               _elements(5).ctypes.data)
    # three tensors, slot 0 in buffers 0..2, slot 1 all in buffer 3 at byte offsets
    _group(lib, plan, [5, 0, 9], [[0, 3], [1, 3], [2, 3]], [[0, 0], [0, 32], [0, 48]])
    before = _records(lib, plan, 0, 3)
    np.testing.assert_array_equal(before[:, 0], [5, 0, 9])
    assert not before[:, 1:].any()
    buffers = [1000, 2000, 3000, 8000, 77]
    spans = _refresh(lib, plan, buffers, 1)
    records = _records(lib, plan, 0, 3)
    np.testing.assert_array_equal(records[:, 1:], [[1000, 8000], [2000, 8032], [3000, 8048]])
    assert tuple(spans[0]) == (1, 9)  # every address word, from tensor 0 slot 0 to tensor 2 slot 1
    assert tuple(_refresh(lib, plan, buffers, 1)[0]) == (0, 0)  # nothing moved: no upload
    buffers[1] = 2500  # one buffer moved: only its word
    assert tuple(_refresh(lib, plan, buffers, 1)[0]) == (4, 5)
    assert _records(lib, plan, 0, 3)[1, 1] == 2500
    lib.mta_plan_destroy(plan)
    assert lib.mta_plan_records(plan, 0, 0, records.ctypes.data) == -1


def test_groups_and_devices_are_kept_apart(lib):
    none = np.zeros(1, np.int32)
    plan = lib.mta_plan_create(0, none.ctypes.data, none.ctypes.data, 4,
                               _elements(4).ctypes.data)
    _group(lib, plan, [4], [[0, 1]], [[0, 0]], device=0)
    _group(lib, plan, [6], [[2, 3]], [[0, 16]], device=0)
    _group(lib, plan, [8], [[0, 1]], [[0, 0]], device=1)
    spans = _refresh(lib, plan, [10, 20, 30, 40], 2, device=0)
    assert spans.tolist() == [[1, 3], [1, 3]]
    np.testing.assert_array_equal(_records(lib, plan, 1, 1), [[6, 30, 56]])
    np.testing.assert_array_equal(_records(lib, plan, 0, 1, device=1), [[8, 0, 0]])
    assert lib.mta_plan_refresh(plan, 2, ctypes.c_void_p(0), ctypes.c_void_p(0)) == -1
    lib.mta_plan_destroy(plan)


def test_the_handler_is_exported_for_xla(lib):
    import jax

    capsule = jax.ffi.pycapsule(lib.mta_ffi_step)
    assert type(capsule).__name__ == "PyCapsule"


def test_indices_outside_the_calls_buffers_are_refused_at_registration(lib):
    """A plan never reads an address past the call's buffers: a scalar or slot operand at or
    beyond the call's buffer count is refused when registered."""
    words, outside = np.array([14], np.int32), np.array([3], np.int32)
    assert lib.mta_plan_create(1, words.ctypes.data, outside.ctypes.data, 3,
                               _elements(3).ctypes.data) == -1
    inside = np.array([2], np.int32)
    plan = lib.mta_plan_create(1, words.ctypes.data, inside.ctypes.data, 3,
                               _elements(3).ctypes.data)
    assert plan > 0
    numels, operands = np.array([4], np.int64), np.array([[0, 3]], np.int32)
    offsets, functions = np.zeros((1, 2), np.int64), np.zeros(2, np.uint64)
    assert lib.mta_plan_add_group(plan, 0, 2, functions.ctypes.data, 7, 256, 1,
                                  words.ctypes.data, 0, 1, 2, numels.ctypes.data,
                                  operands.ctypes.data, offsets.ctypes.data) == -2
    lib.mta_plan_destroy(plan)
