"""torch tensors read through torch's own accessors: the fast path of ingestion and rebinding.

Through `__dlpack__`, torch costs tens of microseconds per tensor; `data_ptr()`, `shape` and
`stride()` cost well under one. They describe the same memory DLPack would export, for the
tensors this path accepts (strided layout, a float dtype, CPU or CUDA, no lazy negation or
conjugation); everything else goes through DLPack, which decides or explains. DLPack's `stream=`
argument orders the consumer's stream after torch's current stream for each tensor; here
`order_after_current_stream` does that once per call.
"""
from __future__ import annotations

import sys

from ._dlpack import TensorRef

_dtype_names: dict = {}


def torch_ref(tensor) -> TensorRef | None:
    """A TensorRef of a torch tensor, or None when DLPack should read it instead."""
    torch = sys.modules["torch"]
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return None  # subclasses (DTensor, ...) may not own the memory they describe
    if not _dtype_names:
        _dtype_names.update({torch.float32: "float32", torch.float16: "float16",
                             torch.bfloat16: "bfloat16", torch.float64: "float64",
                             torch.uint8: "uint8"})
    dtype = _dtype_names.get(tensor.dtype)  # complex dtypes, the only ones with a conjugate bit, miss
    if dtype is None or tensor.layout is not torch.strided or tensor.is_neg():
        return None
    if tensor.is_cuda:
        where = ("cuda", tensor.get_device())
    elif tensor.is_cpu:
        where = ("cpu", 0)
    else:
        return None
    return TensorRef(obj=tensor, ptr=tensor.data_ptr(), numel=tensor.numel(), shape=tuple(tensor.shape),
                     strides=tensor.stride(), dtype=dtype, device=where, read_only=False,
                     copied=False, row_major=tensor.is_contiguous())


def order_after_current_stream(device_id: int, stream: int) -> None:
    """Makes `stream` wait for the work queued so far on torch's current stream of the device."""
    torch = sys.modules["torch"]
    current = torch.cuda.current_stream(device_id)
    if current.cuda_stream != stream:
        torch.cuda.ExternalStream(stream, device=device_id).wait_stream(current)
