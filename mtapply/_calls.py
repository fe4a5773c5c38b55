"""The one-call API's memory: the plans of recent calls, stepped again when their tensors return.

`mtapply.adam_step(...)` and the other one-call functions are usually called every step on the
same lists. Each call describes its lists in a few C-level passes (`_describe`: address, size,
dtype, device, shape and layout of every tensor). When the description equals that of a recent
call, everything a full ingest checks was checked for exactly these tensors, and the plan bound
then is stepped again: O(1) Python work besides the description. When only addresses moved
(fresh grads, say) and nothing else, the plan is rebound to them after the aliasing checks,
which are the only checks the new addresses need. Anything else (a first call, another shape,
a bad tensor, lists of CPU tensors or of other DLPack producers) is ingested in full, which
also gives the precise error. CuPy arrays need not even be described: when a call passes the
very arrays of the latest call, with their shapes unchanged, its plan is stepped as it is.

Plans kept here hold no tensor: the caller's lists keep their memory alive while they are used.
"""
from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ._describe import describe, device_of
from ._dlpack import framework_of
from ._launch import order_after_producer, stream_pointer
from ._validate import check_lists
from .plan import Plan

_PLANS_PER_KEY = 4  # e.g. a model's lists and an EMA's, stepped in turn
_KEYS = 32
_recent: OrderedDict = OrderedDict()  # (op, table mode, framework, n) -> [_Recent, ...]
_frozen: list = []  # plans captured in CUDA graphs, never freed: a graph may replay any time
_lock = threading.Lock()
_DEREF = weakref.ref.__call__
_SHAPE = operator.attrgetter("shape")


class _Recent:
    """A plan and the description of the tensors it is bound to. A plan that a CUDA graph
    captured is frozen: its tables stay as the graph saw them, and it is kept for good.
    `arrays` holds weak references to the CuPy arrays described last and `shapes` their
    shapes (see `_unchanged_latest`)."""

    __slots__ = ("plan", "description", "frozen", "arrays", "shapes")

    def __init__(self, plan: Plan, description: np.ndarray):
        self.plan, self.description, self.frozen = plan, description, False
        self.arrays = self.shapes = None


def step(spec, tensors: dict, *, table_mode=None, stream=None, **arguments) -> Plan:
    """Steps `spec` once over `tensors` (slot -> list of tensors) with `arguments` (those of
    `Plan.step`), reusing a recent call's plan where the tensors allow; returns the plan."""
    slots = {name: tensors.get(name) for name in spec.slots}
    if any(tensors is None for tensors in slots.values()):
        return _fresh(spec, tensors, table_mode, stream, arguments)  # explains what is missing
    n = check_lists(slots)
    framework = framework_of(slots[spec.slots[0]][0]) if n else None
    key = (spec.call_key(n), table_mode, framework, n)
    with _lock:
        latest = _unchanged_latest(key, slots) if framework == "cupy" else None
        if latest is not None:
            _recent.move_to_end(key)
            return _step_recent(latest, framework, stream, arguments)
    description = _description(slots, framework) if n else None
    if description is None:
        return _fresh(spec, tensors, table_mode, stream, arguments)
    with _lock:
        recent = _reuse(key, description, stream)
        if recent is not None:
            _note_arrays(recent, framework, slots)
            return _step_recent(recent, framework, stream, arguments)
    plan = _fresh(spec, tensors, table_mode, stream, arguments)
    for name in spec.slots:
        plan.release(name)  # the cached plan must not keep the caller's tensors alive
    plan.forget_stream()  # later calls launch on their own stream
    recent = _Recent(plan, description)
    _note_arrays(recent, framework, slots)
    with _lock:
        _remember(key, recent)
    return plan


