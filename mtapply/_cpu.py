"""The CPU backend: the same ops on host memory, with NumPy, with the same semantics.

Tensors are viewed in place through their addresses (zero copy); the math runs in float32 for
16- and 32-bit storage and float64 for float64, then rounds back to the storage type. Values
given as one-element float32 arrays (device scalars on a GPU) are read when the step runs and
checked as the kernels check them: one out of its range makes the step write nothing.
Elementwise ops step small tensors together, and tensors stored in the math type straight in
their memory, a range of elements at a time, on up to MTAPPLY_CPU_THREADS threads; 8-bit
state is stepped so too, a range of whole blocks at a time (`_cpu_eight_bit`); float32 Adam's
ranges by a native library where it is built (`_cpu_adam`). The other ops step tensor by tensor,
on those threads too where the op's tensors share nothing (`cpu_tensors_apart`: rules with
sums, factored rules).
"""
from __future__ import annotations

import ctypes
import operator
import os
import queue
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _cpu_adam, _cpu_eight_bit
from ._ranges import GRAD_SCALE
from .stochastic import round_to_bfloat16_stochastic

_STORAGE = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
            "uint8": np.uint8}


_VIEWS: dict = {}  # (address, numel, dtype) -> (writable view, read-only view)
_MAX_VIEWS = 1 << 16
SMALL = 1 << 14  # elements: non-empty tensors up to this size are stepped together (see `run`)
CHUNK = 1 << 16  # elements an in-place update takes at a time: its scratch arrays stay cached
THREAD_MIN = 1 << 18  # elements of in-place work worth one more thread
_SCRATCH = threading.local()
_POOL = None  # (process id, ThreadPoolExecutor)
_FLOATS = ("float32", "float64", "float16", "bfloat16")


def view(ref) -> np.ndarray:
    """A flat NumPy view of a dense host tensor's memory (bfloat16 as raw uint16)."""
    return _views(ref)[0]


def _views(ref) -> tuple:
    """(writable, read-only) flat views of a host tensor's memory, made once per address, size
    and dtype: a view holds no memory of its own, so one made earlier at the same address sees
    what a fresh one would."""
    key = (ref.ptr, ref.numel, ref.dtype)
    views = _VIEWS.get(key)
    if views is None:
        storage = _STORAGE[ref.dtype]
        if ref.numel == 0:
            raw = np.empty(0, dtype=storage)
        else:
            buffer = (ctypes.c_char * ref.nbytes).from_address(ref.ptr)
            raw = np.frombuffer(buffer, dtype=storage, count=ref.numel)
        frozen = raw.view()
        frozen.flags.writeable = False
        if len(_VIEWS) >= _MAX_VIEWS:
            _VIEWS.clear()
        views = _VIEWS[key] = (raw, frozen)
    return views


def load(ref, dtype) -> np.ndarray:
    """A tensor's values in `dtype`: a read-only view of its memory where it is stored in
    `dtype`, else a new array."""
    return _convert(_views(ref)[1], ref.dtype, dtype)


def _convert(raw: np.ndarray, storage: str, dtype) -> np.ndarray:
    if storage == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)
    return raw.astype(dtype, copy=False)


def store(ref, values: np.ndarray) -> None:
    raw = view(ref)
    _put(raw if np.ndim(values) <= 1 else shaped(raw, ref), ref.dtype, values)


def shaped(flat: np.ndarray, ref) -> np.ndarray:
    """A flat array in a tensor's memory order viewed in the tensor's shape and strides."""
    if ref.row_major:
        return flat.reshape(ref.shape)
    strides = tuple(s * flat.itemsize for s in ref.strides)
    return np.lib.stride_tricks.as_strided(flat, ref.shape, strides,
                                           writeable=flat.flags.writeable)


def _put(raw: np.ndarray, storage: str, values) -> None:
    """`values` written into a tensor's raw view (bfloat16 rounded to nearest)."""
    if storage == "bfloat16":
        raw[:] = round_to_bfloat16_bits(values)
    else:
        np.copyto(raw, values, casting="unsafe")


def store_stochastic(ref, values: np.ndarray, args: dict, tensor: int) -> None:
    """bfloat16 params rounded stochastically, with the bits the kernel draws for them."""
    seed = int(args["seed_lo"]) | int(args["seed_hi"]) << 32
    if np.ndim(values) > 1:  # the bits are keyed by memory order
        in_memory = np.empty(ref.numel, np.float32)
        shaped(in_memory, ref)[...] = values
        values = in_memory
    view(ref)[:] = round_to_bfloat16_stochastic(values, seed, int(args["step"]), tensor)


