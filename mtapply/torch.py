"""Drop-in `torch.optim` optimizers running mtapply's fused kernels: Adam, AdamW, SGD, LARS, LAMB,
Adagrad, RMSprop, Lion, Adan, ScheduleFreeAdamW, and any user-written rule
(`optimizer(mtapply.rule(...), params, ...)`).

Constructor arguments, `defaults`, `param_groups` and the state layout are those of
`torch.optim.Adam` / `AdamW` / `SGD` (per param: a 0-d float32 `step`, `exp_avg`, `exp_avg_sq`,
`max_exp_avg_sq`; `momentum_buffer`), so checkpoints move between torch.optim and mtapply in both
directions. Each param group is bound once to an mtapply plan (one launch per dtype group, two
for LARS/LAMB); a step then rebinds only what moved:

- grads at unchanged addresses (`zero_grad(set_to_none=False)`): no per-param work beyond one
  C-level identity scan of `p.grad`;
- grads reallocated (the default `set_to_none=True`): their addresses are read and the plan's
  pointer table rewritten, with vectorised checks (no per-param Python validation);
- a different set of params with grads, or a changed compile-time option: a new plan.

With `flat_grads=True` the optimizer owns the grads: from the first `zero_grad()` or `step()` on,
each param that requires grad has a view into one flat buffer per (device, dtype) as its
`.grad` (grads made before are copied in), backward accumulates into it, and `zero_grad()`
zeroes the buffers in place whatever `set_to_none` says (so every such param steps every step,
as after torch's `zero_grad(set_to_none=False)`). A step then costs O(1) host work whatever the
number of params (see `mtapply._flat_grads` for what it checks). Until then the params have no
grads, as with torch.optim, so that a checkpoint loader that steps a fresh optimizer to make its
state (torch.distributed.checkpoint) finds it as torch.optim's. Not for FSDP2's DTensor params.

Params whose storage was replaced (`p.data = ...`) are bound again; a grad tensor whose own
storage is swapped in place (`p.grad.set_(...)`) is not noticed: assign a new grad instead.
`optimizer.state` is followed as torch.optim follows it (replaced, cleared, a param's entry or
one of its tensors replaced: the next step binds again), and saved and loaded as torch.optim
does (`mtapply._torch_state`): a state that lacks a tensor the optimizer keeps is refused with
KeyError rather than restarted from zero. A step moves the version counters of the params it
writes, as torch's in-place ops do, so that autograd refuses a backward through a graph that
saved a param before the step. A param held by two groups (a list edit of `param_groups`) is
refused at the step, as torch.optim's add_param_group refuses it.

Every layout torch.optim steps is stepped (`mtapply._torch_layouts`): channels_last and other
dense params in place, their states made in their layout; complex params as their real views,
as torch.optim steps them; params that are not dense (a strided view) through a dense copy, a
slow path of two copies per such param per step.

A step is whole or nothing: every group's options are checked (by the op's own checks, with
the group's index and the option's name) before any group launches, where the groups changed
since the last check; a rule-based optimizer checks each hyperparameter against the range its
rule declares. GradScaler's `unscale_` -> clip -> `step` sequence (Lightning's 16-mixed with
gradient_clip_val) runs without a host synchronisation (`mtapply._optimizer_step.AmpScaling`).

The step count lives on the device, one counter per plan, shared by the plan's params (their
`state["step"]` is that counter: float32 whatever the default dtype, as torch's fused steps
keep it), read and advanced by the step's own launches unless `GradScaler`'s `found_inf` skips
the step, so a skipped step leaves it unchanged without a host synchronisation. `state_dict()`
saves each param's step as its own tensor, where and in the dtype torch.optim keeps it. SGD's first momentum step creates the buffers on the host's side: if that very
step is skipped for inf grads, the next one blends into zero buffers (torch's fused SGD leaves
them uninitialised there). `lr` may be a float or a one-element tensor, in each group: a
float32 one on the params' GPU is read by the kernels (capturable: a CUDA graph of the whole
training step replays correctly); any other (a 0-d CPU tensor, as torch's schedulers and tests
make them, one on another GPU, a float64 one) is copied to a slot on the params' device before
each step's launches, with no host synchronisation (`mtapply._group_lrs.TensorCopies`). CPU
params run on mtapply's NumPy backend.
"""
from __future__ import annotations

import functools
import operator
import weakref
from itertools import chain, repeat

import numpy as np
import torch

from . import adam as _adam
from . import adam8bit as _adam8bit
from . import lamb as _lamb
from . import lars as _lars
from . import sgd as _sgd
from ._flat_grads import FlatGrads
from ._group_lrs import GroupLrs, TensorCopies
from ._launch import stream_pointer
from ._optimizer_step import AmpScaling, lean_step
from ._optimizer_step import bump_versions as _bump_versions
from ._param_groups import ANY, PARAMS, GroupChanges, tracked
from ._ranges import ANY as ANY_NUMBER
from ._ranges import LR, Range
from ._torch_layouts import PlanLists, Staging, as_real, as_reals, dense_strides
from ._torch_state import StateKeeping
from .ops._spec import check_number
from .ops.norms import L2NormSpec
from .plan import Plan
from .rules import library
from .scaling import zero_
from .torch_galore import GaLoreAdamW

__all__ = ["LAMB", "LARS", "SGD", "Adagrad", "Adam", "Adam8bit", "AdamW", "AdamW8bit", "Adan",
           "GaLoreAdamW", "Lion", "RMSprop",
           "RuleOptimizer", "ScheduleFreeAdamW", "optimizer"]

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_NOT_NONE = functools.partial(operator.is_not, None)
_LR = operator.itemgetter("lr")
_PARAMS = operator.itemgetter("params")
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DEREF = weakref.ref.__call__
_BETAS = {"beta1": "betas[0]", "beta2": "betas[1]", "beta3": "betas[2]"}  # the ops' names


def _addresses(tensors: list) -> np.ndarray:
    return np.fromiter(map(_DATA_PTR, tensors), np.uint64, len(tensors))


class _Part:
    """Params of a group on one device that share a step count, bound to one plan and one
    device counter."""

    def __init__(self, indices, params, plan, counter, staging=None):
        self.indices, self.params, self.plan, self.counter = indices, params, plan, counter
        if plan is not None and counter is not None:
            plan.count_steps(counter)  # each step reads it and, unless found_inf, advances it
        self.staging = staging or None  # stand-ins copied around each step (_torch_layouts)
        self.device = params[0].device
        self.group_of = None  # in a merged group: each param's group index
        self.hyper, self.hyper_at = None, 0  # a merged group's hyperparameters, at a version
        self.numeric_lrs = False  # every group's lr a number when `hyper` was last made whole
        self.lrs = None  # in a merged group on a GPU: the groups' number lrs, on the device
        self.float32_math = all(p.dtype not in (torch.float64, torch.complex128) for p in params)
        self.sums = None  # a torch view of the plan's per-tensor sums, when they are all-reduced
        self.after_pass = None
        if plan is not None and _is_dtensor(params[0]):
            self.sums, self.after_pass = _all_reduce_sums(plan, params[0])
        if plan is not None:
            plan.release("grads", watch=False)  # not this step's grads alive: followed here

    def on_device(self, flag):
        """GradScaler's scale or inf flag, on this part's device (it lives on one device)."""
        if flag is None or flag.device == self.device:
            return flag
        return flag.to(self.device)


class _Bound:
    """One param group bound to mtapply plans: its params with grads, in parts of equal step
    count (params that missed steps, having had no grad, count fewer)."""

    def __init__(self, key, options, params, grads, parts):
        self.key, self.options, self.params, self.parts = key, options, params, parts
        self.sharded = any(map(_is_dtensor, params))
        self.param_addresses = _addresses(_locals(params))
        self.grad_refs = list(map(weakref.ref, grads))  # weak: grads are freed as torch frees them
        local = _locals(grads)  # the layouts the plans took: row-major, or these strides
        self.grad_strides = None if all(map(_IS_CONTIGUOUS, local)) else list(map(_STRIDE, local))
        # whether the plans take other tensors than the grads themselves (real views, stand-ins)
        self.reshaped = any(part.staging for part in parts) or any(map(torch.is_complex, grads))
        self.complete = False  # with flat_grads: holds every param of its group that needs a grad

    def params_moved(self) -> bool:
        """True when a param's storage was replaced (`p.data = ...`, `model.half()`)."""
        params = _locals(self.params) if self.sharded else self.params
        return not np.array_equal(_addresses(params), self.param_addresses)

    def follow_grads(self, grads: list) -> bool:
        """Points the plans at this step's grads, if any moved; False (nothing done) where a
        grad is laid out otherwise than the one bound, so that the group is bound again."""
        if not any(map(operator.is_not, grads, map(_DEREF, self.grad_refs))):
            return True
        local = _locals(grads) if self.sharded else grads
        if not (all(map(_IS_CONTIGUOUS, local)) if self.grad_strides is None
                else list(map(_STRIDE, local)) == self.grad_strides):
            return False
        addresses = _addresses(local)
        whole = len(self.parts) == 1
        for part in self.parts:
            mine = local if whole else [local[i] for i in part.indices]
            at = addresses if whole else addresses[part.indices]
            if self.reshaped:
                mine, at = (part.staging or Staging()).bound_grads(mine, at)
            part.plan.rebind_addresses("grads", mine, at, keep_alive=False)
        self.grad_refs = list(map(weakref.ref, grads))
        return True


