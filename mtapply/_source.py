"""Kernel source assembly and the compile cache.

A kernel variant is the walker plus an op's functors (one entry point per pass), specialised by
a generated preamble that fixes the slot storage types, the math type, the op's flags and the
launch geometry. Headers are
inlined into one string, so the source text alone identifies a variant. Each variant is compiled
with NVRTC once per GPU architecture, cached on disk, and loaded once per device.

NVRTC is reached through CuPy's `compile_using_nvrtc` rather than `RawModule`, because RawModule
appends `-ftz=true` after the caller's options: torch keeps float32 denormals, and so do we.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

# CUDA storage type of each supported dtype, and its size in bytes.
CUDA_TYPES = {"float32": "float", "float64": "double", "float16": "mta::f16", "bfloat16": "mta::bf16",
              "uint8": "unsigned char"}
ITEMSIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "uint8": 1}

BLOCK_THREADS = 256  # or fewer: see block_threads
NARROW_THREADS = 128
WARP_THREADS = 32
# blocks of NARROW_THREADS where blocks of BLOCK_THREADS would leave more than this share of
# their vector lanes idle in the last stride of each chunk (H200: 10,000 tensors of 256-4096
# elements, 18% idle, step 6% faster; full chunks 1.7% slower with narrow blocks)
IDLE_SHARE = 0.05
CHUNK_ELEMENTS = 4096

# fp32 math without flushing denormals, as torch's kernels do.
COMPILE_OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")
# the same with fp32 division and square root to within 2 ulp (fewer instructions), for kernels
# whose results carry a larger error anyway (8-bit states); MTA_APPROXIMATE also lets a functor's
# division and square root (adam.cuh) flush subnormals, one instruction each
APPROXIMATE_OPTIONS = ("-std=c++17", "--ftz=false", "--prec-div=false", "--prec-sqrt=false",
                       "--fmad=true", "-DMTA_APPROXIMATE=1")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """Folder of the CUDA sources."""
    return bundled_dir("kernels")


def bundled_dir(name: str) -> Path:
    """A folder of sources shipped with mtapply: inside the installed package, else the
    source checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"mtapply's {name} sources not found beside {here}")


_generated: dict = {}  # name -> the text of a kernel file generated at run time (rules)


def register_generated(name: str, text: str) -> None:
    """Makes `text` the kernel file `name` (a name no file in kernels/ has): ops built at run
    time, such as user-written rules, give their functor's source this way."""
    if _generated.setdefault(name, text) != text:
        raise ValueError(f"generated kernel {name!r} is already registered with another text")


def inlined_sources(names: tuple[str, ...], seen: set[str]) -> list[str]:
    """The texts of kernels/`names` (or of generated files) with quoted includes inlined,
    skipping files in `seen`."""

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = _generated[file] if file in _generated else (kernel_dir() / file).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return [expand(name) for name in names]


def vector_width(dtypes: tuple[str, ...]) -> int:
    """Elements per vector access: 16 bytes of the narrowest slot type."""
    return 16 // min(ITEMSIZES[d] for d in dtypes)


def block_threads(numels, chunk: int, dtypes: tuple[str, ...], sms: int = 0) -> int:
    """Threads per CUDA block for a group of tensors of these sizes: one warp where every chunk
    takes one vector pass of a warp, NARROW_THREADS where most chunks are short, else
    BLOCK_THREADS (kernels/walker.cuh, walk). A block of 256 threads over a 100-element tensor
    leaves 231 idle while it holds an SM's place: 2,000 such blocks take four waves; blocks of a
    warp all fit at once (up to 32 blocks an SM). Where every chunk has an SM to itself (`sms`:
    the GPU's), idle lanes take no one's place, and narrow blocks would only walk each chunk in
    more strides (H200: the float32 launch of 8-bit AdamW on gpt2-124M, its 98 biases and norm
    weights, 9.0 us at 128 threads, 6.6 at 256)."""
    vector = vector_width(dtypes)
    largest = min(int(max(numels, default=0)), chunk)
    if largest <= WARP_THREADS * vector:
        return WARP_THREADS
    if n_chunks(numels, chunk) <= sms:
        return BLOCK_THREADS
    if idle_share(numels, chunk, BLOCK_THREADS * vector) > IDLE_SHARE:
        return NARROW_THREADS
    return BLOCK_THREADS


