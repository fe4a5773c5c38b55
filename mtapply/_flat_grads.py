"""Grads that live in flat buffers for `mtapply.torch` optimizers made with `flat_grads=True`.

Every param that requires grad (or has a grad) gets, as its `.grad`, a view into one buffer
per (device, dtype) and keeps it: backward accumulates into the views in place, zeroing is one
fill per buffer, and a step need not look at the params one by one, since their grads cannot
have moved unless something replaced them. What can be checked in O(1) is checked every step:

- each buffer's version counter, which any in-place write through a view advances: a buffer
  untouched since the last step or zeroing means the grads went elsewhere (`model.zero_grad()`
  sets them to None and backward then allocates new ones). Those grads are copied back into
  the views and the views put back (O(n)), so that step is still right; where every grad had
  moved, that was a zeroing (HF's Trainer calls `model.zero_grad()` at every step), taken
  without a warning.
- a few params in rotation: a `.grad` assigned, a param's storage replaced or a param group
  edited since is reported with an error, since earlier steps may already have missed it.

A frozen param (`requires_grad` False) does not step, whatever its `.grad` (its view stays, and
backward no longer writes it; torch.optim skips it as its grad is None). Every step reads each
param's `requires_grad` (`requires_grad_moved`: one compiled scan, a few ns a param), so that a
param frozen or unfrozen since is followed at that very step (`follow_requires_grad`).
"""
from __future__ import annotations

import ctypes
import operator
import warnings

import numpy as np
import torch

from ._describe import native_function
from ._torch_layouts import dense_strides

CHECKED_PER_STEP = 4  # params whose grad and storage are verified per step, in rotation
PLACED_PER_STEP = 2  # params whose place in their group is verified per step, in rotation
_PARAMS = operator.itemgetter("params")
_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_FLAGS_ARGS = [ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.py_object]
_DATA_PTR = torch.Tensor.data_ptr
_ALIGN_BYTES = 256  # each view starts on a 256-byte boundary, for the kernel's vector loads


class _Entry:
    __slots__ = ("group", "position", "param", "view", "address", "buffer")

    def __init__(self, group, position, param, view, buffer=None):
        self.group, self.position, self.param, self.view = group, position, param, view
        self.address = param.data_ptr()
        self.buffer = buffer  # the index of the buffer holding the view


