"""Many float32 matrix products of one shape in one cuBLAS call.

`BoundProducts` takes terms C = alpha op(A) op(B) + beta C over row-major CUDA matrices (torch
tensors or CuPy arrays), groups them once by shape, and at each `run` issues one
cublasSgemmBatched per distinct shape that several terms share. The operands' addresses live
in device tables (`_tables.MemcpyTable`) that are uploaded, on the launch stream, only when an
address changes: a step on the same buffers moves no host-to-device bytes and never waits for
the device. A shape of one term, or of large matrices (cuBLAS's batched kernels suit small
ones: one 4096 x 4096 product ran 4x slower batched), is left to the caller's own matmul,
whose heuristics choose its kernel.

The products follow their framework's float32 matmul precision, as its own matmul would: TF32
tensor cores where torch allows them (`torch.set_float32_matmul_precision("high")`) or CuPy does
(`CUPY_TF32=1`), full float32 otherwise.
"""
from __future__ import annotations

import os

import numpy as np

from . import _tables
from ._dlpack import framework_of
from ._launch import cupy_stream, stream_pointer

_OPS = {"N": 0, "T": 1}  # cublasOperation_t
_DEFAULT_MATH, _TF32_MATH = 0, 3  # cublasMath_t: CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH
BATCHED_ELEMENTS = 1 << 22  # the largest operand of a batched product, in elements


def batchable(matrix) -> bool:
    """Whether a matrix can be an operand here: float32, row-major, on a GPU."""
    framework = framework_of(matrix)
    if framework == "torch":
        return matrix.is_cuda and str(matrix.dtype) == "torch.float32" and matrix.is_contiguous()
    return framework == "cupy" and str(matrix.dtype) == "float32" and matrix.flags.c_contiguous


def framework_tf32(framework: str) -> bool:
    """Whether the framework's float32 products may round their inputs to TF32."""
    if framework == "torch":
        import torch

        return bool(torch.backends.cuda.matmul.allow_tf32)
    return os.environ.get("CUPY_TF32", "0") != "0"


def data_ptr(matrix) -> int:
    return matrix.data_ptr() if hasattr(matrix, "data_ptr") else matrix.data.ptr


def device_id(matrix) -> int:
    device = matrix.device
    return device.index if hasattr(device, "index") else device.id


class BoundProducts:
    """Terms of fixed ops, shapes and devices, grouped once into batches (one per shape that
    several terms share, its matrices small enough), each with its own address table, and
    terms left to the caller: a step whose operands may move (`run`) passes only their
    addresses."""

    def __init__(self, terms: list):
        shapes: dict = {}
        for k, (op_a, op_b, a, b, c) in enumerate(terms):
            key = (op_a, op_b, tuple(a.shape), tuple(b.shape), tuple(c.shape), device_id(c))
            shapes.setdefault(key, []).append(k)
        self.batches, left = [], []  # (the terms' indices, _Batch)
        for key, indices in shapes.items():
            if len(indices) == 1 or max(map(_elements, key[2:5])) > BATCHED_ELEMENTS:
                left += indices
            else:
                self.batches.append((np.asarray(indices), _Batch(*key, len(indices))))
        self.left = sorted(left)  # the indices of the terms the caller runs
        self.devices: dict = {}  # device -> its batches (one handle each)
        for indices, batch in self.batches:
            self.devices.setdefault(batch.device, []).append((indices, batch))
        self.framework = framework_of(terms[0][4]) if terms else None

    def run(self, addresses: np.ndarray, *, alpha: float, beta: float) -> list:
        """Runs the batches over the operands at `addresses` (uint64, one row (a, b, c) per
        bound term, in its order: `operand_addresses`); returns the indices of the terms left
        to the caller (`self.left`)."""
        if not self.batches:
            return self.left
        scalars = np.array([alpha, beta], np.float32)  # read by cuBLAS during the calls
        tf32 = framework_tf32(self.framework)
        import cupy

        for device, batches in self.devices.items():
            stream = stream_pointer(None, self.framework, device)
            # CuPy's cuBLAS calls set the handle to CuPy's current stream: make it `stream`
            with cupy.cuda.Device(device), cupy_stream(stream, device), \
                    _Handle(device, stream, tf32, self.framework) as handle:
                for indices, batch in batches:
                    batch.run(addresses[indices], scalars, handle, stream)
        return self.left