def n_chunks(numels, chunk: int) -> int:
    """The chunks of `chunk` elements that tensors of these sizes are cut into."""
    return int((-(-np.asarray(numels, np.int64) // chunk)).sum())


def idle_share(numels, chunk: int, stride: int) -> float:
    """The share of a block's element slots left idle when every chunk of these tensors is
    walked in strides of `stride` elements (its last stride part full)."""
    numels = np.asarray(numels, np.int64)
    full, rest = numels // chunk, numels % chunk
    strides = full * -(-chunk // stride) + -(-rest // stride)
    covered = int(strides.sum()) * stride
    return 1.0 - int(numels.sum()) / covered if covered else 0.0


def kernel_block(threads: int) -> int:
    """MTA_BLOCK of a kernel launched with `threads` per block: the same, but for a warp, which
    runs the BLOCK_THREADS kernel (its chunk ends within the first stride)."""
    return BLOCK_THREADS if threads == WARP_THREADS else threads


def math_type(dtypes: tuple[str, ...]) -> str:
    """float for every storage type except float64 params, which keep double math."""
    return "double" if dtypes[0] == "float64" else "float"


@functools.lru_cache(maxsize=None)
def variant_source(kernel_file: str, functors: tuple[str, ...], dtypes: tuple[str, ...],
                   flags: tuple[tuple[str, bool], ...], chunk: int = CHUNK_ELEMENTS,
                   checks: tuple = (), layout: tuple | None = None,
                   block: int = BLOCK_THREADS, fused: bool = False) -> str:
    """Complete source of one kernel variant (op file, slot dtypes, compile-time flags, elements
    per chunk, the checks of its device scalars: `OpSpec.device_checks`, threads per block
    `block`: `kernel_block`), with one entry point
    per pass: `mta_pass0` for functors[0], and so on. With the MASTER flag, the last slot holds
    the fp32 master weights of the 16-bit params of slot 0. `OpSpec.source` calls it.

    `layout` (bytes of the launch header, the C++ names of the op's argument words in order):
    the host's packing of the kernel arguments, which the source then asserts at compile time
    (see `layout_asserts`). `fused`: also the entry `FUSED_ENTRY`, both passes of a two-pass op
    in one launch (kernels/walker.cuh, walk_fused)."""
    lines = [f"#define MTA_BLOCK {block}",
             f"#define MTA_SLOTS {len(dtypes)}",
             f"#define MTA_CHUNK {chunk}",
             f"#define MTA_VEC {vector_width(dtypes)}"]
    lines += [f"#define MTA_{name} {int(value)}" for name, value in flags]
    lines.append("#define MTA_SCALAR_CHECKS(X) " + " ".join(
        f"X({word}, {count}, {float(low).hex()}, {float(high).hex()}, {flags}u)"
        for word, count, low, high, flags in checks))
    seen: set[str] = set()
    lines += inlined_sources(("dtypes.cuh",), seen)
    # With master weights the op's param (slot 0) is the fp32 master, held in the last slot.
    master = dict(flags).get("MASTER", False)
    loaded = (dtypes[-1],) + tuple(dtypes[1:]) if master else tuple(dtypes)
    sum_type = "double" if dict(flags).get("SUM64", False) else "float"
    lines += ["namespace mta {", f"typedef {math_type(loaded)} acc_t;", f"typedef {sum_type} sum_t;",
              f"typedef {CUDA_TYPES[dtypes[0]]} param_t;",
              f"typedef {CUDA_TYPES[dtypes[-1]]} last_t;", "template <int S> struct SlotType;"]
    lines += [f"template <> struct SlotType<{s}> {{ typedef {CUDA_TYPES[d]} type; }};"
              for s, d in enumerate(loaded)]
    lines += ["}  // namespace mta"]
    lines += inlined_sources((kernel_file,), seen)
    lines += [f"MTA_DEFINE_ENTRY({entry_name(k)}, {f})" for k, f in enumerate(functors)]
    if fused:
        lines.append(f"MTA_DEFINE_FUSED_ENTRY({FUSED_ENTRY}, {', '.join(functors)})")
    if layout is not None:
        lines += [line for k, f in enumerate(functors) for line in layout_asserts(f, *layout, k)]
    return "\n".join(lines) + "\n"


def layout_asserts(functor: str, header_bytes: int, members: tuple, index: int = 0) -> list:
    """static_asserts that the kernel arguments lie where the host packs them: the launch header
    (`mtapply._launch._HEADER` against walker.cuh's `Launch`, whose last member is the op's
    Args) as long as the host packs it, and each member of the functor's Args in its 8-byte
    word, and no other. Written without `__builtin_offsetof`, which some NVRTC releases lack:
    Args is n words of 8 bytes, and its k-th member (a structured binding of it) is `members[k]`.
    `index`: the functor's place in its source, which names the asserts' namespace."""
    args = f"{functor}::Args"
    words = ", ".join(f"w{k}" for k in range(len(members)))
    lines = [f'static_assert(sizeof(mta::Launch<{args}>) == {header_bytes} + sizeof({args}) && '
             f'alignof(mta::Launch<{args}>) == 8, '
             f'"the launch header differs from the host\'s packing (mtapply._launch._HEADER)");',
             f'static_assert(sizeof({args}) == {8 * len(members)}, '
             f'"{args} differs from the op\'s arg_fields");',
             f"namespace mta_layout_{index} {{"]
    for k, m in enumerate(members):
        lines += [f"__host__ __device__ constexpr bool word_{k}() {{ {args} a{{}}; auto& [{words}] = a; "
                  f"return sizeof(w{k}) == 8 && (const void*)&w{k} == (const void*)&a.{m}; }}",
                  f'static_assert(word_{k}(), "{args}::{m} is not word {k} of the op\'s arg_fields");']
    return lines + [f"}}  // namespace mta_layout_{index}"]


def entry_name(pass_index: int) -> str:
    return f"mta_pass{pass_index}"


FUSED_ENTRY = "mta_fused"  # a two-pass op's passes in one launch (`variant_source`'s `fused`)


_loaded: dict = {}
_loading = threading.Lock()  # one thread compiles and loads a variant; the others wait for it


def kernel_functions(source: str, device_id: int, n_passes: int,
                     options: tuple | None = None, fused: bool = False) -> list:
    """The entry points of `source` compiled with `options` (default COMPILE_OPTIONS) on a
    device (cupy.cuda.function.Function), one per pass, then the fused one where `fused`."""
    options = COMPILE_OPTIONS if options is None else options
    key = (source, device_id, options)
    functions = _loaded.get(key)
    if functions is None:
        import cupy

        with _loading:
            functions = _loaded.get(key)
            if functions is None:
                with cupy.cuda.Device(device_id):
                    arch = "".join(map(str, cupy.cuda.Device(device_id).compute_capability))
                    module = cupy.cuda.function.Module()
                    module.load(_compiled_binary(source, arch, options))
                    names = [entry_name(k) for k in range(n_passes)] + [FUSED_ENTRY] * fused
                    functions = [module.get_function(name) for name in names]
                _loaded[key] = functions
    return functions


_absolute_cache_dirs: dict = {}  # a relative $MTAPPLY_CACHE_DIR -> the folder of its first use


def cache_dir() -> Path:
    """Where compiled kernels are kept: $MTAPPLY_CACHE_DIR (`~` expanded), else ~/.cache/mtapply.
    A relative value is taken against the working directory of its first use, once: a later
    os.chdir must not move the cache (nor split it between folders)."""
    configured = os.environ.get("MTAPPLY_CACHE_DIR")
    if not configured:
        return Path.home() / ".cache" / "mtapply"
    expanded = os.path.expanduser(configured)
    if os.path.isabs(expanded):
        return Path(expanded)
    folder = _absolute_cache_dirs.get(expanded)
    if folder is None:
        folder = _absolute_cache_dirs.setdefault(expanded, Path(os.path.abspath(expanded)))
    return folder


def _compiled_binary(source: str, arch: str, options: tuple) -> bytes:
    """The cubin (or PTX) of `source` for compute capability `arch`, from the disk cache if there."""
    from cupy.cuda import compiler
    from cupy_backends.cuda.libs import nvrtc

    identity = hashlib.sha256(repr((source, options, arch, nvrtc.getVersion())).encode()).digest()
    folder = trusted_folder(cache_dir())
    path = folder / f"{identity.hex()}.bin" if folder is not None else None
    binary = read_entry(path, identity) if path is not None else None
    if binary is None:
        binary = compiler.compile_using_nvrtc(source, options, arch)
        binary = binary[0] if isinstance(binary, tuple) else binary  # (binary, names) in CuPy 13+
        binary = binary.encode() if isinstance(binary, str) else binary
        if path is not None:
            write_entry(path, identity, binary)
    return binary


# -- the disk cache: entries verified before use, in folders only their owner can write -------

_MAGIC = b"mtapply cache entry 1\n"
_STALE_SECONDS = 24 * 3600  # temporary files older than this were left by a process that died
_untrusted_warned: set = set()


def trusted_folder(folder: Path) -> Path | None:
    """`folder` (made, private to this user, where it is missing), or None where it cannot be
    used or is not trusted: owned by another user, or writable by others (anyone could plant
    a file there). Warns once per folder that is not trusted."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError:  # read-only or full disk: compiled code is kept in memory only
        return None
    owner = getattr(os, "getuid", None)
    mine = owner is None or info.st_uid == owner()
    if stat.S_ISDIR(info.st_mode) and mine and not info.st_mode & stat.S_IWOTH:
        return folder
    if str(folder) not in _untrusted_warned:
        _untrusted_warned.add(str(folder))
        why = "is owned by another user" if not mine else "is writable by other users"
        warnings.warn(f"mtapply does not use its cache folder {folder}: it {why}, so a file "
                      f"there could have been planted. Compiled code is kept in memory only; "
                      f"set MTAPPLY_CACHE_DIR to a folder of your own (chmod 700)",
                      RuntimeWarning, stacklevel=3)
    return None


def read_entry(path: Path, identity: bytes) -> bytes | None:
    """The payload of the cache entry at `path`, or None where there is none or it does not
    verify: a file that is not an entry, the entry of another identity, a truncated or altered
    payload (its SHA-256 is stored beside it), or a file of another user."""
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            data = file.read()
    except OSError:
        return None
    owner = getattr(os, "getuid", None)
    if owner is not None and info.st_uid != owner():
        return None
    header = len(_MAGIC) + 64
    if len(data) < header or not data.startswith(_MAGIC):
        return None
    stored_identity, digest = data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:header]
    payload = data[header:]
    if stored_identity != identity or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def write_entry(path: Path, identity: bytes, payload: bytes) -> None:
    """Stores `payload` as the entry of `identity` at `path`: written to a temporary file of
    its own and renamed over the entry (atomic: concurrent threads and processes each see a
    whole entry or none). A failure (a full or read-only disk) only costs a recompilation."""
    data = _MAGIC + identity + hashlib.sha256(payload).digest() + payload
    write_atomically(path, lambda file: file.write(data))


def write_atomically(path: Path, fill) -> None:
    """Makes the file at `path` from `fill(file)` (a binary file object) through a temporary
    file in the same folder renamed over it; the temporary file never outlives the call."""
    _remove_stale(path.parent)
    try:
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                           suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as file:
            fill(file)
        os.replace(partial, path)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)  # gone already where the rename succeeded


def _remove_stale(folder: Path) -> None:
    """Removes temporary files that processes which died while writing left behind."""
    now = time.time()
    with contextlib.suppress(OSError):
        for partial in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - partial.stat().st_mtime > _STALE_SECONDS:
                    partial.unlink()


def compile_offline(source: str, arch: str, options: tuple | None = None) -> bytes:
    """Compile `source` to a cubin for `arch` (e.g. "sm_90") with NVRTC alone (and `options`,
    default COMPILE_OPTIONS); no GPU needed.

    Raises RuntimeError carrying the compiler log when the source does not compile.
    """
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"mtapply.cu", 0, [], [])
    _check_nvrtc(err, "create program")
    try:
        options = [o.encode() for o in (COMPILE_OPTIONS if options is None else options)]
        options.append(f"--gpu-architecture={arch}".encode())
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