def round_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float values rounded to bfloat16 (nearest, ties to even), as raw uint16 bits."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    nan = np.isnan(values)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


SUM_DTYPE = "sum_dtype"  # the args entry of a summing op's sum dtype (`OpSpec.sum_dtype`)
GIVEN_SUMS = "given_sums"  # the args entry of a tensor's sums taken before its update


def run(spec, refs: dict, args: dict, grad_scale=1.0, rows=None, found_inf=None,
        cache=None, first_pass=None) -> bool:
    """Applies `spec` to every tensor of `refs` (slot -> list of TensorRef) with `args`, or
    with its row's where `rows` (mtapply._rows.Rows) is given; grads are divided by
    `grad_scale` first (AMP), in the math type, as the kernel does. With master
    weights the op sees the fp32 master as its param, and the param receives the rounded
    result. Param modes as `OpSpec.with_param_mode` says.

    DeviceScalars (of `args`, the rows, `grad_scale`, `found_inf`) are read now: nothing is
    written where found_inf is non-zero, nor where a value is out of its range, which returns
    False (as the kernels do, see kernels/walker.cuh `step_runs`).

    `first_pass`: (sums, after_pass) for a rule with sums: every tensor's sums are taken first
    into `sums` (a flat array of the plan's sum dtype: each tensor's, then the whole-list
    sums, as `Plan.first_pass_sums` lays them out), `after_pass(0)` may change them (sum them
    over the processes holding shards of the tensors), and the update reads them there."""
    if found_inf is not None and _read(found_inf) != 0.0:
        return True
    values = _values(spec, args, rows, grad_scale)
    if values is None:
        return False
    args, row_args, grad_scale = values
    if rows is None and spec.cpu_run(refs, args, grad_scale):
        return True
    tensor_args = (lambda i: args) if rows is None else (lambda i: row_args[rows.row_of[i]])
    if spec.n_sums:  # sums in the plan's type, as the kernels take them (float64 over float64)
        wide = {SUM_DTYPE: spec.sum_dtype(r.dtype for r in refs[spec.slots[0]])}
        args, row_args = dict(args, **wide), [dict(row, **wide) for row in row_args]
    totals, given = None, None
    if spec.n_sums and first_pass is not None:
        totals, given = _first_pass(spec, refs, grad_scale, tensor_args, *first_pass)
    elif spec.n_totals:  # whole-list sums: a first pass over every tensor
        taken = [spec.cpu_sums(i, arrays, tensor_args(i), dtype)
                 for i, dtype, arrays in _tensors(spec, refs, grad_scale)]
        totals = spec.cpu_whole_sums(taken, args[SUM_DTYPE])
    together = ()
    if cache is not None and rows is None and totals is None and spec.cpu_batchable():
        batches = _batches(spec, refs, cache)
        for batch in batches:
            _run_batch(spec, batch, args, grad_scale)
        together = (cache["together"] | _run_in_place(spec, cache, args, grad_scale)
                    | _cpu_eight_bit.run(spec, cache, args, grad_scale))
    def step(i: int) -> None:
        dtype, arrays = _tensor(spec, refs, i, grad_scale)
        taken = tensor_args(i) if totals is None else dict(tensor_args(i), totals_array=totals)
        if given is not None:
            taken = dict(taken, **{GIVEN_SUMS: given[i]})
        _update(spec, refs, i, arrays, taken, dtype)

    first = refs[spec.slots[0]]
    stepped = [i for i in range(len(first)) if first[i].numel and i not in together]
    if spec.cpu_tensors_apart() and len(stepped) > 1:  # (NumPy's warnings as the caller has them)
        on_threads(stepped, step, sum(first[i].numel for i in stepped), np.geterr())
    else:
        for i in stepped:
            step(i)
    return True


def _first_pass(spec, refs: dict, grad_scale, tensor_args, sums: np.ndarray, after_pass):
    """(the whole-list sums, each tensor's sums as float64s): taken into `sums` (zeros for an
    empty tensor), then read back after `after_pass(0)`."""
    n, width = len(refs[spec.slots[0]]), spec.n_sums
    sum_dtype = sums.dtype.name
    sums[:] = 0
    taken = []
    for i, dtype, arrays in _tensors(spec, refs, grad_scale):
        taken.append(spec.cpu_sums(i, arrays, tensor_args(i), dtype))
        sums[i * width:(i + 1) * width] = taken[-1]
    if spec.n_totals:
        sums[n * width:] = spec.cpu_whole_sums(taken, sum_dtype)
    after_pass(0)
    per_tensor = sums[:n * width].astype(np.float64).reshape(n, width)
    totals = sums[n * width:].copy() if spec.n_totals else None
    return totals, [list(row) for row in per_tensor]


