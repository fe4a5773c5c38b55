"""Host-side C++ libraries, compiled on this machine on first use and cached.

- `torch_describe` reads torch tensors' addresses and layouts at C speed (the one-call API, and
  mtapply.torch's check that a group is as its plans were bound), and moves params' versions.
- `xla_ffi` is the XLA FFI handler that launches mtapply's kernels inside `jax.jit`.
- `cpu_eight_bit` steps 8-bit Adam (mtapply._cpu_eight_bit) and float32 Adam
  (mtapply._cpu_adam) on the CPU a piece at a time, bit for bit as the NumPy path; plain C,
  built without any framework's headers.

Each is compiled with the system's C++ compiler (`$CXX`, else g++) (against the installed
torch's or jaxlib's headers where it uses them), into `$MTAPPLY_CACHE_DIR/native`, under a name that covers the
source, the flags and the framework's version, and loaded with ctypes. A library that cannot be
built is reported once (a warning naming the compiler's message) and its caller keeps to its
Python path, which has the same semantics. `MTAPPLY_NATIVE=0` keeps to Python throughout;
`python -m mtapply.native` builds everything ahead of time.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from ._source import bundled_dir, cache_dir, read_entry, trusted_folder, write_entry

_lock = threading.Lock()
_loaded: dict = {}  # name -> ctypes library, or None once it failed
_building: dict = {}  # name -> thread building it in the background


def enabled() -> bool:
    return os.environ.get("MTAPPLY_NATIVE", "1") != "0"


def library(name: str, *, wait: bool = True):
    """The ctypes library `name`, built first if needed; None if it cannot be built (or is
    still being built in the background when `wait` is False)."""
    if name in _loaded:
        return _loaded[name]
    if not enabled():
        return None
    if wait:
        with _lock:
            if name not in _loaded:
                _loaded[name] = _build_and_load(name)
        return _loaded[name]
    with _lock:
        if name not in _building and name not in _loaded:
            _building[name] = threading.Thread(target=library, args=(name,), daemon=True,
                                               name=f"mtapply-build-{name}")
            _building[name].start()
    return _loaded.get(name)


def _build_and_load(name: str):
    try:
        path = _built(name)
        return ctypes.PyDLL(str(path)) if _RECIPES[name].python else ctypes.CDLL(str(path))
    except Exception as error:  # no compiler, no headers: the Python path serves instead
        warnings.warn(f"mtapply could not build its native library {name!r}, so it keeps to "
                      f"its slower Python path: {error}", RuntimeWarning, stacklevel=4)
        return None


def _built(name: str) -> Path:
    """The cached shared library, compiled now if it is not there yet (or does not verify)."""
    recipe = _RECIPES[name]
    source = bundled_dir("csrc") / f"{name}.cpp"
    flags = recipe.flags()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    identity = hashlib.sha256(repr((source.read_bytes(), flags, recipe.version(), compiler,
                                    sys.version)).encode()).digest()
    folder = trusted_folder(cache_dir() / "native")
    if folder is None:  # not trusted: a private folder of this process, removed at exit
        folder = _private_folder()
    path = folder / f"{name}-{identity.hex()[:16]}.so"
    stamp = path.with_suffix(".sha256")  # the library's identity and SHA-256
    stored = read_entry(stamp, identity)
    if stored is not None and stored == _digest(path):
        return path
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        command = [*shlex.split(compiler), "-O2", "-std=c++17", "-fPIC", "-shared", "-w",
                   str(source), "-o", partial, *flags]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-2000:]}")
        digest = _digest(Path(partial))
        os.replace(partial, path)  # atomic: a concurrent loader sees a whole library or none
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)
    write_entry(stamp, identity, digest)
    if _digest(path) != digest:  # replaced meanwhile by another process's build: verify it
        raise RuntimeError(f"{path} changed while it was being verified: try again")
    return path


def _digest(path: Path) -> bytes | None:
    """SHA-256 of a file's bytes, None where it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


_private = []  # this process's own folder, where the cache folder is not trusted


def _private_folder() -> Path:
    if not _private:
        folder = Path(tempfile.mkdtemp(prefix="mtapply-native-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _private.append(folder)
    return _private[0]


class _Recipe:
    """How to compile one library: `flags()` (include and link flags), `version()` (what a
    build depends on besides its source), `python` (called with the GIL held)."""

    def __init__(self, flags, version, python: bool):
        self.flags, self.version, self.python = flags, version, python


def _torch_flags() -> list:
    import torch

    root = Path(torch.__file__).resolve().parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python",
            f"-Wl,-rpath,{root / 'lib'}"]


def _torch_version() -> str:
    import torch

    return torch.__version__


def _jax_flags() -> list:
    import jax

    return [f"-I{jax.ffi.include_dir()}", "-ldl", "-pthread"]


def _jax_version() -> str:
    import jaxlib

    return jaxlib.__version__


def _exact_flags() -> list:
    # -O3 vectorizes the block loops; no fused multiply-adds (nor -ffast-math): each operation
    # rounds as NumPy's does
    return ["-O3", "-ffp-contract=off", "-fno-math-errno"]


_RECIPES = {"torch_describe": _Recipe(_torch_flags, _torch_version, python=True),
            "xla_ffi": _Recipe(_jax_flags, _jax_version, python=False),
            "cpu_eight_bit": _Recipe(_exact_flags, str, python=False)}