class _LatestStep:
    """A flat_grads step whose groups all stepped by their bound parts, each part's plans
    repeating what they were given. While the grads stay in their views and no GradScaler step
    comes, a step is the parts' launches again; where only lrs were set since (a scheduler),
    each part steps with its new lrs, written to its groups' lr slots (or taken by its plan in
    place: new words, or new slots of its rows)."""

    def __init__(self, parts: list, version: int):
        self.parts, self.version = parts, version  # parts: (group index, _Part)
        self.repeats = [part.plan._repeat for _, part in parts]
        self.params = [p for _, part in parts for p in part.params]  # their versions move

    @classmethod
    def of(cls, parts: list, version: int) -> _LatestStep | None:
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
            optimizer._latest = _LatestStep.of(self.parts, changes.version)
        else:
            for step in self.repeats:
                step.launch()
            _bump_versions(self.params)
        optimizer._flat.mark()
        return True


class _FusedOptimizer(StateKeeping, torch.optim.Optimizer):
    """What the mtapply optimizers share: binding groups to plans, AMP, device step counters."""

    # takes GradScaler's grad_scale / found_inf itself, and grads unscaled by its unscale_
    _step_supports_amp_scaling = AmpScaling()
    _counts_steps = True  # a device step counter (Adam, LAMB); SGD and LARS keep none
    # whether groups of equal compile options step as one plan, each tensor reading its
    # group's hyperparameters (per-tensor rows): ops whose hyperparameters are plain numbers
    _merges_groups = False
    _SHARED = ("seed",)  # hyperparameters that must be equal across groups to merge them
    _sparse_grads = False  # whether params with sparse grads step (by torch.optim's update)

    def __init__(self, params, defaults, flat_grads=False):
        self._flat_grads = bool(flat_grads)
        self._flat = None
        self._group_changes = GroupChanges()
        self._merged = (0, None)  # (changes version, the merged group or None)
        self._groups_seen = 0  # the changes version at which the params were last looked at
        self._apart_seen = 0  # the changes version at which no param was in two groups
        self._latest = None  # the latest step, where a step may repeat it (`_LatestStep`)
        super().__init__(params, defaults)
        self._keep_state()
        self._bound: dict = {}
        self._check_groups()  # as each step checks them again where they changed
        if self._flat_grads:
            self._refuse_dtensors()  # the flat buffers are made at the first zero_grad or step

    def __getstate__(self):
        return dict(super().__getstate__(), _flat_grads=self._flat_grads)

    def __setstate__(self, state) -> None:  # copy.deepcopy and pickle keep only torch's fields
        super().__setstate__(state)  # load_state_dict comes here too, with new groups
        for group in self.param_groups:  # an older pickle's groups
            self._fill_group(group)
        self._numbers_to_tensor_steps()
        self._keep_state()  # plans bound to the old state are dropped below
        self._flat_grads = state.get("_flat_grads", getattr(self, "_flat_grads", False))
        self._bound = {}
        self._flat = self.__dict__.get("_flat")  # a loaded state keeps them; a copy makes its own
        self._group_changes = getattr(self, "_group_changes", None) or GroupChanges()
        self._merged = (0, None)
        self._groups_seen = 0
        self._apart_seen = 0
        self._latest = None
        self.param_groups = tracked(self.param_groups, self._group_changes)

    def __repr__(self) -> str:
        """torch's listing of each group's options, under the class's full name (so that
        mtapply's AdamW does not read as torch.optim's) and the optimizer's own options:
        `mtapply.torch.AdamW (flat_grads=False) (` then the groups."""
        _, groups = super().__repr__().split("\n", 1)  # torch's: "AdamW (" and the groups
        rule = getattr(self, "rule", None)
        own = (f"rule={rule!r}, " if rule is not None else "") + f"flat_grads={self._flat_grads}"
        return f"{type(self).__module__}.{type(self).__qualname__} ({own}) (\n{groups}"

    # -- torch.optim.Optimizer interface ------------------------------------------------------

    step = lean_step()  # torch.optim's wrapper only where a profiler or a hook needs it

    def _plain_step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():  # being traced: the launch stays out of the graph
            _outside_graphs(_FusedOptimizer._fused_step)(self)
        else:  # (torch.compiler.disable's wrapper would cost every eager step)
            self._fused_step()
        return loss

    def _fused_step(self) -> None:
        self.param_groups = tracked(self.param_groups, self._group_changes)  # O(1) if they are
        self._check_groups_apart()
        if self._checked_at != self._group_changes.version:
            self._check_groups()  # every group's options, before any group steps
        if self._state_moved():  # O(1): the plans hold the replaced state tensors
            self._bound.clear()
            self._latest = None
        if self._copies:
            self._copies.refresh()  # tensor hyperparameters copied to the params' devices
        attributes = self.__dict__  # GradScaler.step sets grad_scale and found_inf there
        grad_scale, found_inf = attributes.get("grad_scale"), attributes.get("found_inf")
        if self._latest is not None and grad_scale is None and found_inf is None:
            if self._latest.repeat(self):  # launches only: no torch op to keep from autograd
                return
        self._latest = None
        with torch.no_grad():
            self._grouped_steps(grad_scale, found_inf)
        self._state_kept()

    def _check_groups_apart(self) -> None:
        """O(1) unless the groups' params were edited since: then refuses a param held by two
        groups (torch.optim's add_param_group refuses it; a list edit can still make it)."""
        changes = self._group_changes
        if max(changes.set_at[ANY], changes.set_at.get(PARAMS, 0)) <= self._apart_seen:
            return
        seen: dict = {}
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if seen.setdefault(id(p), (g, i)) != (g, i):
                    h, j = seen[id(p)]
                    raise ValueError(
                        f"param {i} of param group {g} is also param {j} of param group {h}: "
                        "a param belongs to one group (torch.optim's add_param_group refuses "
                        "this too, and a step would update it twice); remove it from one")
        self._apart_seen = changes.version

    def _grouped_steps(self, grad_scale, found_inf) -> None:
        """Binds every group (raising any refusal before anything is written), then steps
        them."""
        flat = self._flat_grads_in_place()
        merged = self._merged_group()  # params edited in place merge again, as torch sees them
        if (merged is None) == ("merged" in self._bound):  # the other way's plans are stale
            self._bound.clear()
        prepared = []
        stepped = flat  # whether every group steps by its bound parts
        for index, group in [("merged", merged)] if merged else enumerate(self.param_groups):
            bound = self._bound.get(index) if flat else None
            sparse = ()
            if bound is None or not bound.complete or bound.options != self._compile_options(group):
                dense, sparse = self._split_sparse(group, grad_scale, found_inf)
                bound = self._prepare_group(index, dense)
                stepped = False
                if self._flat is not None and index in self._bound:
                    self._bound[index].complete = self._bound[index].key == tuple(
                        id(p) for p in group["params"] if p.requires_grad)
                group = dense
            prepared.append((index, group, bound, sparse))
        self._before_groups(grad_scale, found_inf, self._flat.buffers if flat else None)
        for index, group, bound, sparse in prepared:
            for own, members in _by_group(group, sparse) if sparse else ():
                self._sparse_step(own, members)  # each with its own group's options
            self._launch_group(index, group, bound, grad_scale, found_inf)
        if self._flat is not None:
            self._flat.mark()
        if stepped and grad_scale is None and found_inf is None and self._repeats_steps():
            parts = [(index, part) for index, _, bound, _ in prepared for part in bound.parts]
            self._latest = _LatestStep.of(parts, self._group_changes.version)

    @classmethod
    def _repeats_steps(cls) -> bool:
        """Whether a step's host work is that of its parts' launches alone (no work across
        groups, no per-group host work), so that a step repeating the latest may skip it."""
        return (cls._before_groups is _FusedOptimizer._before_groups
                and cls._launch_group is _FusedOptimizer._launch_group
                and cls._step_part is _FusedOptimizer._step_part)

    def _flat_grads_in_place(self) -> bool:
        """With flat_grads: whether every grad is still its view into the flat buffers (an
        O(1) check); grads found elsewhere are put back (O(n)) and False is returned."""
        if not self._flat_grads or self._refresh_flat():
            return False
        if self._flat.intact(self.param_groups):
            return True
        self._flat.restore()
        return False

    def _refresh_flat(self) -> bool:
        """Makes the flat buffers again if there are none or the param groups changed since
        (then True: the grads were just moved into new views)."""
        if self._flat is not None and (not self._params_moved() or self._flat.fits(self.param_groups)):
            return False
        self._make_flat()
        return True

    def _params_moved(self) -> bool:
        """Whether params may have been added to, removed from or replaced in the groups since
        the last call: O(1), as the tracked groups note it."""
        self.param_groups = tracked(self.param_groups, self._group_changes)  # O(1) if they are
        changes = self._group_changes
        moved = bool(changes.since(self._groups_seen) & {ANY, PARAMS})
        self._groups_seen = changes.version
        return moved

    def _refuse_dtensors(self) -> None:
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if _is_dtensor(p):
                    raise ValueError(f"flat_grads=True does not take DTensor params (param {i} of "
                                     f"param group {g}): FSDP2 manages its grads itself, so use "
                                     "flat_grads=False")

    def _make_flat(self) -> None:
        """New flat buffers, holding the current grads; plans bound to old ones are dropped."""
        self._refuse_dtensors()
        self._flat = FlatGrads([g["params"] for g in self.param_groups])
        self._bound.clear()
        self._latest = None
        self._merged = (0, None)  # the groups' params changed: merge them again

    def zero_grad(self, set_to_none: bool = True) -> None:
        if torch.compiler.is_compiling():  # in a compiled training step: run outside its graph
            _outside_graphs(_FusedOptimizer._zero_grad)(self, set_to_none)
        else:
            self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        if self._flat_grads:  # the views stay, zeroed: one fill per buffer (set_to_none aside)
            self._refresh_flat()
            self._flat.zero_()
            return
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            by_device: dict = {}
            for g in grads:
                if g.grad_fn is not None:
                    g.detach_()
                g.requires_grad_(False)
                by_device.setdefault(g.device, []).append(_local(g))
            for same in by_device.values():
                zero_(same)  # one launch per dtype, addresses kept

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        try:
            self._refuse_flags(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # a refused group is not added
            raise
        self.param_groups = tracked(self.param_groups, self._group_changes)
        if hasattr(self, "_bound"):
            self._bound.clear()
            self._flat = None  # made again, over every group, at the next step

    # -- binding --------------------------------------------------------------------------------

    def _before_groups(self, grad_scale, found_inf, flat_buffers) -> None:
        """Work that spans the groups (LAMB's global gradient norm). `flat_buffers`: with
        flat_grads and every grad in its view, the buffers that hold all the grads."""

    def _prepare_group(self, index, group) -> _Bound | None:
        """The group bound to plans that point at this step's grads (None where no param
        has a grad); raises where the group cannot step, before any group launches."""
        # The common case costs C-level scans only: the same params, every one with a grad.
        params = group["params"]
        grads = list(map(_GRAD, params))
        options = self._compile_options(group)
        bound = self._bound.get(index)
        same = (bound is not None and bound.options == options and len(bound.params) == len(params)
                and all(map(operator.is_, params, bound.params))
                and not any(map(operator.is_, grads, repeat(None))))
        if not same:
            params = [p for p in params if p.grad is not None]
            if not params:
                return None
            grads = list(map(_GRAD, params))
            if bound is None or bound.options != options or bound.key != tuple(map(id, params)):
                bound = None
        if bound is not None and (bound.params_moved() or not bound.follow_grads(grads)):
            bound = None  # storage replaced under the params, or grads of another layout
        if bound is None:
            bound = self._bind(tuple(map(id, params)), options, group, params, grads)
            self._bound[index] = bound
        return bound

    def _launch_group(self, index, group, bound, grad_scale, found_inf) -> None:
        """Steps a group as `_prepare_group` prepared it."""
        if bound is not None:
            for part in bound.parts:
                self._step_part(part, group, grad_scale, found_inf)

    def _split_sparse(self, group, grad_scale, found_inf) -> tuple:
        """(the group without its params whose grads are sparse, those params), for optimizers
        that step them by `_sparse_step` (a C-level scan); else (the group, ())."""
        params = group["params"]
        if not self._sparse_grads or not any(map(_IS_SPARSE, filter(_NOT_NONE, map(_GRAD, params)))):
            return group, ()
        sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
        if grad_scale is not None or found_inf is not None:
            raise RuntimeError(f"{type(self).__name__}: params with sparse grads do not take "
                               "GradScaler's grad_scale and found_inf here; step them with "
                               "torch.optim (without GradScaler) or give them dense grads")
        stepped = set(map(id, sparse))
        return dict(group, params=[p for p in params if id(p) not in stepped]), sparse

    def _sparse_step(self, group, params) -> None:
        """One step of params with sparse grads (torch.optim's per-tensor update)."""
        raise NotImplementedError

    def _merged_group(self) -> dict | None:
        """All param groups as one, where they can step as one plan: an op of plain-number
        hyperparameters, several groups, equal compile options and shared values, no tensor
        lr. The merged group holds every param, and each group's options under "groups".
        O(1) while no group changed or only plain-number lrs were set."""
        seen, merged = self._merged
        changes = self._group_changes
        if seen != changes.version:
            if merged is None or changes.since(seen) - {"lr"}:  # plain-number lrs keep a merge
                merged = self._merge_groups()
            self._merged = (changes.version, merged)
        return merged

    def _merge_groups(self) -> dict | None:
        groups = self.param_groups
        if not self._merges_groups or len(groups) < 2:
            return None
        options = self._merge_options(groups[0])
        for group in groups:
            if (self._merge_options(group) != options or self._tensor_options(group)
                    or any(group.get(k) != groups[0].get(k) for k in self._SHARED)):
                return None
        return dict(groups[0], params=list(chain.from_iterable(map(_PARAMS, groups))),
                    groups=groups)

    def _merge_options(self, group) -> tuple:
        """What groups must share to step as one plan: their compile options, unless the
        optimizer gives some of those per tensor."""
        return self._compile_options(group)

    def _tensor_options(self, group) -> bool:
        """Whether a group gives a hyperparameter as a tensor that keeps its groups from
        stepping as one (an lr tensor does not: each tensor's row reads its group's)."""
        return False

    def _part_hyper(self, part, group) -> dict:
        """The hyperparameters of a part: its group's, or in a merged group each tensor's own
        (one value per tensor where the groups differ). A merged part keeps them, and renews
        only the lrs when only lrs were set since."""
        if "groups" not in group:
            return self._hyper(group, part.device)
        changes = self._group_changes
        if part.hyper is None or part.hyper_at != changes.version:
            groups = group["groups"]
            names = changes.since(part.hyper_at) if part.hyper is not None else None
            if names == {"lr"} and part.numeric_lrs:  # a scheduler set numbers (no tensor)
                lrs = np.fromiter(map(_LR, groups), np.float64, len(groups))
                if part.lrs is not None:  # the rows read them from the device: same hyper
                    part.lrs.write(lrs, stream_pointer(None, "torch", part.device.index))
                else:
                    lrs = lrs[part.group_of]
                    part.hyper = dict(part.hyper,
                                      lr=float(lrs[0]) if lrs.min() == lrs.max() else lrs)
            else:
                part.hyper = self._merged_hyper(part, groups)
                part.numeric_lrs = not any(isinstance(g["lr"], torch.Tensor) for g in groups)
            part.hyper_at = changes.version
        return part.hyper

    def _merged_hyper(self, part, groups: list) -> dict:
        owner = _owners({"groups": groups})  # groups may have moved in the list since the bind
        part.group_of = np.fromiter((owner[id(p)] for p in part.params), np.int64, len(part.params))
        per_group = [self._hyper(g, part.device) for g in groups]
        part.lrs = self._group_lrs(part, per_group)
        first = per_group[0]
        differ = [k for k in first if any(_differ(h[k], first[k]) for h in per_group)]
        return dict(first, **{k: tuple(per_group[g][k] for g in part.group_of) for k in differ})

    @staticmethod
    def _group_lrs(part, per_group: list):
        """Where a merged part's groups give their lrs as numbers on a GPU, for float32 math:
        the groups' lrs written to their device slots, which replace them in `per_group`."""
        if (part.device.type != "cuda" or not part.float32_math
                or not all(type(h.get("lr")) is float for h in per_group)):
            return None
        lrs = part.lrs
        if lrs is None or len(lrs.slots) != len(per_group):
            lrs = GroupLrs(len(per_group), part.device.index)
        lrs.write(np.array([h["lr"] for h in per_group], np.float64),
                  stream_pointer(None, "torch", part.device.index))
        for h, slot in zip(per_group, lrs.slots):
            h["lr"] = slot
        return lrs

    def _step_part(self, part, group, grad_scale, found_inf) -> None:
        hyper = self._part_hyper(part, group)
        scale, skip = part.on_device(grad_scale), part.on_device(found_inf)
        if part.sums is not None:
            part.sums.zero_()  # empty shards add nothing: their rows are never written
        if part.counter is not None:
            hyper["step"] = part.counter  # the plan counts the step in it
        staging = part.staging
        if staging is not None:
            staging.before([p.grad for p in part.params])
        try:
            part.plan.step(grad_scale=scale, found_inf=skip, after_pass=part.after_pass, **hyper)
        finally:
            part.plan.release("grads", watch=False)
        if staging is not None:
            staging.after()
        _bump_versions(part.params)

    def _bind(self, key, options, group, params, grads) -> _Bound:
        for p in params:
            if p.is_sparse or p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        owner = _owners(group) if "groups" in group else None  # params keep their group's
        for p in params:
            self._init_param_state(group["groups"][owner[id(p)]] if owner else group, p)
        classes: dict = {}  # params of one device and one step count share a plan
        counts: dict = {}  # one host read per step tensor (params of a plan share one)
        counting = self._counts(group)
        for i, p in enumerate(params):
            count = 0.0
            if counting:
                step = self.state[p]["step"]
                count = counts.setdefault(id(step), float(step))
            classes.setdefault((p.device, count), []).append(i)
        parts = []
        for (_, count), indices in classes.items():
            members = [params[i] for i in indices]
            counter = self._counter(members, count) if counting else None
            lists = PlanLists(self.state, members, [grads[i] for i in indices], _local)
            plan = self._make_plan(group, lists)
            parts.append(_Part(np.asarray(indices), members, plan, counter, lists.staging))
            if owner:
                parts[-1].group_of = np.array([owner[id(p)] for p in members], np.int64)
        return _Bound(key, options, list(params), grads, parts)

    def _init_param_state(self, group, p) -> None:
        """Checks a param's state, or makes it where it has none (an optimizer that keeps no
        state for it leaves no empty entry, as torch.optim)."""
        state = self.state.get(p)
        if state:
            self._check_entry(group, p, state, lambda: f"optimizer.state of param "
                              f"{_index_in(self.param_groups, p)}")
            self._init_state(group, p, state)
            return
        state = {}
        self._init_state(group, p, state)
        if state:
            self.state[p] = state

    def _counts(self, group) -> bool:
        """Whether the group's params keep a device step counter."""
        return self._counts_steps

    def _counter(self, params, count: float):
        """One device step counter for params of equal step count: their `state["step"]`."""
        counter = torch.tensor(count, dtype=torch.float32, device=params[0].device)
        for p in params:
            self.state[p]["step"] = counter
        return counter

    # -- hyperparameters ------------------------------------------------------------------------

    def _hyper(self, group, device) -> dict:
        """The group's hyperparameters as its plans on `device` take them: a tensor value
        as a device value there (`_device_value`)."""
        values = self._values(group)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                values[name] = self._device_value(value, device, name, group)
        return values

    def _device_value(self, value, device, name: str, group):
        """A one-element tensor hyperparameter as a plan on `device` reads it: itself where
        it is float32 on that GPU; else a float32 slot there, refreshed from it before every
        step's launches (`mtapply._group_lrs.TensorCopies`); a CPU plan reads a CPU tensor
        itself, checked with the others before any group launches."""
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        if device.type == "cpu" and value.device.type != "cpu":
            raise ValueError(f"a tensor {name} on {value.device} for params on the CPU: put "
                             f"it on the CPU")
        if value.device == device and value.dtype == torch.float32 and device.type == "cuda":
            return value.reshape(1) if value.dim() == 0 else value
        if self._copies is None:
            self._copies = TensorCopies()
        return self._copies.slot(value, device, name, self._range(group, name))

    def _range(self, group, name: str) -> Range:
        """The values hyperparameter `name` may take."""
        return LR if name == "lr" else ANY_NUMBER

    def _check_groups(self) -> None:
        """Checks every group's options as a step takes them, before any group steps; run
        where the groups changed since the last check (only the lrs, vectorised, where only
        numbers were set as lrs: a scheduler's step)."""
        changes, groups = self._group_changes, self.param_groups
        if changes.since(self._checked_at) == {"lr"} and self._numeric_lrs:
            _check_lrs(np.fromiter(map(_LR, groups), np.float64, len(groups)),
                       self._range(groups[0], "lr"))
        else:
            for index, group in enumerate(groups):
                self._check_group(index, group)
            self._numeric_lrs = all(type(g["lr"]) in (float, int) for g in groups)
            if self._copies:
                self._copies.keep_only([value for group in groups for value in group.values()
                                        if isinstance(value, torch.Tensor)])
        self._checked_at = changes.version

    def _check_group(self, index: int, group) -> None:
        """Raises where a group's options are outside what its step accepts: the op's own
        checks, of the values a step would take (a CPU tensor's read on the host)."""
        values = self._checked_values(group)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"param group {index}: Tensor {name} must be 1-element")
                if value.device.type == "cpu":
                    values[name] = float(value)
        try:
            self._checking_spec(group).arguments(**values)
        except (TypeError, ValueError) as error:
            word, space, rest = str(error).partition(" ")
            raise type(error)(f"param group {index}: {self._OPTION_NAMES.get(word, word)}{space}"
                              f"{rest}") from None

    # the op's names of options a user gives otherwise (betas), for messages
    _OPTION_NAMES: dict = {}
    _checked_at = 0  # the group changes version whose options were last checked
    _numeric_lrs = False  # whether every group's lr was a number at the last whole check
    _copies = None  # TensorCopies, made at the first tensor hyperparameter that needs one

    def _checked_values(self, group) -> dict:
        """The hyperparameters to check, as `_checking_spec(group).arguments` takes them."""
        return dict(self._values(group), step=1.0)

    # -- per optimizer --------------------------------------------------------------------------

    def _compile_options(self, group) -> tuple:
        raise NotImplementedError

    def _init_state(self, group, p, state) -> None:
        raise NotImplementedError

    def _make_plan(self, group, lists: PlanLists):
        """The plan of `lists` (params of the group, of one device and step count)."""
        raise NotImplementedError

    def _values(self, group) -> dict:
        """The group's hyperparameters by the op's names, tensors as given."""
        raise NotImplementedError

    def _checking_spec(self, group):
        """An op spec whose `arguments` checks the group's hyperparameters."""
        raise NotImplementedError