def _update(spec, refs: dict, i: int, arrays: dict, given: dict, dtype) -> None:
    """Tensor i's step (`cpu_update`) stored into its memory."""
    new = spec.cpu_update(dict(arrays), given, dtype, i)
    inputs = [a for a in arrays.values() if not a.flags.writeable]  # views of the tensors
    if inputs:  # a result that is (a view of) a tensor's memory, copied before any store
        new = {name: np.array(values) if _aliases(values, inputs) else values
               for name, values in new.items()}
    for name, values in new.items():
        if name == "params" and spec.param_mode == "delta":
            store(refs["updates"][i], values if spec.delta_is_step else values - arrays["params"])
            continue
        if name == "params" and spec.stochastic_rounding:
            store_stochastic(refs[name][i], values, given, i)
            continue
        store(refs[name][i], values)
        if name == "params" and spec.master_weights:
            store(refs["master_params"][i], values)


def _aliases(values, inputs: list) -> bool:
    return (isinstance(values, np.ndarray) and values.base is not None
            and any(np.may_share_memory(values, a) for a in inputs))


def _tensors(spec, refs: dict, grad_scale, skip=()):
    """(index, math dtype, slot name -> values) of each non-empty tensor, as the op sees it:
    the fp32 master as the param, zero params in the zero mode, grads unscaled. Values stored
    in the math type are read-only views of the tensors' memory."""
    first = refs[spec.slots[0]]
    for i in range(len(first)):
        if first[i].numel == 0 or i in skip:
            continue
        yield (i, *_tensor(spec, refs, i, grad_scale))


def _tensor(spec, refs: dict, i: int, grad_scale) -> tuple:
    """(math dtype, slot name -> values) of tensor i, as `_tensors` gives them."""
    first = refs[spec.slots[0]]
    dtype = np.float64 if first[i].dtype == "float64" else np.float32
    arrays = {name: load(column[i], dtype) for name, column in refs.items() if name != "updates"}
    if spec.cpu_shaped:
        arrays = {name: shaped(values, refs[name][i]) for name, values in arrays.items()}
    return dtype, _as_the_op_sees(spec, arrays, dtype, grad_scale)


def _as_the_op_sees(spec, arrays: dict, dtype, grad_scale) -> dict:
    if spec.master_weights:
        arrays["params"] = arrays.pop("master_params")
    if spec.param_mode == "zero":
        arrays["params"] = np.zeros_like(arrays["params"])
    if grad_scale != 1.0:
        arrays["grads"] = arrays["grads"] / dtype(grad_scale)
    return arrays


class _Batch:
    """Small tensors of one layout stepped as one: each slot's tensors read into one array,
    the op applied once (its update is elementwise, with the same arguments for every tensor)
    and each result written back tensor by tensor."""

    def __init__(self, spec, refs: dict, indices: list):
        self.indices = indices
        first = refs[spec.slots[0]][indices[0]]
        self.dtype = np.float64 if first.dtype == "float64" else np.float32
        self.storage = {name: column[indices[0]].dtype for name, column in refs.items()}
        self.sizes = [refs[spec.slots[0]][i].numel for i in indices]
        ends = np.cumsum(self.sizes).tolist()
        self.slices = [slice(end - size, end) for end, size in zip(ends, self.sizes)]
        self.total = ends[-1]
        self.reads = {name: [_views(column[i])[1] for i in indices] if column[indices[0]].numel
                      else None for name, column in refs.items() if name != "updates"}
        self.writes = {name: [_views(column[i])[0] for i in indices]
                       for name, column in refs.items() if name in spec.written}
        self.refs = {name: [column[i] for i in indices] for name, column in refs.items()
                     if name == "params"} if spec.stochastic_rounding else None

    def arrays(self) -> dict:
        out = {}
        for name, views in self.reads.items():
            if views is None:
                out[name] = np.empty(0, self.dtype)
                continue
            raw = np.concatenate(views)
            out[name] = _convert(raw, self.storage[name], self.dtype)
        return out