def _step_recent(recent: _Recent, framework: str, stream, arguments: dict) -> Plan:
    if stream is not None:
        _order_after_producer(framework, recent.description, stream)
    recent.plan._vouch_alive()  # the call's own tensors, described, lie at its addresses
    recent.plan.step(stream=stream, **arguments)
    if not recent.frozen and _capturing(framework, recent.description, stream):
        recent.frozen = True
        _frozen.append(recent)
    return recent.plan


def _unchanged_latest(key, slots: dict) -> _Recent | None:
    """The latest call with this key when it was on these very CuPy arrays, with the same
    shapes: a CuPy array never changes its memory, dtype or size, only its shape (which may be
    assigned), so its description, and every check made on it, still holds."""
    candidates = _recent.get(key)
    if not candidates or candidates[-1].arrays is None:
        return None
    latest = candidates[-1]
    for tensors, refs, shapes in zip(slots.values(), latest.arrays, latest.shapes):
        if not (all(map(operator.is_, tensors, map(_DEREF, refs)))
                and all(map(operator.eq, map(_SHAPE, tensors), shapes))):
            return None
    return latest


def _note_arrays(recent: _Recent, framework: str, slots: dict) -> None:
    """Remembers which CuPy arrays, of which shapes, `recent` was last stepped on."""
    if framework == "cupy":
        recent.arrays = [list(map(weakref.ref, tensors)) for tensors in slots.values()]
        recent.shapes = [list(map(_SHAPE, tensors)) for tensors in slots.values()]


def _fresh(spec, tensors, table_mode, stream, arguments) -> Plan:
    plan = Plan(spec, tensors, table_mode=table_mode, stream=stream)
    plan.step(stream=stream, **arguments)
    return plan


def _description(slots: dict, framework: str) -> np.ndarray | None:
    """(slots, rows, tensors) array of the descriptions of every slot, or None."""
    parts = []
    for tensors in slots.values():
        part = describe(tensors, framework)
        if part is None:
            return None
        parts.append(part)
    return np.stack(parts)


def _reuse(key, description: np.ndarray, stream) -> _Recent | None:
    """The recent call on tensors like these, its plan rebound to their addresses; None if
    there is none. Raises (changing nothing) when the new addresses alias."""
    candidates = _recent.get(key)
    if not candidates:
        return None
    _recent.move_to_end(key)
    for recent in reversed(candidates):
        if not np.array_equal(recent.description[:, 1:], description[:, 1:]):
            continue
        moved = {name: description[s, 0].view(np.uint64)
                 for s, name in enumerate(recent.plan.spec.slots)
                 if not np.array_equal(recent.description[s, 0], description[s, 0])}
        if moved and recent.frozen:
            continue  # a CUDA graph reads its tables
        if moved:
            recent.plan.rebind_columns(moved, stream=stream)
            recent.description = description
        candidates.remove(recent)
        candidates.append(recent)
        return recent
    return None


def _remember(key, recent: _Recent) -> None:
    candidates = _recent.setdefault(key, [])
    candidates.append(recent)
    del candidates[:-_PLANS_PER_KEY]
    _recent.move_to_end(key)
    while len(_recent) > _KEYS:
        _recent.popitem(last=False)


def _capturing(framework: str, description: np.ndarray, stream) -> bool:
    """Whether the launch stream (of the first tensor's device) is capturing a CUDA graph."""
    import cupy

    device_id = int(device_of(description[0])[0])
    handle = stream_pointer(stream, framework, device_id)
    return handle != 0 and cupy.cuda.runtime.streamIsCapturing(handle) != 0


def _order_after_producer(framework: str, description: np.ndarray, stream) -> None:
    """A caller's stream waits for the producer's current stream on each device, as a
    DLPack export with `stream=` would have made it."""
    for device_id in np.unique(device_of(description[0])):
        device_id = int(device_id)
        order_after_producer(framework, device_id, stream_pointer(stream, framework, device_id))


def forget() -> None:
    """Drops every remembered plan (their device memory goes back to the pool)."""
    with _lock:
        _recent.clear()  # the frozen plans stay: graphs may still replay them
