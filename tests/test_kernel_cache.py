"""The disk caches of compiled kernels (mtapply._source) and host libraries (mtapply._native):
an entry is verified before use, untrusted folders are not used, `~` is expanded, temporary
files never stay, and concurrent writers leave a whole entry."""
from __future__ import annotations

import multiprocessing
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from mtapply import _native, _source

SOURCE = "extern \"C\" __global__ void mta_pass0() {}\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder and a fake NVRTC that counts its compilations."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", str(folder))
    compiled = []

    def compile_using_nvrtc(source, options, arch):
        compiled.append(source)
        return (b"\x7fELF cubin of " + source.encode() + arch.encode(), {})

    from cupy.cuda import compiler
    from cupy_backends.cuda.libs import nvrtc

    monkeypatch.setattr(compiler, "compile_using_nvrtc", compile_using_nvrtc)
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (12, 8))
    monkeypatch.setattr(_source, "_untrusted_warned", set())
    return folder, compiled


def binary(source=SOURCE):
    return _source._compiled_binary(source, "90", _source.COMPILE_OPTIONS)


def entries(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if p.suffix == ".bin")


def leftovers(folder: Path) -> list:
    return [p.name for p in folder.rglob("*.tmp")]


def test_an_entry_is_written_once_and_read_back(cache):
    folder, compiled = cache
    first = binary()
    assert compiled == [SOURCE] and len(entries(folder)) == 1
    assert binary() == first and compiled == [SOURCE]  # from the disk, not compiled again
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and not leftovers(folder)


@pytest.mark.parametrize("damage", ["truncated", "altered", "empty", "foreign", "other identity"])
def test_a_damaged_or_planted_entry_is_never_loaded(cache, damage):
    folder, compiled = cache
    good = binary()
    (path,) = entries(folder)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-7])
    elif damage == "altered":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign":  # a cubin planted under the entry's name, no header
        path.write_bytes(b"\x7fELF planted code")
    else:  # a whole, self-consistent entry of another source, renamed to this one's name
        other = _source._compiled_binary(SOURCE + "//", "90", _source.COMPILE_OPTIONS)
        assert other != good
        (moved,) = [p for p in entries(folder) if p != path]
        os.replace(moved, path)
    compiled.clear()
    assert binary() == good and compiled == [SOURCE]  # recompiled, and the entry mended
    compiled.clear()
    assert binary() == good and compiled == []


def test_an_entry_of_another_user_is_not_loaded(cache, monkeypatch):
    folder, compiled = cache
    good = binary()
    real = os.getuid()
    monkeypatch.setattr(os, "fstat", lambda fd, _f=os.fstat: _other_owner(_f(fd), real + 1))
    compiled.clear()
    assert binary() == good and compiled == [SOURCE]


def _other_owner(info, uid):
    return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, uid,
                           info.st_gid, info.st_size, int(info.st_atime), int(info.st_mtime),
                           int(info.st_ctime)))


def test_a_world_writable_folder_is_not_trusted(cache):
    folder, compiled = cache
    binary()
    (path,) = entries(folder)
    identity = path.read_bytes()[len(_source._MAGIC):len(_source._MAGIC) + 32]
    os.chmod(folder, 0o777)
    _source.write_entry(path, identity, b"planted")  # a whole entry, by anyone who can write
    compiled.clear()
    with pytest.warns(RuntimeWarning, match="writable by other users.*kept in memory only"):
        result = binary()
    assert result != b"planted" and compiled == [SOURCE]
    assert _source.read_entry(path, identity) == b"planted", "nor is it written"


def test_a_folder_of_another_user_is_not_trusted(cache, monkeypatch):
    folder, compiled = cache
    binary()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(folder).st_uid + 1)
    compiled.clear()
    with pytest.warns(RuntimeWarning, match="owned by another user"):
        binary()
    assert compiled == [SOURCE]


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", "~/kernels")
    assert _source.cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("MTAPPLY_CACHE_DIR")
    assert _source.cache_dir() == Path.home() / ".cache" / "mtapply"


def test_a_failed_write_leaves_no_temporary_file(cache, monkeypatch):
    folder, compiled = cache

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    assert binary() and compiled == [SOURCE]
    assert not entries(folder) and not leftovers(folder)


def test_stale_temporary_files_are_removed(cache):
    folder, _ = cache
    folder.mkdir(mode=0o700)
    stale, fresh = folder / ".x.bin.abc.tmp", folder / ".y.bin.def.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    old = time.time() - 2 * _source._STALE_SECONDS
    os.utime(stale, (old, old))
    binary()
    assert not stale.exists() and fresh.exists()  # another process may be writing it now


def test_concurrent_threads_leave_one_whole_entry(cache):
    folder, _ = cache
    identity = b"i" * 32
    path = folder / "entry.bin"
    folder.mkdir(mode=0o700)
    payloads = [bytes([k]) * 200_000 for k in range(8)]
    barrier = threading.Barrier(len(payloads))

    def write(payload):
        barrier.wait()
        for _ in range(5):
            _source.write_entry(path, identity, payload)
            assert _source.read_entry(path, identity) in payloads

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _source.read_entry(path, identity) in payloads and not leftovers(folder)


def _write_and_read(args):
    folder, k = args
    identity = b"p" * 32
    path = Path(folder) / "entry.bin"
    seen = []
    for _ in range(20):
        _source.write_entry(path, identity, bytes([k]) * 100_000)
        seen.append(_source.read_entry(path, identity))
    return seen


def test_concurrent_processes_leave_one_whole_entry(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o700)
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.map(_write_and_read, [(str(folder), k) for k in range(4)])
    whole = {bytes([k]) * 100_000 for k in range(4)}
    assert all(seen in whole for run in results for seen in run)
    assert not leftovers(folder)


# -- host libraries (mtapply._native) --------------------------------------------------------


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """_native's build of torch_describe with a fake compiler that counts its runs."""
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", str(tmp_path / "cache"))
    count = tmp_path / "builds"
    compiler = tmp_path / "fake-cxx"
    compiler.write_text(f"#!{sys.executable}\nimport sys\n"
                        f"out = sys.argv[sys.argv.index('-o') + 1]\n"
                        f"open(out, 'wb').write(b'library built')\n"
                        f"open({str(count)!r}, 'a').write('x')\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setitem(_native._RECIPES, "torch_describe",
                        _native._Recipe(lambda: [], lambda: "1", python=True))
    monkeypatch.setattr(_source, "_untrusted_warned", set())
    return lambda: len(count.read_text()) if count.exists() else 0


def test_a_host_library_is_built_once_and_verified(fake_build, tmp_path):
    path = _native._built("torch_describe")
    assert path.read_bytes() == b"library built" and fake_build() == 1
    assert _native._built("torch_describe") == path and fake_build() == 1
    assert not leftovers(tmp_path / "cache")
    path.write_bytes(b"library planted")  # altered after it was built: built again
    assert _native._built("torch_describe") == path and fake_build() == 2
    assert path.read_bytes() == b"library built"


def test_a_host_library_is_not_kept_in_an_untrusted_folder(fake_build, tmp_path):
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by other users"):
        path = _native._built("torch_describe")
    assert folder not in path.parents and path.read_bytes() == b"library built"
    assert not list(folder.iterdir())
