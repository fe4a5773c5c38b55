"""Strided-batched bfloat16 products D = alpha A B + beta C whose C is not their output, in one
cuBLASLt matmul (float32 accumulation).

torch.baddbmm with an output other than its input copies the input into the output first,
then multiplies in place: for Newton-Schulz's X <- a X + B X that copy is a third of the
product's time (H200, 24 x 768 x 3072). cuBLASLt takes C and D apart. The matmul and its
algorithm are chosen once per shape (`LtProducts`); a call passes addresses and the stream.

Row-major operands are read as their column-major transposes: D^T = B^T A^T + beta C^T, so
cuBLASLt's A is our B and its B our A, with no transposes.
"""
from __future__ import annotations

import ctypes
import glob
import os
import site

_COMPUTE_32F, _R_32F, _R_16BF = 68, 0, 14  # cublasComputeType_t, cudaDataType
_BATCH_COUNT, _BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
_HEURISTIC_BYTES, _WORKSPACE_AT = 96, 64  # cublasLtMatmulHeuristicResult_t, its workspaceSize
WORKSPACE_BYTES = 32 << 20
_library = None
_handle = None
_workspaces: dict = {}  # device -> the workspace every product on it shares (one stream at a time)


def _load():
    """libcublasLt (the one torch loaded, by its soname, else from the nvidia wheels)."""
    global _library, _handle
    if _library is None:
        names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
        for directory in site.getsitepackages():
            names += glob.glob(os.path.join(directory, "nvidia", "**", "libcublasLt.so*"),
                               recursive=True)
        for name in names:
            try:
                library = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise OSError("libcublasLt was not found")
        handle = ctypes.c_void_p()
        _check(library.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _library, _handle = library, handle
    return _library


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cublasStatus_t {status}")


def _layout(lt, rows: int, cols: int, batch: int):
    """Column-major bfloat16 rows x cols, `batch` of them one after another."""
    layout = ctypes.c_void_p()
    _check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _R_16BF, ctypes.c_uint64(rows),
                                         ctypes.c_uint64(cols), ctypes.c_int64(rows)),
           "cublasLtMatrixLayoutCreate")
    count, stride = ctypes.c_int32(batch), ctypes.c_int64(rows * cols)
    for attribute, value, size in ((_BATCH_COUNT, count, 4), (_BATCH_STRIDE, stride, 8)):
        _check(lt.cublasLtMatrixLayoutSetAttribute(layout, attribute, ctypes.byref(value),
                                                   ctypes.c_size_t(size)),
               "cublasLtMatrixLayoutSetAttribute")
    return layout


class LtProducts:
    """D = alpha A B + beta C for `batch` row-major bfloat16 (m, k) A, (k, n) B and (m, n) C, D
    on one CUDA device: the matmul, its layouts, algorithm and workspace made once."""

    def __init__(self, batch: int, m: int, k: int, n: int, device):
        import torch

        lt = _load()
        self.desc = ctypes.c_void_p()
        _check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F),
               "cublasLtMatmulDescCreate")
        # column-major: (n x k) our B, times (k x m) our A, into (n x m)
        self.first, self.second = _layout(lt, n, k, batch), _layout(lt, k, m, batch)
        self.out = _layout(lt, n, m, batch)
        self.workspace = _workspaces.get(device)
        if self.workspace is None:
            self.workspace = _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                               device=device)
        preference = ctypes.c_void_p()
        _check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)),
               "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lt.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE,
                                                       ctypes.byref(size), ctypes.c_size_t(8)),
               "cublasLtMatmulPreferenceSetAttribute")
        self.algorithm = (ctypes.c_uint8 * _HEURISTIC_BYTES)()
        found = ctypes.c_int(0)
        _check(lt.cublasLtMatmulAlgoGetHeuristic(_handle, self.desc, self.first, self.second,
                                                 self.out, self.out, preference, 1,
                                                 self.algorithm, ctypes.byref(found)),
               "cublasLtMatmulAlgoGetHeuristic")
        lt.cublasLtMatmulPreferenceDestroy(preference)
        if found.value < 1:
            raise RuntimeError("cuBLASLt has no algorithm for this product")
        self.workspace_size = ctypes.c_size_t.from_buffer(self.algorithm, _WORKSPACE_AT).value

    def __call__(self, a, b, c, d, alpha: float, beta: float, stream: int) -> None:
        """d = alpha a b + beta c on `stream` (torch tensors of the bound shapes; d not c)."""
        alpha_, beta_ = ctypes.c_float(alpha), ctypes.c_float(beta)
        _check(_library.cublasLtMatmul(
            _handle, self.desc, ctypes.byref(alpha_), ctypes.c_void_p(b.data_ptr()), self.first,
            ctypes.c_void_p(a.data_ptr()), self.second, ctypes.byref(beta_),
            ctypes.c_void_p(c.data_ptr()), self.out, ctypes.c_void_p(d.data_ptr()), self.out,
            ctypes.byref(self.algorithm), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(self.workspace_size), ctypes.c_void_p(stream)), "cublasLtMatmul")