def _laid_out_as(zeros, form):
    """Fresh zeros shaped as `form` in its dense layout (8-bit codes are blockwise in memory
    order, so they are made in the layout the param steps with); others as they are."""
    if tuple(zeros.shape) != tuple(form.shape):
        return zeros  # a per-block scale
    return torch.empty_strided(form.shape, dense_strides(form), dtype=zeros.dtype,
                               device=zeros.device).zero_()


def _check_lrs(lrs: np.ndarray, allowed: Range) -> None:
    """Raises, naming the first group, where an lr is outside `allowed`."""
    k = allowed.first_outside(lrs)
    if k is not None:
        allowed.check(f"param group {k}: lr", float(lrs[k]))


_DISABLED: dict = {}  # method -> the method kept out of torch.compile's graphs


def _outside_graphs(method):
    """`method` kept out of torch.compile's graphs (dynamo cannot trace the tracked param
    groups); made at first use, since torch.compiler.disable imports torch._dynamo (most of a
    second). A plain dict, which dynamo reads without a warning (as it would not a cache)."""
    disabled = _DISABLED.get(method)
    if disabled is None:
        disabled = _DISABLED[method] = torch.compiler.disable(method)
    return disabled


class Adam(_FusedOptimizer):
    """`torch.optim.Adam` (and, with decoupled_weight_decay=True, AdamW) on mtapply's fused
    kernel. Same arguments; `foreach`, `fused` and `capturable` are accepted for compatibility
    (the step is always fused and capturable), `differentiable=True` is refused. Turning amsgrad
    on starts `max_exp_avg_sq` at zero where torch.optim raises KeyError.
    `stochastic_rounding=True` stores bfloat16 params rounded stochastically (no master
    weights needed), the random bits keyed by `seed`, the step and the param's place."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 flat_grads=False, stochastic_rounding=False, seed=0):
        _check_adam_args(lr, betas, eps, weight_decay)
        _check_torch_adam_flags(lr, betas, foreach, fused, capturable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        stochastic_rounding=stochastic_rounding, seed=seed)
        super().__init__(params, defaults, flat_grads)

    _merges_groups = True
    _OPTION_NAMES = _BETAS

    def _compile_options(self, group) -> tuple:
        return (bool(group["amsgrad"]), bool(group.get("decoupled_weight_decay", False)),
                bool(group["maximize"]), bool(group.get("stochastic_rounding", False)))

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _required_state(self, group, param) -> tuple:
        return ("step", "exp_avg", "exp_avg_sq")  # max_exp_avg_sq starts when amsgrad does

    def _check_entry(self, group, param, entry, where) -> None:
        if "exp_avg_absmax" in entry or "exp_avg_sq_absmax" in entry:
            raise ValueError(f"{where()} holds 8-bit moments (exp_avg_absmax: a state saved by "
                             f"Adam8bit or AdamW8bit); {type(self).__name__} keeps float moments: "
                             "load it into mtapply.torch.Adam8bit or AdamW8bit")
        super()._check_entry(group, param, entry, where)

    def _make_plan(self, group, lists):
        amsgrad, decoupled, maximize, stochastic = self._compile_options(group)
        return _adam.adam_plan(lists.bound, lists.grads, lists.state("exp_avg"),
                               lists.state("exp_avg_sq"),
                               max_exp_avg_sqs=lists.state("max_exp_avg_sq") if amsgrad else None,
                               amsgrad=amsgrad, decoupled_weight_decay=decoupled,
                               maximize=maximize, stochastic_rounding=stochastic)

    def _values(self, group) -> dict:
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                     weight_decay=group["weight_decay"])
        if group.get("stochastic_rounding", False):
            hyper["seed"] = group.get("seed", 0)
        return hyper

    def _checking_spec(self, group):
        return _adam.AdamSpec()


class AdamW(Adam):
    """`torch.optim.AdamW` on mtapply's fused kernel (decoupled weight decay, default 1e-2)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, flat_grads=False, stochastic_rounding=False,
                 seed=0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, flat_grads=flat_grads,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _compile_options(self, group) -> tuple:
        return (bool(group["amsgrad"]), True, bool(group["maximize"]),
                bool(group.get("stochastic_rounding", False)))