class FlatGrads:
    """The flat grad buffers of an optimizer's param groups (lists of params)."""

    def __init__(self, groups: list):
        """`groups`: lists of plain params (the caller refuses DTensors), of any layout: each
        view has its param's strides where the param is dense (channels_last too), else
        row-major ones (see `mtapply._torch_layouts.dense_strides`)."""
        self.lengths = [len(params) for params in groups]
        self._layout = [list(params) for params in groups]
        self.buffers = self._allocate(groups)
        self._params = [e.param for e in self.entries]
        self.follow_requires_grad()
        self._windows = self._rotation()
        self._versions = None
        self._next = 0
        self._warned = False
        self.mark()

    def _allocate(self, groups: list) -> list:
        """One zeroed buffer per (device, dtype); the grads that exist are copied in. A frozen
        param with a grad takes a view too, so that no grad keeps older buffers alive."""
        layout: dict = {}  # (device, dtype) -> [(group, position, param, offset)], total
        for g, params in enumerate(groups):
            for i, p in enumerate(params):
                if not _has_view(p):
                    continue
                members, total = layout.get((p.device, p.dtype), ([], 0))
                align = max(_ALIGN_BYTES // p.element_size(), 1)
                members.append((g, i, p, total))
                layout[(p.device, p.dtype)] = (members, total + -(-p.numel() // align) * align)
        self.entries = [_Entry(g, i, p, None) for g, params in enumerate(groups)
                        for i, p in enumerate(params) if not _has_view(p)]
        buffers = []
        for (device, dtype), (members, total) in layout.items():
            buffer = torch.zeros(total, dtype=dtype, device=device)
            for g, i, p, offset in members:
                view = buffer.as_strided(p.shape, dense_strides(p), offset)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self.entries.append(_Entry(g, i, p, view, len(buffers)))
            buffers.append(buffer)
        return buffers

    def requires_grad_moved(self) -> bool:
        """Whether a param was frozen or unfrozen since `follow_requires_grad`: one compiled
        scan (a C-level scan of torch's accessor until the library is built, or for params
        of other types)."""
        same = native_function("mta_requires_grad_is", _FLAGS_ARGS)
        if same is not None and same(self._params, self._requires.ctypes.data, torch.Tensor,
                                     torch.nn.Parameter) == len(self._params):
            return False
        now = np.fromiter(map(_REQUIRES_GRAD, self._params), np.uint8, len(self._params))
        return not np.array_equal(now, self._requires)

    def follow_requires_grad(self) -> bool:
        """O(n): takes which params require grad now. A param unfrozen takes its view back as
        its grad (a grad made meanwhile copied in, none read as zero); a frozen one keeps
        whatever grad it has. False (nothing taken) where an unfrozen param has no view (it
        was frozen when the buffers were made): then the buffers must be made again."""
        requires = list(map(_REQUIRES_GRAD, self._params))
        if any(r and e.view is None for r, e in zip(requires, self.entries)):
            return False
        self._requires = np.array(requires, np.uint8)
        trainable = [e for e, r in zip(self.entries, requires) if r]
        self._put_views_back(trainable)
        # only buffers that hold a trainable view are written by every backward
        self._watched = [False] * len(self.buffers)
        for e in trainable:
            self._watched[e.buffer] = True
        views = sum(e.view is not None for e in self.entries)
        self.trainable = (self.buffers if len(trainable) == views  # their padding is zero
                          else [e.view for e in trainable])
        return True

    def _rotation(self) -> list:
        """What each step of the rotation verifies, made once: from each entry on, the next
        CHECKED_PER_STEP params (wrapping around) with their views and addresses, and the
        first PLACED_PER_STEP of them with their places (group, position)."""
        n = len(self.entries)
        twice = self.entries * 2
        windows = []
        for start in range(n):
            window = twice[start:start + min(CHECKED_PER_STEP, n)]
            windows.append((tuple(e.param for e in window), tuple(e.view for e in window),
                            [e.address for e in window],
                            tuple((e.group, e.position, e.param)
                                  for e in window[:PLACED_PER_STEP])))
        return windows

    def mark(self) -> None:
        """Remembers the buffers' versions: the next step expects writes after this."""
        self._versions = list(map(_VERSION, self.buffers))

    def zero_(self) -> None:
        with torch.no_grad():
            for b in self.buffers:
                b.zero_()
        self.mark()

    def fits(self, groups: list) -> bool:
        """O(n), run after the groups' params were edited: whether each group still holds the
        very params the buffers were made for, in their places."""
        return (list(map(len, map(_PARAMS, groups))) == self.lengths
                and all(all(map(operator.is_, params, made))
                        for params, made in zip(map(_PARAMS, groups), self._layout)))

    def intact(self, groups: list) -> bool:
        """O(1): whether every grad is still its view (the groups must `fit`). False when a
        buffer was not written since the last mark (then `restore()`); raises when the rotation
        finds a change."""
        if any(watched and now == then for watched, now, then in
               zip(self._watched, map(_VERSION, self.buffers), self._versions)):
            return False
        self._check_some(groups)
        return True

    def _check_some(self, groups: list) -> None:
        """Verifies the next params of the rotation, C-level scans first: the whole check
        runs, param by param, only to name a problem they found."""
        if not self._windows:
            return
        start = self._next
        params, views, addresses, placed = self._windows[start]
        stop = start + len(params)
        if (any(map(operator.is_not, map(_GRAD, params), views))
                or list(map(_DATA_PTR, params)) != addresses):
            self._raise_problem(groups, start, stop)
        for g, i, param in placed:
            if groups[g]["params"][i] is not param:
                self._raise_problem(groups, start, stop)
        self._next = stop % len(self._windows)

    def _raise_problem(self, groups: list, start: int, stop: int) -> None:
        n = len(self.entries)
        for k in range(start, stop):
            entry = self.entries[k % n]
            problem = self._problem(entry, groups)
            if problem:
                raise RuntimeError(
                    f"flat_grads=True: param {entry.position} of param group {entry.group} "
                    f"{problem} since the flat grad buffers were made. The optimizer owns the "
                    "grads: zero them with optimizer.zero_grad() (not model.zero_grad()), do not "
                    "assign .grad or .data, and edit a group's params only through its list; "
                    "or make the optimizer with flat_grads=False")

    @staticmethod
    def _problem(entry: _Entry, groups: list) -> str:
        param = entry.param
        if groups[entry.group]["params"][entry.position] is not param:
            return "was replaced in its group"
        if param.requires_grad and param.grad is not entry.view:  # (a frozen one does not step)
            return "has a .grad that is not its view into the flat buffer (assigned, or set to None)"
        if param.data_ptr() != entry.address:
            return "had its storage replaced (p.data = ... or a dtype/device change)"
        return ""

    def restore(self) -> None:
        """O(n): grads found outside their views are copied back in and the views put back;
        a grad found None is zero (the param had none this step). Where no grad was found in
        its view, every one was set to None since the last step (`model.zero_grad()`, as HF's
        Trainer calls it at every step) and made again by backward: that is a zeroing of the
        buffers, taken quietly. Where only some moved, a warning says what it costs. Frozen
        params keep their grads as they are."""
        kept, moved = self._put_views_back([e for e in self.entries
                                            if e.view is not None and e.param.requires_grad])
        if kept and moved and not self._warned:
            self._warned = True
            warnings.warn("flat_grads=True: some grads were found outside the flat buffers "
                          "(assigned, or set to None) and copied back, at O(n) host cost per "
                          "step: zero them with optimizer.zero_grad() and leave .grad to backward",
                          stacklevel=4)

    @staticmethod
    def _put_views_back(entries: list) -> tuple:
        """Makes each entry's view its param's grad again, holding the grad found there (zero
        for None); returns (how many were in place, how many were not)."""
        copied, sources, zeroed, kept = [], [], [], 0
        for entry in entries:
            grad = entry.param.grad
            if grad is entry.view:
                kept += 1
                continue
            if grad is None:
                zeroed.append(entry.view)
            else:
                copied.append(entry.view)
                sources.append(grad)
            entry.param.grad = entry.view
        with torch.no_grad():
            if zeroed:
                torch._foreach_zero_(zeroed)
            if copied:
                torch._foreach_copy_(copied, sources)
        return kept, len(copied) + len(zeroed)


def _has_view(param) -> bool:
    """Whether a param takes a view into the buffers: it requires grad, or has a grad."""
    return param.requires_grad or param.grad is not None
