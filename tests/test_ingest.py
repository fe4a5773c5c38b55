"""The torch fast path describes every tensor exactly as DLPack does."""
import pytest

from mtapply._dlpack import export
from mtapply._torch_fast import torch_ref

torch = pytest.importorskip("torch")


def _tensors():
    base = torch.randn(6, 8)
    return {
        "contiguous": torch.randn(3, 4),
        "parameter": torch.nn.Parameter(torch.randn(5)),
        "transposed": base.t(),
        "column": base[:, :1],
        "offset view": base.reshape(-1)[3:20],
        "strided": base[:, ::2],
        "0-d": torch.tensor(1.5),
        "empty": torch.empty(3, 0),
        "bfloat16": torch.randn(7).to(torch.bfloat16),
        "float16": torch.randn(2, 2).half(),
        "float64": torch.randn(4, dtype=torch.float64),
        "channels last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_fast_path_matches_dlpack(name):
    tensor = _tensors()[name]
    fast, slow = torch_ref(tensor), export(tensor, name, None)
    assert fast is not None
    for field in ("ptr", "numel", "shape", "dtype", "device", "read_only", "copied", "row_major"):
        assert getattr(fast, field) == getattr(slow, field), field
    if tensor.numel() > 1:
        kept = lambda ref: tuple(s for s, e in zip(ref.strides, ref.shape) if e != 1)  # noqa: E731
        assert kept(fast) == kept(slow)


@pytest.mark.parametrize("tensor", [torch.arange(4), torch.randn(3, dtype=torch.complex64),
                                    torch.randn(4).to_sparse()], ids=["int64", "complex", "sparse"])
def test_fast_path_leaves_other_tensors_to_dlpack(tensor):
    assert torch_ref(tensor) is None
