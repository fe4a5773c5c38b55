"""8-bit state stepped in place on the CPU.

Each tensor whose 8-bit slots hold codes, and whose other slots are float32 in memory of their
own, is cut into pieces of whole blocks. A piece's 8-bit slots are dequantized into scratch
arrays kept between steps, stepped there with the other slots by the op's float update
(`cpu_eight_bit_in_place`), and quantized back into the tensors' codes and scales
(`mtapply._blockwise_into`: the codes and scales of `mtapply.quantization`), the pieces on
threads as `mtapply._cpu` steps float tensors in place.

Adam's pieces are stepped instead by the native library `cpu_eight_bit` (mtapply._native), the
same operations bit for bit in one pass over each block, with the GIL let go; blocks it cannot
quantize (not finite, or an absmax with an infinite reciprocal) it leaves to
`quantization.quantize_blockwise`, as `_blockwise_into` does. Without the library (or with
MTAPPLY_NATIVE=0) the NumPy path steps them.
"""
from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

from . import _blockwise_into, _cpu, _native, quantization

PIECE = 1 << 16  # elements (256 blocks) a piece holds: its scratch arrays stay cached
WORK = 4  # an 8-bit element costs about as many float ones (threads are counted in these)
_SCRATCH = threading.local()


def pieces(spec, refs: dict, skip) -> list:
    """(tensor index, size, read-only views, writable views, 8-bit slots) of each run of up
    to PIECE elements of the tensors other than `skip` that `_steps_in_place`. The views are
    those of the slots other than the scales and of those the op writes, in slot order, None
    where a slot is 8-bit; each 8-bit slot is (its place among the views read, among those
    written or None, writable codes, writable scales, signed)."""
    if (not spec.eight_bit_slots or spec.param_mode != "inplace" or spec.master_weights
            or spec.stochastic_rounding or set(refs) != set(spec.slots)):
        return []
    coded = {codes for codes, _, _ in spec.eight_bit_slots}
    scales = {scale for _, scale, _ in spec.eight_bit_slots}
    floats = [name for name in spec.slots if name not in scales]
    written = [name for name in floats if name in spec.written]
    layout = [("uint8" if name in coded else "float32", name in scales, name in spec.written)
              for name in spec.slots]
    out = []
    for i, param in enumerate(refs[floats[0]]):
        if i in skip or not _steps_in_place([refs[name][i] for name in spec.slots], layout):
            continue
        eight_bit = [(floats.index(codes), written.index(codes) if codes in written else None,
                      _cpu.view(refs[codes][i]), _cpu.view(refs[scale][i]), signed)
                     for codes, scale, signed in spec.eight_bit_slots]
        reads = [None if name in coded else _cpu._views(refs[name][i])[1] for name in floats]
        writes = [None if name in coded else _cpu.view(refs[name][i]) for name in written]
        for start in range(0, param.numel, PIECE):
            part = slice(start, min(start + PIECE, param.numel))
            blocks = slice(start // quantization.BLOCK, quantization.n_blocks(part.stop))
            out.append((i, part.stop - start, tuple(v if v is None else v[part] for v in reads),
                        tuple(v if v is None else v[part] for v in writes),
                        tuple((at, put, codes[part], scale[blocks], signed)
                              for at, put, codes, scale, signed in eight_bit)))
    return out


def _steps_in_place(column: list, layout: list) -> bool:
    """Whether a tensor's slots (`column`, in slot order) are as `layout` (dtype, whether a
    scale list, whether written) says: codes uint8 and float values of the param's size,
    scales one float32 per block, all row-major, none written sharing memory with another."""
    n = column[0].numel
    if n == 0:
        return False
    blocks = quantization.n_blocks(n)
    for ref, (dtype, scale, _) in zip(column, layout):
        if ref.dtype != dtype or ref.numel != (blocks if scale else n) or not ref.row_major:
            return False
    spans = [(ref.ptr, ref.ptr + ref.nbytes) for ref in column]  # each dense: its bytes
    return not any(a != b and start < spans[b][1] and spans[b][0] < end
                   for a, (start, end) in enumerate(spans) if layout[a][2]
                   for b in range(len(spans)))


def run(spec, cache: dict, args: dict, grad_scale) -> frozenset:
    """Steps the plan's 8-bit pieces (kept in `cache` by mtapply._cpu) `on_threads`; the
    indices of the tensors stepped (none where the op has no such update)."""
    steps = cache.get("eight_bit_pieces")
    if not steps or grad_scale != 1.0:
        return frozenset()
    update = spec.cpu_eight_bit_in_place(args, np.float32)
    if update is None:
        return frozenset()
    indices = cache.get("eight_bit")
    if indices is None:
        indices = cache["eight_bit"] = frozenset(piece[0] for piece in steps)
        cache["eight_bit_elements"] = sum(piece[1] for piece in steps)
    native = _native_step(cache, steps, update)
    if native is not None:
        _cpu.on_threads(cache["eight_bit_native"], native, WORK * cache["eight_bit_elements"])
    else:
        _cpu.on_threads(steps, lambda piece: _step(piece, update),
                        WORK * cache["eight_bit_elements"])
    return indices


def _step(piece: tuple, update) -> None:
    """Dequantizes, steps and quantizes one piece in this thread's scratch arrays."""
    _, size, reads, writes, coded = piece
    floats, buffers, words, index = _scratch(len(coded), update.n_buffers, size)
    arrays, dests = list(reads), list(writes)
    for values, (at, put, codes, scales, signed) in zip(floats, coded):
        _blockwise_into.dequantize_into(codes, scales, signed, values)
        arrays[at] = values
        if put is not None:
            dests[put] = values
    update(tuple(arrays), tuple(dests), buffers)
    for values, (_, put, codes, scales, signed) in zip(floats, coded):
        if put is not None:
            _blockwise_into.quantize_into(values, signed, codes, scales, words, index)


def _native_step(cache: dict, steps: list, update):
    """A function stepping one (piece, addresses) of `cache["eight_bit_native"]` with the
    native library, or None where the NumPy path steps the pieces: an op other than Adam's, or
    no library."""
    options = getattr(update, "adam", None)
    if options is None or not _native.enabled():
        return None
    step_piece = _library()
    if step_piece is None:
        return None
    if "eight_bit_native" not in cache:
        cache["eight_bit_native"] = _addresses(steps)
    if cache["eight_bit_native"] is None:
        return None
    hyper, variant = _adam_scalars(options)
    tables = (*_TABLES[1], hyper.ctypes.data, variant)

    def step(item: tuple) -> None:
        piece, addresses = item
        spill, bad, scratch = _native_scratch()
        if step_piece(*addresses, *tables, *scratch):
            _requantize(piece, spill, bad)

    step.hyper = hyper  # the memory at hyper's address, alive while the pieces are stepped
    return step


def _library():
    """The native function, its argument types set, and `_TABLES` made; None without it."""
    global _TABLES
    library = _native.library("cpu_eight_bit")
    if library is None:
        return None
    function = library.mtapply_adam8bit_piece
    if _TABLES is None:
        pointer = ctypes.c_void_p
        function.argtypes = [pointer] * 6 + [ctypes.c_int64] + [pointer] * 4 + [
            ctypes.c_int32] + [pointer] * 3
        function.restype = ctypes.c_int64
        maps = np.concatenate([quantization.dynamic_map(True), quantization.dynamic_map(False)])
        kept = (maps, _blockwise_into.top_words(True), _blockwise_into.top_words(False))
        _TABLES = (kept, tuple(table.ctypes.data for table in kept))
    return function


_TABLES = None  # (the maps and the code words, their addresses), as the library takes them


def _addresses(steps: list):
    """(piece, its arrays' addresses and size) of each piece, as the native function takes
    them; None where a piece's slots are not Adam's (param, grad, m signed, v unsigned)."""
    out = []
    for piece in steps:
        _, size, reads, writes, coded = piece
        if (len(reads) != 4 or len(writes) != 3 or len(coded) != 2
                or [c[:2] + c[4:] for c in coded] != [(2, 1, True), (3, 2, False)]):
            return None
        (_, _, m_codes, m_scales, _), (_, _, v_codes, v_scales, _) = coded
        arrays = (writes[0], reads[1], m_codes, m_scales, v_codes, v_scales)
        out.append((piece, (*(a.ctypes.data for a in arrays), size)))
    return out


def _adam_scalars(options: dict) -> tuple:
    """(float32 scalars, variant) of `reference.adam_into` with `options`, each made as it
    makes it (see csrc/cpu_eight_bit.cpp)."""
    c = np.float32
    lr, step, beta1, beta2 = (options[k] for k in ("lr", "step", "beta1", "beta2"))
    weight_decay = options["weight_decay"]
    w = c(1 - beta1)
    hyper = np.array([c(1 - lr * weight_decay), c(weight_decay), w, c(1) - w, c(1 - beta2),
                      c(beta2), c(math.sqrt(1 - beta2**step)), c(options["eps"]),
                      c(-(lr / (1 - beta1**step)))], np.float32)
    decay = 0 if weight_decay == 0 else 1 if options["decoupled_weight_decay"] else 2
    variant = bool(options["maximize"]) | decay << 1 | bool(w < 0.5) << 3
    return hyper, variant


def _native_scratch() -> tuple:
    """This thread's spills (one row a moment) and flags of blocks left to Python, and their
    addresses."""
    kept = _SCRATCH.__dict__.get("native")
    if kept is None:
        spill = np.empty((2, PIECE), np.float32)
        bad = np.empty(PIECE // quantization.BLOCK, np.uint8)
        kept = _SCRATCH.native = (spill, bad, (spill[0].ctypes.data, spill[1].ctypes.data,
                                               bad.ctypes.data))
    return kept


def _requantize(piece: tuple, spill: np.ndarray, bad: np.ndarray) -> None:
    """The blocks the native function left (not finite, or an absmax with an infinite
    reciprocal), quantized from their spilled values by `quantize_blockwise`."""
    _, size, _, _, coded = piece
    for b in np.flatnonzero(bad[:quantization.n_blocks(size)]):
        part = slice(b * quantization.BLOCK, min((b + 1) * quantization.BLOCK, size))
        for bit, values, (_, _, codes, scales, signed) in zip((1, 2), spill, coded):
            if bad[b] & bit:
                codes[part], scales[b:b + 1] = quantization.quantize_blockwise(values[part],
                                                                               signed)


def _scratch(n_floats: int, n_buffers: int, size: int) -> tuple:
    """This thread's scratch arrays of `size` elements: n_floats float32 arrays, then the
    update's n_buffers, and uint32 and intp arrays in the memory of those buffers (used before
    and after the update, never during it): fewer arrays stay cached."""
    rows = n_floats + max(n_buffers, 3)
    kept = _SCRATCH.__dict__.get("buffer")
    if kept is None or kept.shape[0] < rows or kept.shape[1] < size:
        kept = _SCRATCH.buffer = np.empty((rows, max(size, PIECE)), np.float32)
    floats = [row[:size] for row in kept[:rows]]
    words = floats[n_floats].view(np.uint32)
    index = kept[n_floats + 1:n_floats + 3].reshape(-1).view(np.intp)[:size]
    return floats[:n_floats], floats[n_floats:n_floats + n_buffers], words, index


__all__ = ["PIECE", "pieces", "run"]