def _batches(spec, refs: dict, cache: dict) -> list:
    """The plan's batches of small tensors (`_Batch`), made on the first step and kept in
    `cache` while the plan's lists are the same; `cache["together"]`: the tensors they hold."""
    lists = tuple(refs.values())
    kept = cache.get("lists")
    if kept is not None and len(kept) == len(lists) and all(map(operator.is_, kept, lists)):
        return cache["batches"]
    groups: dict = {}
    first = refs[spec.slots[0]]
    for i, param in enumerate(first):
        n = param.numel
        if n == 0 or n > SMALL:
            continue
        column = [c[i] for c in lists]
        if all(r.dtype in _FLOATS and r.numel in (0, n) and r.row_major for r in column):
            groups.setdefault(tuple((r.dtype, r.numel == 0) for r in column), []).append(i)
    batches = [_Batch(spec, refs, indices) for indices in groups.values() if len(indices) > 1]
    together = frozenset(i for batch in batches for i in batch.indices)
    cache.clear()
    pieces = _in_place_pieces(spec, refs, together)
    cache.update(lists=lists, batches=batches, together=together, pieces=pieces,
                 in_place_elements=sum(len(dests[0]) for _, _, _, dests in pieces),
                 eight_bit_pieces=_cpu_eight_bit.pieces(spec, refs, together))
    return batches


def _run_batch(spec, batch: _Batch, args: dict, grad_scale) -> None:
    dtype = batch.dtype
    arrays = _as_the_op_sees(spec, batch.arrays(), dtype, grad_scale)
    new = spec.cpu_update(dict(arrays), args, dtype, batch.indices[0])
    for name, values in new.items():
        values = np.broadcast_to(values, (batch.total,))
        targets = [name]
        if name == "params" and spec.param_mode == "delta":
            if not spec.delta_is_step:
                values = values - arrays["params"]
            targets = ["updates"]
        elif name == "params" and spec.stochastic_rounding:
            for k, (ref, part) in enumerate(zip(batch.refs["params"], batch.slices)):
                store_stochastic(ref, values[part], args, batch.indices[k])
            continue
        elif name == "params" and spec.master_weights:
            targets.append("master_params")
        for target in targets:
            storage = batch.storage[target]
            bits = (round_to_bfloat16_bits(values) if storage == "bfloat16"
                    else values.astype(_STORAGE[storage], copy=False))
            for raw, part in zip(batch.writes[target], batch.slices):
                np.copyto(raw, bits[part])


def _in_place_pieces(spec, refs: dict, skip) -> list:
    """(index, math dtype, read-only views, writable views) of each run of up to `CHUNK`
    elements of the tensors, other than `skip`, whose every list is stored in the math type
    in memory of its own: those `_run_in_place` may update straight in their memory. Views
    in the order of `spec.slots`, the writable ones of the lists it writes."""
    if (spec.param_mode != "inplace" or spec.master_weights or spec.stochastic_rounding
            or set(refs) != set(spec.slots)):
        return []
    written = [name for name in spec.slots if name in spec.written]
    pieces = []
    for i, param in enumerate(refs[spec.slots[0]]):
        n = param.numel
        math = "float64" if param.dtype == "float64" else "float32"
        column = [refs[name][i] for name in spec.slots]
        if i in skip or n == 0 or not all(r.dtype == math and r.numel == n and r.row_major
                                          for r in column):
            continue
        reads = [_views(r)[1] for r in column]
        writes = [_views(refs[name][i])[0] for name in written]
        if any(np.may_share_memory(view, other) for view, name in zip(writes, written)
               for other, read in zip(reads, spec.slots) if read != name):
            continue
        for start in range(0, n, CHUNK):
            part = slice(start, min(start + CHUNK, n))
            pieces.append((i, _STORAGE[math], tuple(v[part] for v in reads),
                           tuple(v[part] for v in writes)))
    return pieces


def _run_in_place(spec, cache: dict, args: dict, grad_scale) -> frozenset:
    """Steps the plan's in-place pieces (`_in_place_pieces`) with the op's `cpu_in_place`,
    `on_threads`; the indices of the tensors stepped (none where the op has no such
    update)."""
    pieces = cache["pieces"]
    if not pieces or grad_scale != 1.0:
        return frozenset()
    updates = {}
    for _, dtype, _, _ in pieces:
        if dtype not in updates:
            updates[dtype] = spec.cpu_in_place(args, dtype)
            if updates[dtype] is None:
                return frozenset()
    numpy_step = lambda piece: _step_piece(piece, updates)  # noqa: E731
    native = _cpu_adam.native_step(cache, pieces, updates, numpy_step)
    items, step = native if native is not None else (pieces, numpy_step)
    on_threads(items, step, cache["in_place_elements"])
    indices = cache.get("in_place")
    if indices is None:
        indices = cache["in_place"] = frozenset(i for i, _, _, _ in pieces)
    return indices