def operand_addresses(operands: list) -> np.ndarray:
    """The (a, b, c) addresses of each term's operands, one row per term."""
    return np.fromiter((data_ptr(matrix) for term in operands for matrix in term), np.uint64,
                       3 * len(operands)).reshape(-1, 3)


def _elements(shape) -> int:
    return shape[0] * shape[1]


def _gemm(op_a, op_b, a_shape, b_shape, c_shape) -> tuple:
    """cuBLAS's (trans_a, trans_b, m, n, k, lda, ldb, ldc) for the row-major product: C^T =
    op(B)^T op(A)^T in its column-major terms, where a row-major matrix is its own transpose,
    so cuBLAS's A is our B."""
    rows, cols = c_shape
    inner = a_shape[0] if op_a == "T" else a_shape[1]
    return _OPS[op_b], _OPS[op_a], cols, rows, inner, b_shape[1], a_shape[1], cols


class _Handle:
    """A cuBLAS handle set to host scalars on `stream` (and TF32 tensor cores or none) for one
    call and given back as it was. For torch matrices, torch's handle of its current stream,
    which is `stream`: torch gives each stream its own cuBLAS workspace, where a handle moved
    from stream to stream (cublasSetStream) shares one default workspace between the work of
    both streams. Otherwise CuPy's handle of the device, which CuPy itself moves to its
    current stream at each of its calls."""

    def __init__(self, device: int, stream: int, tf32: bool, framework: str | None = None):
        self.device, self.stream, self.tf32, self.framework = device, stream, tf32, framework

    def __enter__(self) -> int:
        from cupy_backends.cuda.libs import cublas

        if self.framework == "torch":
            import torch

            with torch.cuda.device(self.device):  # set to the current stream, its workspace
                self.handle = torch.cuda.current_blas_handle()
            moved = False
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                self.handle = cupy.cuda.device.get_cublas_handle()
            moved = True
        self.saved = (cublas.getStream(self.handle) if moved else None,
                      cublas.getPointerMode(self.handle), cublas.getMathMode(self.handle))
        if moved:
            cublas.setStream(self.handle, self.stream)
        cublas.setPointerMode(self.handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setMathMode(self.handle, _TF32_MATH if self.tf32 else _DEFAULT_MATH)
        return self.handle

    def __exit__(self, *exc) -> None:
        from cupy_backends.cuda.libs import cublas

        if self.saved[0] is not None:
            cublas.setStream(self.handle, self.saved[0])
        cublas.setPointerMode(self.handle, self.saved[1])
        cublas.setMathMode(self.handle, self.saved[2])


class _Batch:
    """One shape's products in one cublasSgemmBatched, their addresses in a device table."""

    def __init__(self, op_a, op_b, a_shape, b_shape, c_shape, device: int, count: int):
        self.gemm = _gemm(op_a, op_b, a_shape, b_shape, c_shape)
        self.device, self.count = device, count
        self.table = _tables.MemcpyTable(3 * count * 8, device)
        self.addresses = None

    def run(self, addresses: np.ndarray, scalars: np.ndarray, handle: int, stream: int) -> None:
        """The batch's products at `addresses` ((a, b, c) per row), alpha and beta in `scalars`
        (float32, host memory), by `handle` set to `stream`."""
        from cupy_backends.cuda.libs import cublas

        if self.addresses is None or not np.array_equal(addresses, self.addresses):
            # cuBLAS's A is our B: the table holds B's addresses, then A's, then C's
            table = np.concatenate([addresses[:, 1], addresses[:, 0], addresses[:, 2]])
            self.table.write(table.view(np.uint8), stream)
            self.addresses = addresses
        self.table.before_launch(stream)
        base, step = self.table.ptr, self.count * 8
        trans_a, trans_b, m, n, k, lda, ldb, ldc = self.gemm
        cublas.sgemmBatched(handle, trans_a, trans_b, m, n, k, scalars.ctypes.data, base,
                            lda, base + step, ldb, scalars.ctypes.data + 4, base + 2 * step, ldc,
                            self.count)
        self.table.launched_on(stream)
