"""Kernel source assembly and the compile cache.

A kernel variant is the walker plus one op functor, specialised by a generated preamble that
fixes the slot storage types, the math type, the op's flags and the launch geometry. Headers are
inlined into one string, because CuPy's on-disk cache keys on the source string and does not see
`#include`d files. Each variant is compiled once per device and memoised.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

# CUDA storage type of each supported dtype, and its size in bytes.
CUDA_TYPES = {"float32": "float", "float64": "double", "float16": "mta::f16", "bfloat16": "mta::bf16"}
ITEMSIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

BLOCK_THREADS = 256
CHUNK_ELEMENTS = 4096

# fp32 math without flushing denormals, as torch's kernels do.
COMPILE_OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """Folder of the CUDA sources: inside the installed package, else the source checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"mtapply kernel sources not found beside {here}")


def inlined_sources(names: tuple[str, ...], seen: set[str]) -> list[str]:
    """The texts of kernels/`names` with quoted includes inlined, skipping files in `seen`."""

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = (kernel_dir() / file).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return [expand(name) for name in names]


def vector_width(dtypes: tuple[str, ...]) -> int:
    """Elements per vector access: 16 bytes of the narrowest slot type."""
    return 16 // min(ITEMSIZES[d] for d in dtypes)


def math_type(dtypes: tuple[str, ...]) -> str:
    """float for every storage type except float64 params, which keep double math."""
    return "double" if dtypes[0] == "float64" else "float"


@functools.lru_cache(maxsize=None)
def variant_source(kernel_file: str, functor: str, dtypes: tuple[str, ...],
                   flags: tuple[tuple[str, bool], ...]) -> str:
    """Complete source of one kernel variant (op file, slot dtypes, compile-time flags)."""
    lines = [f"#define MTA_BLOCK {BLOCK_THREADS}",
             f"#define MTA_CHUNK {CHUNK_ELEMENTS}",
             f"#define MTA_VEC {vector_width(dtypes)}"]
    lines += [f"#define MTA_{name} {int(value)}" for name, value in flags]
    seen: set[str] = set()
    lines += inlined_sources(("dtypes.cuh",), seen)
    lines += ["namespace mta {", f"typedef {math_type(dtypes)} acc_t;",
              "template <int S> struct SlotType;"]
    lines += [f"template <> struct SlotType<{s}> {{ typedef {CUDA_TYPES[d]} type; }};"
              for s, d in enumerate(dtypes)]
    lines += ["}  // namespace mta"]
    lines += inlined_sources((kernel_file,), seen)
    lines += [f"MTA_DEFINE_ENTRY({functor})"]
    return "\n".join(lines) + "\n"


_compiled: dict = {}


def kernel_function(source: str, device_id: int):
    """The `mta_entry` CUDA function of `source`, compiled once per device (CuPy caches on disk)."""
    key = (source, device_id)
    kernel = _compiled.get(key)
    if kernel is None:
        import cupy

        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=source, options=COMPILE_OPTIONS)
            kernel = module.get_function("mta_entry")
            kernel.kernel  # compile and load now, not inside a later graph capture
        _compiled[key] = kernel
    return kernel


def compile_offline(source: str, arch: str) -> bytes:
    """Compile `source` to a cubin for `arch` (e.g. "sm_90") with NVRTC alone; no GPU needed.

    Raises RuntimeError carrying the compiler log when the source does not compile.
    """
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"mtapply.cu", 0, [], [])
    _check_nvrtc(err, "create program")
    try:
        options = [o.encode() for o in COMPILE_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed for {arch}:\n{log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "cubin size")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check_nvrtc(err, "cubin")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check_nvrtc(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what}: {err}")