class Adam8bit(Adam):
    """Adam (AdamW with decoupled_weight_decay=True) whose moments are kept in 8 bits
    (`mtapply.adam8bit_step`): per param, `exp_avg` and `exp_avg_sq` are uint8 codes with one
    float32 scale per 256 elements (`exp_avg_absmax`, `exp_avg_sq_absmax`); params of fewer than
    `min_8bit_size` elements keep float32 moments (and empty scales). About 2 bytes of state
    per param instead of 8. Params are float32 or 16-bit; `stochastic_rounding=True` rounds
    bfloat16 params stochastically (see `Adam`)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 maximize=False, decoupled_weight_decay=False, min_8bit_size=_adam8bit.THRESHOLD,
                 flat_grads=False, stochastic_rounding=False, seed=0):
        _check_adam_args(lr, betas, eps, weight_decay)
        if min_8bit_size < 1:
            raise ValueError(f"Invalid min_8bit_size: {min_8bit_size} (at least 1)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                        min_8bit_size=min_8bit_size, stochastic_rounding=stochastic_rounding,
                        seed=seed)
        _FusedOptimizer.__init__(self, params, defaults, flat_grads)

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            form = as_real(p.detach())  # as the plan steps it: complex as real
            made = _adam8bit.adam8bit_state([form], threshold=group["min_8bit_size"])
            for name, column in zip(_8BIT_STATE, made.lists()):
                state[name] = _laid_out_as(column[0], form)

    def _required_state(self, group, param) -> tuple:
        return ("step",) + _8BIT_STATE

    def _keeps_dtype(self, key, value) -> bool:
        return True  # uint8 codes and float32 scales (and float32 moments of small params)

    def _check_entry(self, group, param, entry, where) -> None:
        if "exp_avg" in entry and "exp_avg_absmax" not in entry:
            raise ValueError(f"{where()} holds float moments without exp_avg_absmax (a state "
                             f"saved by Adam or AdamW); {type(self).__name__} keeps 8-bit moments: "
                             "load it into mtapply.torch.Adam or AdamW, or give the param an "
                             "empty state (optimizer.state[p] = {}) to start it afresh")
        StateKeeping._check_entry(self, group, param, entry, where)
        for name in ("exp_avg", "exp_avg_sq"):
            codes, scales = entry[name], entry[name + "_absmax"]
            if not (isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor)):
                raise ValueError(f"{where()} holds {name!r} or {name + '_absmax'!r} as a "
                                 f"{type(codes).__name__}, not a tensor")
            expected = torch.uint8 if scales.numel() else torch.float32
            if codes.dtype != expected:
                raise ValueError(f"{where()} holds {name!r} as {codes.dtype} beside "
                                 f"{scales.numel()} scales: 8-bit moments are uint8 codes with "
                                 "one float32 scale per 256 elements, or float32 without scales")

    def _make_plan(self, group, lists):
        _, decoupled, maximize, stochastic = self._compile_options(group)
        return _adam8bit.adam8bit_plan(lists.bound, lists.grads,
                                       *map(lists.state, _8BIT_STATE),
                                       decoupled_weight_decay=decoupled, maximize=maximize,
                                       stochastic_rounding=stochastic)


_8BIT_STATE = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay, default 1e-2) with 8-bit moments: see `Adam8bit`."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 maximize=False, min_8bit_size=_adam8bit.THRESHOLD, flat_grads=False,
                 stochastic_rounding=False, seed=0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, decoupled_weight_decay=True,
                         min_8bit_size=min_8bit_size, flat_grads=flat_grads,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _compile_options(self, group) -> tuple:
        return (False, True, bool(group["maximize"]), bool(group.get("stochastic_rounding", False)))


class SGD(_FusedOptimizer):
    """`torch.optim.SGD` on mtapply's fused kernel, including its first-step momentum. Params
    with sparse grads take torch.optim's own per-tensor update (on the same stream; GradScaler
    is not taken there), the others the fused step; `differentiable=True` is refused.
    `stochastic_rounding=True` rounds bfloat16 params stochastically (see `Adam`); each param's
    state then also counts its steps (`step`), which key the random bits with `seed`."""

    _counts_steps = False
    _merges_groups = True
    _sparse_grads = True
    _torch_flag_defaults = dict(StateKeeping._torch_flag_defaults, fused=False)  # torch.optim.SGD's

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None,
                 flat_grads=False, stochastic_rounding=False, seed=0):
        _check_one_element(lr, "lr")
        if not (isinstance(lr, torch.Tensor) or lr >= 0.0):
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused,
                        stochastic_rounding=stochastic_rounding, seed=seed)
        super().__init__(params, defaults, flat_grads)

    def _compile_options(self, group) -> tuple:
        return (group["momentum"] != 0, bool(group["nesterov"]), bool(group["maximize"]),
                bool(group.get("stochastic_rounding", False)))

    def _counts(self, group) -> bool:
        # stochastic rounding draws its bits per step: only then does SGD count its steps
        return bool(group.get("stochastic_rounding", False))

    def _prepare_group(self, index, group):
        # torch's first step copies the grad into a new buffer: params without one take a
        # one-off step=1 launch, and join the group's plan from the next step on
        fresh = []
        if group["momentum"] != 0:
            fresh = [p for p in group["params"]
                     if p.grad is not None and self.state[p].get("momentum_buffer") is None]
            if fresh:
                stepped = set(map(id, fresh))
                group = dict(group, params=[p for p in group["params"] if id(p) not in stepped])
        return fresh, super()._prepare_group(index, group)

    def _launch_group(self, index, group, prepared, grad_scale, found_inf) -> None:
        # (fresh params, bound) from _prepare_group; a bound group alone on the flat_grads path
        fresh, bound = prepared if isinstance(prepared, tuple) else ((), prepared)
        for own, params in _by_group(group, fresh) if fresh else ():  # each with its options
            self._first_step(own, params, grad_scale, found_inf)
        super()._launch_group(index, group, bound, grad_scale, found_inf)

    def _first_step(self, group, params, grad_scale, found_inf) -> None:
        fresh = {p: {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
                 for p in params}
        by_device: dict = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for device, members in by_device.items():
            part = _Part(None, members, None, None)
            lists = PlanLists(fresh, members, [p.grad for p in members], _local)
            hyper = dict(self._hyper(group, device), step=1)
            if lists.staging:
                lists.staging.before([p.grad for p in members])
            _sgd.sgd_step(lists.bound, lists.grads, lists.state("momentum_buffer"), **hyper,
                          nesterov=group["nesterov"], maximize=group["maximize"],
                          stochastic_rounding=self._counts(group),
                          grad_scale=part.on_device(grad_scale), found_inf=part.on_device(found_inf))
            if lists.staging:
                lists.staging.after()
        _bump_versions(params)
        for p in params:
            self.state[p]["momentum_buffer"] = fresh[p]["momentum_buffer"]
            if self._counts(group):
                self.state[p]["step"] = torch.tensor(1.0)  # the first step is taken

    def _sparse_step(self, group, params) -> None:
        from torch.optim.sgd import sgd

        if self._counts(group):
            raise RuntimeError("SGD(stochastic_rounding=True) does not take sparse grads: give "
                               "the params dense grads")
        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum else []
        sgd(params, [p.grad for p in params], buffers, has_sparse_grad=True, foreach=False,
            weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        for p, buffer in zip(params, buffers):
            self.state[p]["momentum_buffer"] = buffer

    def _make_plan(self, group, lists):
        buffers = lists.state("momentum_buffer") if group["momentum"] else None
        return _sgd.sgd_plan(lists.bound, lists.grads, buffers, nesterov=group["nesterov"],
                             maximize=group["maximize"], stochastic_rounding=self._counts(group))

    def _init_state(self, group, p, state) -> None:
        buffer = state.get("momentum_buffer")
        if group["momentum"] != 0 and buffer is None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif buffer is not None and buffer.is_sparse:  # made by sparse steps: the same values
            state["momentum_buffer"] = buffer.to_dense()
        if self._counts(group) and "step" not in state:
            state["step"] = torch.tensor(0.0)

    def _values(self, group) -> dict:
        hyper = dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                     weight_decay=group["weight_decay"],
                     step=2 if group["momentum"] != 0 else None)
        if self._counts(group):
            hyper["seed"] = group.get("seed", 0)
        return hyper

    def _checking_spec(self, group):
        return _sgd.SGDSpec(nesterov=bool(group["nesterov"]))


def _index_in(groups: list, p) -> str:
    """Where param p is in the groups, for messages: "3 (param group 1)"."""
    for g, group in enumerate(groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                return f"{i} (param group {g})"
    return "(not in any param group)"


def _owners(merged) -> dict:
    """id(param) -> the index of its own group, in a merged group."""
    return {id(q): k for k, g in enumerate(merged["groups"]) for q in g["params"]}


def _by_group(group, params) -> list:
    """(param group, its params among `params`) pairs: the merged group's own groups, else the
    group itself."""
    if "groups" not in group:
        return [(group, params)]
    owner = _owners(group)
    by_owner: dict = {}
    for p in params:
        by_owner.setdefault(owner[id(p)], []).append(p)
    return [(group["groups"][k], members) for k, members in by_owner.items()]


class _RuleBased(_FusedOptimizer):
    """Optimizers run by a rule (`mtapply.rule`): each group's rule and hyperparameters, state
    tensors named after the rule's slots beside the device step counter `step`."""

    _merges_groups = True

    def _tensor_options(self, group) -> bool:
        return any(isinstance(v, torch.Tensor) for v in self._rule_hyper(group).values())

    def _rule(self, group):
        raise NotImplementedError

    def _rule_hyper(self, group) -> dict:
        """The rule's hyperparameters from a group's options (the same names by default)."""
        return {name: group[name] for name in self._rule(group).hyper}

    def _initial(self, group, p, name: str):
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _compile_options(self, group) -> tuple:
        return (self._rule(group),)

    def _init_state(self, group, p, state) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for name in self._rule(group).slots[1:]:
            if name != "grad" and name not in state:
                state[name] = self._initial(group, p, name)

    def _required_state(self, group, param) -> tuple:
        rule = self._rule(group)  # `step` where the update reads it
        return (("step",) if rule.program.uses_step else ()) + tuple(
            name for name in rule.slots[1:] if name != "grad")

    def _make_plan(self, group, lists):
        given, rule = {"param": lists.bound, "grad": lists.grads}, self._rule(group)
        return rule.plan(*(given[name] if name in given else lists.state(name)
                           for name in rule.slots))

    def _values(self, group) -> dict:
        return self._rule_hyper(group)

    def _checking_spec(self, group):
        return self._rule(group).spec()

    def _range(self, group, name: str) -> Range:
        return self._rule(group).program.ranges[name]


