"""A param group bound to mtapply plans: its parts (params of one device and step count, one
plan each), the checks that the binding still holds (params in place, grads followed), the
repeat of the latest flat_grads step, and the local tensors of FSDP2's DTensor params."""
from __future__ import annotations

import ctypes
import operator
import weakref

import numpy as np
import torch

from ._describe import ROWS, native_function
from ._dtensor import is_dtensor, local_tensor, local_tensors
from ._optimizer_step import bump_versions as _bump_versions
from ._torch_layouts import Staging

_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DEREF = weakref.ref.__call__


_DESCRIBE_ARGS = [ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.py_object]
_CHECK_ARGS = [ctypes.py_object, ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_int64]


def data_addresses(tensors: list) -> np.ndarray:
    return np.fromiter(map(_DATA_PTR, tensors), np.uint64, len(tensors))


class Part:
    """Params of a group on one device (or, for a rule summing over them all, on several
    GPUs) that share a step count, bound to one plan and one step counter."""

    def __init__(self, indices, params, plan, counter, staging=None):
        self.indices, self.params, self.plan, self.counter = indices, params, plan, counter
        # a plan over several GPUs reads its step as a number, counted on the host (a CPU tensor)
        self.host_counter = counter is not None and counter.device.type == "cpu" and (
            plan is not None and plan.spans_devices)
        if plan is not None and counter is not None and not self.host_counter:
            plan.count_steps(counter)  # each step reads it and, unless found_inf, advances it
        self.staging = staging or None  # stand-ins copied around each step (_torch_layouts)
        self.device = params[0].device
        self.group_of = None  # in a merged group: each param's group index
        self.hyper, self.hyper_at = None, 0  # a merged group's hyperparameters, at a version
        self.numeric_lrs = False  # every group's lr a number when `hyper` was last made whole
        self.lrs = None  # in a merged group on a GPU: the groups' number lrs, on the device
        self.float32_math = all(p.dtype not in (torch.float64, torch.complex128) for p in params)
        self.sums = None  # a torch view of the plan's first-pass sums, when they are all-reduced
        self.after_pass = None
        self.scalars = None  # a rule's scalar state array (RuleBased)
        if plan is not None and is_dtensor(params[0]):
            self.sums, self.after_pass = _all_reduce_sums(plan, params[0])
        if plan is not None:
            plan.release("grads", watch=False)  # not this step's grads alive: followed here

    def on_device(self, flag):
        """GradScaler's scale or inf flag, on this part's device (it lives on one device)."""
        if flag is None or flag.device == self.device:
            return flag
        return flag.to(self.device)


class Bound:
    """One param group bound to mtapply plans: its params with grads, in parts of equal step
    count (params that missed steps, having had no grad, count fewer)."""

    def __init__(self, key, options, params, grads, parts):
        self.key, self.options, self.params, self.parts = key, options, params, parts
        self.sharded = any(map(is_dtensor, params))
        self.param_addresses = data_addresses(local_tensors(params))
        self.grad_refs = list(map(weakref.ref, grads))  # weak: grads are freed as torch frees them
        local = local_tensors(grads)  # the layouts the plans took: row-major, or these strides
        self.grad_strides = None if all(map(_IS_CONTIGUOUS, local)) else list(map(_STRIDE, local))
        self.grad_addresses = data_addresses(local)
        # whether the plans take other tensors than the grads themselves (real views, stand-ins)
        self.reshaped = any(part.staging for part in parts) or any(map(torch.is_complex, grads))
        self.complete = False  # with flat_grads: holds every param of its group that needs a grad
        self.grad_words = self._grad_words(grads)

    @classmethod
    def nothing(cls, options) -> Bound:
        """A group none of whose params steps (with flat_grads, all frozen): no parts."""
        return cls((), options, [], [], [])

    def _grad_words(self, grads: list):
        """The grads as the compiled check compares them (`holds`), or None where it does not
        apply (DTensor params, plans over stand-ins, grads not contiguous) or is not built yet."""
        describe = native_function("mta_describe_torch", _DESCRIBE_ARGS)
        if describe is None or self.sharded or self.reshaped or self.grad_strides is not None:
            return None  # (the check compares contiguous grads by address, size and dtype)
        words = np.empty((len(grads), ROWS), np.int64)
        if describe(grads, words.ctypes.data, torch.Tensor, torch.nn.Parameter) < 0:
            return None
        return words

    def holds(self, params: list) -> bool:
        """O(n) in compiled code (some 10 ns a param): whether `params` are the bound ones at
        their bound addresses, each with a grad at its bound address and layout, so that the
        plans step them as they are. False also where the check does not apply."""
        check = native_function("mta_check_binding", _CHECK_ARGS)
        return (check is not None and self.grad_words is not None
                and check(params, self.params, self.param_addresses.ctypes.data,
                          self.grad_words.ctypes.data, len(self.params)) == -1)

    def params_moved(self) -> bool:
        """True when a param's storage was replaced (`p.data = ...`, `model.half()`)."""
        params = local_tensors(self.params) if self.sharded else self.params
        return not np.array_equal(data_addresses(params), self.param_addresses)

    def follow_grads(self, grads: list) -> bool:
        """Points the plans at this step's grads, if any moved; False (nothing done) where a
        grad is laid out otherwise than the one bound, so that the group is bound again."""
        local = local_tensors(grads) if self.sharded else grads
        if not any(map(operator.is_not, grads, map(_DEREF, self.grad_refs))):
            # the same grads; at the same addresses unless one's storage was replaced
            # (`p.grad.data = ...`), which is rebound below
            if np.array_equal(data_addresses(local), self.grad_addresses):
                if self.grad_words is None:  # the compiled check was not built at the bind
                    self.grad_words = self._grad_words(grads)
                return True
        if not (all(map(_IS_CONTIGUOUS, local)) if self.grad_strides is None
                else list(map(_STRIDE, local)) == self.grad_strides):
            return False
        addresses = self.grad_addresses = data_addresses(local)
        whole = len(self.parts) == 1
        for part in self.parts:
            mine = local if whole else [local[i] for i in part.indices]
            at = addresses if whole else addresses[part.indices]
            if self.reshaped:
                mine, at = (part.staging or Staging()).bound_grads(mine, at)
            part.plan.rebind_addresses("grads", mine, at, keep_alive=False)
        self.grad_refs = list(map(weakref.ref, grads))
        self.grad_words = self._grad_words(grads)
        return True