def _step_piece(piece: tuple, updates: dict) -> None:
    """Steps one in-place piece with this thread's scratch arrays."""
    scratch = _SCRATCH.__dict__.setdefault("arrays", {})  # dtype -> arrays of CHUNK elements
    _, dtype, arrays, dests = piece
    update = updates[dtype]
    buffers = scratch.setdefault(dtype, [])  # as many as any update of the thread has needed
    while len(buffers) < update.n_buffers:
        buffers.append(np.empty(CHUNK, dtype))
    size = len(dests[0])
    update(arrays, dests, [b[:size] for b in buffers[:update.n_buffers]])


def on_threads(items: list, step, elements: int, errors: dict | None = None) -> None:
    """step(item) for each item, under np.errstate(**errors) (default: all ignored), on up to
    `_threads()` threads, one more for each THREAD_MIN of `elements` (NumPy lets go of the GIL
    in its loops); each item taken by whichever thread is free first. A step that raises
    leaves the items no thread has taken undone, and the error is raised once every thread
    has stopped: nothing is written after it."""
    threads = min(_threads(), elements // THREAD_MIN + 1, len(items))
    order = queue.SimpleQueue()
    for item in items:
        order.put(item)

    def drain() -> None:
        with np.errstate(**(errors or {"all": "ignore"})):
            while True:
                try:
                    item = order.get_nowait()
                except queue.Empty:
                    return
                try:
                    step(item)
                except BaseException:
                    _drop(order)
                    raise

    done = [_pool().submit(drain) for _ in range(threads - 1)]
    try:
        drain()
    finally:
        futures.wait(done)
    for future in done:
        future.result()


def _drop(order: queue.SimpleQueue) -> None:
    """Takes every item left in `order`, so that no thread starts another."""
    while True:
        try:
            order.get_nowait()
        except queue.Empty:
            return


def _threads() -> int:
    """MTAPPLY_CPU_THREADS, else the CPUs this process may run on (at most 8)."""
    configured = os.environ.get("MTAPPLY_CPU_THREADS")
    if configured:
        if not configured.strip().isdigit() or int(configured) < 1:
            raise ValueError(f"MTAPPLY_CPU_THREADS={configured!r}: give a number of threads, 1 "
                             f"or more")
        return int(configured)
    if hasattr(os, "sched_getaffinity"):
        return min(len(os.sched_getaffinity(0)), 8)
    return min(os.cpu_count() or 1, 8)


def _pool() -> ThreadPoolExecutor:
    """The threads in-place pieces are stepped on, made again in a forked child (whose copy
    has no threads)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=7, thread_name_prefix="mtapply-cpu"))
    return _POOL[1]


def _values(spec, args: dict, rows, grad_scale):
    """(args, each row's args, grad_scale) with every DeviceScalar read; None where one is out
    of the range its op declares."""
    if not isinstance(grad_scale, float):
        grad_scale = _read(grad_scale)
        if not GRAD_SCALE.holds(grad_scale):
            return None
    checks = [(spec.field_of(name), spec.scalar_range(name), spec.scalar_count(name))
              for name in spec.device_scalars]
    resolved = [_read_args(args, checks)]
    if rows is not None:
        resolved += [_read_args(row, checks) for row in rows.checked]
    if any(r is None for r in resolved):
        return None
    return resolved[0], resolved[1:], grad_scale


def _read_args(args: dict, checks: list) -> dict | None:
    out = dict(args)
    for field, allowed, count in checks:
        value = args.get(field)
        if hasattr(value, "ptr") and not hasattr(value, "ref"):  # a DeviceScalar
            values = [_read(value, j) for j in range(count)]
            if not all(map(allowed.holds, values)):
                return None
            out[field] = values[0]
    return out


def _read(scalar, index: int = 0) -> float:
    """The float32 value at a DeviceScalar's address in host memory (a number stays itself)."""
    if isinstance(scalar, (int, float)):
        return float(scalar)
    return float(ctypes.c_float.from_address(scalar.ptr + 4 * index).value)