class RuleOptimizer(_RuleBased):
    """A user-written rule (`mtapply.rule`) as a `torch.optim.Optimizer`, made by `optimizer`.

    Each hyperparameter of the rule is a param group option (its default from the rule; a rule
    default of None is required, as torch's `lr` is); any may be a float or a one-element
    float32 tensor on the params' device. Each slot other than param and grad is a per-param
    state tensor of that name, zero at first, beside the device step counter `step`.
    """

    def __init__(self, rule, params, *, flat_grads=False, **hyper):
        from torch.optim.optimizer import required

        unknown = sorted(set(hyper) - set(rule.hyper))
        if unknown:
            raise TypeError(f"rule {rule.name!r} has no hyperparameter {unknown[0]!r} (it takes "
                            f"{', '.join(rule.hyper)})")
        for name, value in hyper.items():
            _check_one_element(value, name)
        self.rule = rule
        defaults = {name: hyper.get(name, required if default is None else default)
                    for name, default in rule.hyper.items()}
        super().__init__(params, defaults, flat_grads)

    def __getstate__(self):
        return dict(super().__getstate__(), rule=self.rule)  # a copy steps by the same rule

    def _rule(self, group):
        return self.rule


class Lion(_RuleBased):
    """Lion (lion-pytorch's arguments and state: `exp_avg`), from `mtapply.rules.library.lion`:
    p = p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g.
    """

    _OPTION_NAMES = _BETAS

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 flat_grads=False):
        _check_adam_args(lr, betas, 0.0, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), flat_grads)

    def _rule(self, group):
        return library.lion()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])