class LatestStep:
    """A flat_grads step whose groups all stepped by their bound parts, each part's plans
    repeating what they were given. While the grads stay in their views and no GradScaler step
    comes, a step is the parts' launches again; where only lrs were set since (a scheduler),
    each part steps with its new lrs, written to its groups' lr slots (or taken by its plan in
    place: new words, or new slots of its rows)."""

    def __init__(self, parts: list, version: int):
        self.parts, self.version = parts, version  # parts: (group index, Part)
        self.repeats = [part.plan._repeat for _, part in parts]
        self.params = [p for _, part in parts for p in part.params]  # their versions move

    @classmethod
    def of(cls, parts: list, version: int) -> LatestStep | None:
        if any(part.plan is None or part.plan._repeat is None or part.sums is not None
               or part.after_pass is not None or part.staging is not None
               or not part.plan._relaunch_is_the_step() for _, part in parts):
            return None
        return cls(parts, version)

    def repeat(self, optimizer) -> bool:
        """The step again, or False (nothing done) where it no longer applies."""
        changes = optimizer._group_changes
        scheduled = changes.version != self.version
        if ((scheduled and changes.since(self.version) != {"lr"})
                or not optimizer._flat.intact(optimizer.param_groups)):
            return False
        for (_, part), step in zip(self.parts, self.repeats):
            if part.plan._repeat is not step or not step.current(part.plan):
                return False
        if scheduled:
            merged = optimizer._merged_group()
            for index, part in self.parts:
                group = merged if index == "merged" else optimizer.param_groups[index]
                optimizer._step_part(part, group, None, None)
            optimizer._latest = LatestStep.of(self.parts, changes.version)
        else:
            for step in self.repeats:
                step.launch()
            _bump_versions(self.params)
        optimizer._flat.mark()
        return True


def shard_groups(param) -> list:
    """The process groups over which a DTensor param is sharded (its Shard mesh dimensions)."""
    mesh = param.device_mesh
    return [mesh.get_group(d) for d, placement in enumerate(param.placements) if placement.is_shard()]


def _all_reduce_sums(plan, param):
    """For ops with sums over FSDP2 shards (LARS's and LAMB's norms, Prodigy's whole-list
    sums): (the plan's first-pass sums as a torch view, a hook that sums them over the shard
    groups between the first pass and the update), so every rank takes the sums of the whole
    tensors and of the whole model; (None, None) for single-pass ops."""
    if not plan.spec.n_sums:
        return None, None
    sums = plan.first_pass_sums()
    import torch.distributed as dist

    view = torch.as_tensor(sums, device=param.device)  # the plan's own memory, no copy
    groups = shard_groups(param)

    def all_reduce(_pass: int) -> None:
        for group in groups:
            dist.all_reduce(view, group=group)

    return view, all_reduce
