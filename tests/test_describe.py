"""The descriptions the one-call API compares: the compiled torch describer, built here with the
machine's compiler, against the one made of torch's accessors."""
import numpy as np
import pytest

from mtapply import _describe, _native

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def native():
    if _native.library("torch_describe") is None:
        pytest.fail("the native torch describer did not build (see the warning for the compiler's "
                    "message); it must build wherever the tests run")
    return _describe._native_describer()


def _tensors():
    base = torch.randn(6, 8)
    return [torch.randn(3, 4), torch.nn.Parameter(torch.randn(5)), base.t(), base[:, ::2],
            base.reshape(-1)[3:20], torch.empty(3, 0), torch.randn(7).to(torch.bfloat16),
            torch.randn(2, 2).half(), torch.randn(4, dtype=torch.float64), torch.tensor(1.5),
            torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(4, 3)]


def test_native_and_accessor_descriptions_agree(native):
    tensors = _tensors()
    fast = _describe.describe_torch(tensors)
    slow = _describe.describe_torch(tensors, native=False)
    assert fast is not None and slow is not None and fast.shape == slow.shape == (5, len(tensors))
    # every word, the hashes of sizes and strides too: a plan described by one describer (while
    # the other builds) is found again by the other
    np.testing.assert_array_equal(fast, slow)
    assert fast[0, 0] == tensors[0].data_ptr() and fast[1, 4] == 17
    codes = fast[2] & 0xFF
    assert list(codes[6:9]) == [3, 2, 4]  # bfloat16, float16, float64
    assert list((fast[2] >> 24) & 1) == [t.is_contiguous() for t in tensors]
    assert len(set(fast[4])) == len(set(map(torch.Tensor.stride, tensors)))
    assert fast[3, 0] != fast[3, 11]  # (3, 4) and (4, 3)


@pytest.mark.parametrize("tensor", [torch.arange(4), torch.randn(3, dtype=torch.complex64),
                                    torch.randn(4).to_sparse()], ids=["int64", "complex", "sparse"])
def test_lists_the_describers_cannot_read_are_left_to_dlpack(native, tensor):
    tensors = [torch.randn(3), tensor]
    assert _describe.describe_torch(tensors) is None
    assert _describe.describe_torch(tensors, native=False) is None


def test_subclasses_are_left_to_dlpack(native):
    class Mine(torch.Tensor):
        pass

    tensors = [torch.randn(3), torch.randn(3).as_subclass(Mine)]
    assert _describe.describe_torch(tensors) is None
    assert _describe.describe_torch(tensors, native=False) is None


def test_cpu_lists_are_not_described_for_the_one_call_cache(native):
    assert _describe.describe([torch.randn(3)], "torch") is None
    assert _describe.describe([np.ones(3)], "numpy") is None


def test_native_libraries_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MTAPPLY_NATIVE", "0")
    monkeypatch.setattr(_native, "_loaded", {})
    assert _native.library("torch_describe") is None