class Adan(_RuleBased):
    """Adan (`mtapply.rules.library.adan`, optax.adan's update) with the arguments of the
    authors' PyTorch implementation: betas=(beta1, beta2, beta3), eps, weight_decay (decoupled:
    p -= lr * (update + weight_decay * p)). State: `m`, `v`, `n`, `prev_grad`, `step`."""

    _OPTION_NAMES = _BETAS

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0,
                 *, flat_grads=False):
        _check_options(lr=lr, eps=eps, weight_decay=weight_decay)
        for k, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay), flat_grads)

    def _rule(self, group):
        return library.adan()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2, beta3 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"],
                    eps_root=0.0, weight_decay=group["weight_decay"])


class ScheduleFreeAdamW(_RuleBased):
    """Schedule-free AdamW (`mtapply.rules.library.schedule_free_adamw`) with the update of
    optax.contrib.schedule_free_adamw and the arguments and train()/eval() of the authors'
    AdamWScheduleFree: the params hold y while training; `eval()` puts the average x in them
    and `train()` puts y back. Per group, the running max lr, the sum of the averaging weights
    and the steps taken are host numbers in the group (saved with state_dict); each param's
    state holds `z` (a copy of the param at first), `nu` and `step`. lr is a number (the weights
    are computed on the host: a tensor lr is read there at each step, which costs a CUDA one a
    synchronisation); a step skipped by GradScaler still advances them."""

    _merges_groups = False  # its per-group running values live in each group

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 warmup_steps=0, weight_lr_power=2.0, *, flat_grads=False):
        _check_options(lr=lr, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps)
        if not 0.0 < betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas} (beta1 in (0, 1), beta2 in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps, weight_lr_power=weight_lr_power,
                        lr_max=0.0, weight_sum=0.0, k=0, train_mode=True)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.schedule_free_adamw()

    def _initial(self, group, p, name: str):
        return p.detach().clone() if name == "z" else super()._initial(group, p, name)

    def _before_groups(self, grad_scale, found_inf, flat_buffers) -> None:
        for index, group in enumerate(self.param_groups):  # a tensor lr, filled in place
            if isinstance(group["lr"], torch.Tensor):
                LR.check(f"param group {index}: lr", float(group["lr"]))

    def _prepare_group(self, index, group):
        if not group["train_mode"]:
            raise RuntimeError("ScheduleFreeAdamW.step() in eval mode: call optimizer.train() "
                               "first (eval() put the averaged params in place)")
        return super()._prepare_group(index, group)

    def _launch_group(self, index, group, bound, grad_scale, found_inf) -> None:
        """Advances the group's running values (every step the group takes, whichever way it
        was prepared: with flat_grads too), then steps it. They are the optimizer's own
        values, not options: set without noting a change of the group."""
        if bound is None:
            return  # no step for this group: its averaging weights stay as they are
        k = group["k"]
        lr_max = max(group["lr_max"], self._scheduled(group, k + 1))
        weight = lr_max ** group["weight_lr_power"]
        weight_sum = group["weight_sum"] + weight
        for key, value in (("_lr", self._scheduled(group, k)),  # the base step's, as optax's
                           ("lr_max", lr_max), ("weight_sum", weight_sum),
                           ("_ck", weight / weight_sum if weight_sum > 0 else 0.0),
                           ("k", k + 1)):
            dict.__setitem__(group, key, value)
        super()._launch_group(index, group, bound, grad_scale, found_inf)

    _OPTION_NAMES = {"b1": "betas[0]", "b2": "betas[1]"}

    def _checked_values(self, group) -> dict:
        # the step's lr is at most the group's; the averaging weight ck is in [0, 1]
        return dict(self._rule_hyper(dict(group, _lr=group["lr"], _ck=0.0)), step=1.0)

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)
        check_number(f"param group {index}: warmup_steps", group["warmup_steps"], low=0.0)
        check_number(f"param group {index}: weight_lr_power", group["weight_lr_power"])

    @staticmethod
    def _scheduled(group, step: int) -> float:
        """optax.warmup_constant_schedule(0, lr, warmup_steps) at `step`."""
        warmup = group["warmup_steps"]
        return float(group["lr"]) * (min(step, warmup) / warmup if warmup > 0 else 1.0)

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["_lr"], b1=beta1, b2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], ck=group["_ck"])

    @torch.no_grad()
    def eval(self) -> None:
        """Puts x, the average to evaluate, in the params."""
        self._swap(to_train=False)

    @torch.no_grad()
    def train(self) -> None:
        """Puts y, the point the gradients are taken at, back in the params."""
        self._swap(to_train=True)

    def _swap(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] == to_train:
                continue
            beta1 = group["betas"][0]
            for p in group["params"]:
                z = self.state.get(p, {}).get("z")
                if z is not None:  # y = b1 x + (1 - b1) z, both ways as a lerp towards z
                    p.lerp_(z, 1 - beta1 if to_train else 1 - 1 / beta1)
            group["train_mode"] = to_train


