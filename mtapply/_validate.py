"""Validation of a call's tensor lists, done in full before anything is written."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._dlpack import TensorRef, device_of, export, framework_of, is_dense
from ._launch import dlpack_stream
from ._torch_fast import order_after_current_stream, torch_ref

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")


def first_device(slots: dict) -> tuple | None:
    """Device of the first tensor of the first slot (the call's device), or None for empty lists."""
    first = next(iter(slots.values()))
    return device_of(first[0], f"{next(iter(slots))}[0]") if len(first) else None


def check_lists(slots: dict) -> int:
    """Every slot is a sequence of the same length as the first; returns that length."""
    names = list(slots)
    for name, tensors in slots.items():
        if tensors is None or isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
            if hasattr(tensors, "__dlpack__"):
                raise TypeError(f"{name} must be a list of tensors, got a single tensor: wrap it "
                                f"in a list, e.g. [{name[:-1] or name}]")
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    n = len(slots[names[0]])
    for name in names[1:]:
        if len(slots[name]) != n:
            raise ValueError(f"{name} has {len(slots[name])} tensors but {names[0]} has {n}: "
                             f"pass one {name} tensor per {names[0][:-1] or names[0]}")
    return n


def ingest(slots: dict, written: frozenset, launch_stream,
           formats: dict | None = None) -> dict[str, list[TensorRef]]:
    """TensorRefs of every slot, checked one against another. Raises before anything is written.

    `launch_stream(device)` gives the stream handle mtapply will launch on for a CUDA device.
    `formats` (slot -> (dtypes, shaped like the param)) names slots of other dtypes than the
    floating ones, or of other shapes (the op checks those).
    """
    formats = formats or {}
    n = check_lists(slots)
    names = list(slots)
    refs = {name: [None] * n for name in names}
    if n == 0:
        return refs
    call_device = first_device(slots)
    read = _reader(launch_stream if call_device[0] == "cuda" else None)
    for i in range(n):
        for name in names:
            where = f"{name}[{i}]"
            ref = read(slots[name][i], where)
            if name == names[0]:  # params may be on several GPUs; each slot on its param's
                expected, other = _param_device(ref, call_device), f"{names[0]}[0]"
            else:
                expected, other = refs[names[0]][i].device, f"{names[0]}[{i}]"
            dtypes, like_param = formats.get(name, (SUPPORTED_DTYPES, True))
            _check_tensor(ref, where, name in written, expected, other, dtypes)
            if name != names[0] and like_param:
                _check_against_param(ref, refs[names[0]][i], where, f"{names[0]}[{i}]")
            refs[name][i] = ref
    check_no_overlap(refs, written)
    return refs


def _param_device(ref: TensorRef, call_device: tuple) -> tuple:
    """The device a param may be on: any GPU when the call's first param is on a GPU."""
    return ref.device if call_device[0] == "cuda" and ref.device[0] == "cuda" else call_device


def ingest_slot(slot: str, tensors, current: list[TensorRef], writable: bool,
                launch_stream) -> list[TensorRef]:
    """TensorRefs of new tensors for one slot, each of the dtype, shape and layout it replaces.

    `launch_stream(device)` gives the stream handle mtapply will launch on (None on the CPU).
    """
    read = _reader(launch_stream)
    fresh = []
    for i, (obj, old) in enumerate(zip(tensors, current)):
        where = f"{slot}[{i}]"
        ref = read(obj, where)
        if ref.dtype != old.dtype or ref.shape != old.shape or ref.device != old.device or (
                ref.numel > 1 and not (ref.row_major and old.row_major) and ref.strides != old.strides):
            raise ValueError(f"{where} is {ref.dtype} {ref.shape} on {_device_name(ref.device)} but "
                             f"the plan has {old.dtype} {old.shape} on {_device_name(old.device)}: "
                             f"rebind tensors of the same dtype, shape, layout and device, or build "
                             f"a new plan")
        _check_tensor(ref, where, writable, old.device, "the plan", (old.dtype,))
        fresh.append(ref)
    return fresh


def _reader(launch_stream):
    """read(obj, where) -> TensorRef: torch's own accessors for torch tensors, else DLPack.

    Either way the launch stream of the tensor's device (`launch_stream(device)`, or None for
    none) is ordered after the producer's pending work on it.
    """
    ordered: set = set()
    streams: dict = {}

    def stream_of(device: tuple):
        if launch_stream is None or device[0] != "cuda":
            return None
        if device not in streams:
            streams[device] = launch_stream(device)
        return streams[device]

    def read(obj, where: str) -> TensorRef:
        if isinstance(obj, TensorRef):  # a view that mtapply made of a buffer it was lent
            return obj
        if framework_of(obj) == "torch":
            ref = torch_ref(obj)
            if ref is not None:
                stream = stream_of(ref.device)
                if stream is not None and ref.device not in ordered:
                    order_after_current_stream(ref.device[1], stream)
                    ordered.add(ref.device)
                return ref
        stream = stream_of(device_of(obj, where))
        return export(obj, where, None if stream is None else dlpack_stream(stream))

    return read


def _check_tensor(ref: TensorRef, where: str, writable: bool, call_device: tuple, first: str,
                  dtypes: tuple = SUPPORTED_DTYPES) -> None:
    if ref.dtype not in dtypes:
        what = ("mtapply updates floating tensors of" if dtypes is SUPPORTED_DTYPES
                else "this slot takes")
        raise TypeError(f"{where} has dtype {ref.dtype}; {what} {', '.join(dtypes)}: cast it "
                        f"to one of those")
    if ref.device != call_device:
        raise ValueError(f"{where} is on {_device_name(ref.device)} but {first} is on "
                         f"{_device_name(call_device)}: put every tensor of one call on one device")
    if ref.copied:
        raise ValueError(f"{where} was exported as a copy (DLPack IS_COPIED flag), so an in-place "
                         f"update would be lost: pass the tensor's own memory")
    if writable and ref.read_only:
        raise ValueError(f"{where} is read-only (DLPack READ_ONLY flag) but is updated in place: "
                         f"pass a writable array (for NumPy, one with flags.writeable set)")
    if not (ref.row_major or is_dense(ref)):
        raise ValueError(f"{where} with shape {ref.shape} and strides {ref.strides} is not dense "
                         f"(a strided view, or overlapping elements): pass a contiguous tensor; a "
                         f"contiguous copy would not carry the update back, so keep state contiguous")


def _check_against_param(ref: TensorRef, param: TensorRef, where: str, param_where: str) -> None:
    if ref.shape != param.shape:
        raise ValueError(f"{where} has shape {ref.shape} but {param_where} has {param.shape}: "
                         f"each slot of one parameter must have the parameter's shape")
    if ref.numel > 1 and not (ref.row_major and param.row_major) and (
            _strides_of_shape(ref) != _strides_of_shape(param)):
        raise ValueError(f"{where} has strides {ref.strides} but {param_where} has {param.strides}: "
                         f"give every slot of one parameter the same memory layout")


def _strides_of_shape(ref: TensorRef) -> tuple:
    return tuple(s for s, e in zip(ref.strides, ref.shape) if e != 1)


def check_no_overlap(refs: dict, written: frozenset) -> None:
    """No written tensor shares memory with any other tensor of the call (aliasing is refused).

    `refs` maps each slot to its TensorRefs, or to (start addresses, sizes in bytes) arrays.
    """
    names = list(refs)
    extents = [refs[name] if isinstance(refs[name], tuple) else
               (np.fromiter((r.ptr for r in refs[name]), np.uint64, len(refs[name])),
                np.fromiter((r.nbytes for r in refs[name]), np.uint64, len(refs[name])))
               for name in names]
    n = len(extents[0][0])
    starts = np.concatenate([e[0] for e in extents]).astype(np.uint64)
    sizes = np.concatenate([e[1] for e in extents]).astype(np.uint64)
    writes = np.repeat([name in written for name in names], n)
    keep = np.flatnonzero(sizes)  # empty tensors own no memory
    if keep.size < 2:
        return
    order = keep[np.argsort(starts[keep], kind="stable")]
    s, e, w = starts[order], starts[order] + sizes[order], writes[order]
    zero = np.zeros(1, dtype=np.uint64)
    before_all = np.concatenate([zero, np.maximum.accumulate(e)[:-1]])
    before_written = np.concatenate([zero, np.maximum.accumulate(np.where(w, e, 0))[:-1]])
    bad = np.flatnonzero((w & (s < before_all)) | (s < before_written))
    if bad.size == 0:
        return
    k = int(bad[0])
    j = next(j for j in range(k - 1, -1, -1) if e[j] > s[k] and (w[j] or w[k]))
    (a_slot, a_index), (b_slot, b_index) = (divmod(int(order[x]), n) for x in (j, k))
    raise ValueError(f"{names[a_slot]}[{a_index}] and {names[b_slot]}[{b_index}] share memory, and "
                     f"at least one of them is updated in place: give every slot its own tensor "
                     f"(e.g. torch.zeros_like)")


def _device_name(device: tuple) -> str:
    return "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"
