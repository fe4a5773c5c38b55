"""8-bit state stepped in place on the CPU.

Each tensor whose 8-bit slots hold codes, and whose other slots are float32 in memory of their
own, is cut into pieces of whole blocks. A piece's 8-bit slots are dequantized into scratch
arrays kept between steps, stepped there with the other slots by the op's float update
(`cpu_eight_bit_in_place`), and quantized back into the tensors' codes and scales
(`mtapply._blockwise_into`: the codes and scales of `mtapply.quantization`), the pieces on
threads as `mtapply._cpu` steps float tensors in place.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _blockwise_into, _cpu, quantization

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