class Adagrad(_RuleBased):
    """`torch.optim.Adagrad` (same arguments and state: `sum`, `step`) from
    `mtapply.rules.library.adagrad`; `foreach`, `fused` and `differentiable=False` are accepted
    for compatibility. Params with sparse grads take torch.optim's own per-tensor update, as
    SGD's do."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, flat_grads=False):
        _check_options(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                       initial_accumulator_value=initial_accumulator_value, eps=eps)
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, flat_grads)

    _sparse_grads = True

    def _rule(self, group):
        return library.adagrad(bool(group["maximize"]))

    def _sparse_step(self, group, params) -> None:
        from torch.optim.adagrad import adagrad

        for p in params:  # its own step count, on the CPU as torch.optim keeps it
            self._init_param_state(group, p)
            self.state[p]["step"] = torch.tensor(float(self.state[p]["step"]),
                                                 dtype=torch.float32)
        adagrad(params, [p.grad for p in params], [self.state[p]["sum"] for p in params],
                [self.state[p]["step"] for p in params], has_sparse_grad=True, foreach=False,
                lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
                eps=group["eps"], maximize=bool(group["maximize"]))

    def _initial(self, group, p, name: str):
        value = float(group["initial_accumulator_value"])
        if p.is_complex():  # as torch: both parts of the real view start at the value
            value = complex(value, value)
        return torch.full_like(p, value, memory_format=torch.preserve_format)


class RMSprop(_RuleBased):
    """`torch.optim.RMSprop` (same arguments and state: `square_avg`, `grad_avg`,
    `momentum_buffer`, `step`) from `mtapply.rules.library.rmsprop`; `foreach`, `capturable`
    and `differentiable=False` are accepted for compatibility. Turning `centered` or momentum
    on starts `grad_avg` or `momentum_buffer` at zero where torch.optim raises KeyError."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *, flat_grads=False):
        _check_options(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                       momentum=momentum)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered, capturable=capturable,
                        foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.rmsprop(bool(group["centered"]), group["momentum"] > 0,
                               bool(group["maximize"]))

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)  # momentum too, where it is above 0
        check_number(f"param group {index}: momentum", group["momentum"], low=0.0)

    def _required_state(self, group, param) -> tuple:
        return ("step", "square_avg")  # grad_avg, momentum_buffer start when their options do


def _check_one_element(value, name: str) -> None:
    """torch.optim's refusal of a tensor option of several elements (an lr, in torch)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")


def _check_options(**values) -> None:
    """torch.optim's checks of non-negative options, with its messages."""
    _check_one_element(values.get("lr"), "lr")
    for name, value in values.items():
        if not 0.0 <= float(value):
            label = {"lr": "learning rate", "eps": "epsilon value"}.get(name, f"{name} value")
            raise ValueError(f"Invalid {label}: {value}")


def _differ(a, b) -> bool:
    """Whether two groups' options differ: tensors by their memory (no read), else by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.data_ptr() == b.data_ptr())
    return a != b


def optimizer(rule, params, *, flat_grads=False, **hyper) -> RuleOptimizer:
    """`rule` (from `mtapply.rule`) as a torch.optim.Optimizer over `params` (params or param
    groups), with the rule's hyperparameters as options: param groups, state_dict, LR
    schedulers, GradScaler and `flat_grads` as the built-in optimizers have them.

    Example:
        >>> opt = mtapply.torch.optimizer(lion, model.parameters(), lr=1e-4, weight_decay=0.1)
    """
    return RuleOptimizer(rule, params, flat_grads=flat_grads, **hyper)


def _is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def _local(tensor):
    """The writable local shard of an FSDP2 (DTensor) param, grad or state; else the tensor."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _locals(tensors: list) -> list:
    return list(map(_local, tensors)) if any(map(_is_dtensor, tensors)) else tensors


def _shard_groups(param) -> list:
    """The process groups over which a DTensor param is sharded (its Shard mesh dimensions)."""
    mesh = param.device_mesh
    return [mesh.get_group(d) for d, placement in enumerate(param.placements) if placement.is_shard()]


def _all_reduce_sums(plan, param):
    """For LARS and LAMB over FSDP2 shards: (the plan's per-tensor sums as a torch view, a hook
    that sums them over the shard groups between the norms pass and the update), so every rank
    takes the norms of the whole tensors; (None, None) for single-pass ops."""
    if not plan.spec.n_sums:
        return None, None
    sums = plan.sums()
    if sums is None:  # the CPU backend sums each tensor whole: it has no pass to hook
        raise ValueError(f"{plan.spec.name} over FSDP2 (DTensor) shards on {param.device}: "
                         "the per-tensor norms are all-reduced between the kernels' passes, "
                         "which run on a GPU; put the model on CUDA devices")
    import torch.distributed as dist

    view = torch.as_tensor(sums, device=param.device)  # the plan's own memory, no copy
    groups = _shard_groups(param)

    def all_reduce(_pass: int) -> None:
        for group in groups:
            dist.all_reduce(view, group=group)

    return view, all_reduce


class LARS(_FusedOptimizer):
    """LARS (You et al. 2017; see `mtapply.lars_step`) as a torch optimizer. A param group
    with `exclude=True` (biases, norm layers) takes plain momentum steps without adaptation or
    weight decay. State per param: `momentum_buffer`."""

    _counts_steps = False
    _merges_groups = True

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                 eps=0.0, exclude=False, *, flat_grads=False):
        _check_one_element(lr, "lr")
        for name, value in (("learning rate", lr), ("momentum", momentum),
                            ("weight_decay", weight_decay), ("trust_coefficient", trust_coefficient),
                            ("epsilon", eps)):
            if not isinstance(value, torch.Tensor) and not value >= 0.0:
                raise ValueError(f"Invalid {name} value: {value}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, exclude=exclude)
        super().__init__(params, defaults, flat_grads)

    def _compile_options(self, group) -> tuple:
        if "groups" in group:  # merged: each tensor is excluded as its own group says
            return tuple(bool(g["exclude"]) for g in group["groups"])
        return (bool(group["exclude"]),)

    def _merge_options(self, group) -> tuple:
        return ()  # exclude is a per-tensor flag of the plan

    def _init_state(self, group, p, state) -> None:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _required_state(self, group, param) -> tuple:
        return ("momentum_buffer",)

    def _make_plan(self, group, lists):
        owner = _owners(group) if "groups" in group else None
        exclude = [bool((group["groups"][owner[id(p)]] if owner else group)["exclude"])
                   for p in lists.params]
        return _lars.lars_plan(lists.bound, lists.grads, lists.state("momentum_buffer"),
                               exclude=exclude)

    def _values(self, group) -> dict:
        return dict(lr=group["lr"], momentum=group["momentum"],
                    weight_decay=group["weight_decay"],
                    trust_coefficient=group["trust_coefficient"], eps=group["eps"])

    def _checking_spec(self, group):
        return _lars.LARSSpec()


class LAMB(_FusedOptimizer):
    """LAMB with Apex FusedLAMB's arguments and semantics (see `mtapply.lamb_step`). With
    max_grad_norm > 0 the grads of every group are clipped by their global norm, computed on
    the device (one launch per device and dtype, with a plan bound once, like the step's).
    State per param: `step`, `exp_avg`, `exp_avg_sq`."""

    _OPTION_NAMES = _BETAS
    _merges_groups = True

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, *, flat_grads=False):
        _check_adam_args(lr, betas, eps, weight_decay)
        if max_grad_norm < 0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, adam_w_mode=bool(adam_w_mode),
                        use_nvlamb=bool(use_nvlamb))
        super().__init__(params, defaults, flat_grads)
        self._grad_norm = _GlobalNorm()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._grad_norm = _GlobalNorm()

    def _before_groups(self, grad_scale, found_inf, flat_buffers) -> None:
        self._grad_norm.clear()
        if not any(g["max_grad_norm"] > 0 for g in self.param_groups):
            return
        if flat_buffers is not None:  # their padding is zero
            self._grad_norm.compute(flat_buffers, flat_buffers, grad_scale)
            return
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if params:
            self._grad_norm.compute(params, list(map(_GRAD, params)), grad_scale)

    def _compile_options(self, group) -> tuple:
        return (bool(group.get("adam_w_mode", True)), bool(group.get("use_nvlamb", False)))

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _required_state(self, group, param) -> tuple:
        return ("step", "exp_avg", "exp_avg_sq")

    def _make_plan(self, group, lists):
        adam_w_mode, use_nvlamb = self._compile_options(group)
        return _lamb.lamb_plan(lists.bound, lists.grads, lists.state("exp_avg"),
                               lists.state("exp_avg_sq"), adam_w_mode=adam_w_mode,
                               use_nvlamb=use_nvlamb)

    def _values(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    grad_averaging=bool(group["grad_averaging"]),
                    bias_correction=bool(group["bias_correction"]),
                    max_grad_norm=float(group["max_grad_norm"]))

    def _hyper(self, group, device) -> dict:
        hyper = super()._hyper(group, device)
        norm = self._grad_norm.on(device)  # one for all groups (None where none clips)
        if norm is None:
            hyper["max_grad_norm"] = 0.0
        hyper["global_grad_norm"] = norm
        return hyper

    def _checking_spec(self, group):
        return _lamb.LAMBSpec()

    def _checked_values(self, group) -> dict:
        return dict(super()._checked_values(group), global_grad_norm=0.0)


class _GlobalNorm:
    """The global L2 norm of every grad of an optimizer, on the device: per device, a norm plan
    bound once and re-pointed when grads move; devices' norms combined on the first; over FSDP2
    shards, all-reduced. Divided by the loss scale when GradScaler passes one. The norm lives
    in one tensor per device from step to step (the plans that read it know it by identity):
    the first device's total, or its copy on another device."""

    def __init__(self):
        self._plans: dict = {}  # device -> [weak owner refs, weak grad refs, Plan, strides]
        self._totals: dict = {}  # device -> the total written there by its norm plan
        self._copies: dict = {}  # device -> the norm copied there
        self._norm = None
        self._copied: set = set()  # the devices copied to in this step

    def clear(self) -> None:
        self._norm = None
        self._copied = set()

    def compute(self, owners: list, grads: list, grad_scale) -> None:
        """The norm of `grads`: the grads of params `owners`, or flat buffers (their own owners)
        holding them. A plan is bound per set of owners, which fixes the grads' shapes."""
        by_device: dict = {}
        for owner, g in zip(owners, grads):
            members = by_device.setdefault(g.device, ([], []))
            members[0].append(owner)
            members[1].append(g)
        totals = [self._device_total(device, *members) for device, members in by_device.items()]
        norm = totals[0]  # the result is written into it
        if len(totals) > 1:
            norm.copy_(torch.stack([t.to(norm.device) for t in totals]).square().sum(0).sqrt())
        if _is_dtensor(grads[0]):  # the norm over every rank's shards
            import torch.distributed as dist

            squared = norm.square()
            for group in _shard_groups(grads[0]):
                dist.all_reduce(squared, group=group)
            torch.sqrt(squared, out=norm)
        if grad_scale is not None:  # the norm of the unscaled grads
            norm.div_(grad_scale.reshape(1).to(norm.device))
        self._norm = norm

    def on(self, device):
        """The norm as a one-element float32 tensor on `device` (None before `compute`)."""
        if self._norm is None or self._norm.device == device:
            return self._norm
        if device not in self._copies:
            self._copies[device] = torch.empty(1, device=device)
        if device not in self._copied:
            self._copied.add(device)
            self._copies[device].copy_(self._norm)
        return self._copies[device]

    def _device_total(self, device, owners: list, grads: list):
        local = as_reals(_locals(grads))  # a complex grad: the norm of its complex values
        entry = self._plans.get(device)
        moved = entry is None or any(map(operator.is_not, grads, map(_DEREF, entry[1])))
        # the same owners (by identity: an id may be reused by a new param of another shape)
        if (entry is None or len(entry[0]) != len(owners)
                or any(map(operator.is_not, owners, map(_DEREF, entry[0])))
                or (moved and _forms(local) != entry[3])):  # another size or layout
            plan = Plan(L2NormSpec(), {"tensors": local})
            plan.release("tensors", watch=False)
            entry = self._plans[device] = [list(map(weakref.ref, owners)),
                                           list(map(weakref.ref, grads)), plan, _forms(local)]
        elif moved:
            entry[2].rebind_addresses("tensors", local, _addresses(local), keep_alive=False)
            entry[1] = list(map(weakref.ref, grads))
        if device not in self._totals:
            self._totals[device] = torch.zeros(1, device=device)
        total = self._totals[device]
        entry[2].step(total_out=total)
        entry[2].release("tensors", watch=False)
        return total


def _forms(tensors: list) -> list:
    """Each tensor's shape and strides: what a plan bound to them fixes."""
    return [(t.shape, t.stride()) for t in tensors]


def _check_adam_args(lr, betas, eps, weight_decay) -> None:
    """torch.optim.Adam's argument checks and messages."""
    _check_one_element(lr, "lr")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")




def _check_torch_adam_flags(lr, betas, foreach, fused, capturable) -> None:
    """torch.optim.Adam's refusals of its flag combinations, with its messages (mtapply's one
    step would take them, but code written for torch.optim never meets them)."""
    if foreach and fused:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    if foreach and not capturable:
        if isinstance(lr, torch.Tensor):
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
        if isinstance(betas[0], torch.Tensor):
            raise ValueError("betas[0] as a Tensor is not supported for capturable=False and "
                             "foreach=True")

