"""The torch.optim.Optimizer whose param groups step through mtapply plans: what every
`mtapply.torch` optimizer shares (binding groups to plans, repeats of unchanged steps, the
whole-step checks, the step counters, flat grads, state)."""
from __future__ import annotations

import functools
import operator
from itertools import chain, repeat

import numpy as np
import torch

from ._flat_grads import FlatGrads
from ._group_lrs import GroupLrs, TensorCopies
from ._launch import stream_pointer
from ._optimizer_step import AmpScaling, closure_loss, lean_step
from ._optimizer_step import bump_versions as _bump_versions
from ._param_groups import ANY, PARAMS, GroupChanges, tracked
from ._ranges import ANY as ANY_NUMBER
from ._ranges import LR, Range
from ._torch_binding import Bound, LatestStep, Part, is_dtensor, local_tensor
from ._torch_layouts import PlanLists, dense_strides
from ._torch_state import MASTER, MASTER_8BIT, MASTER_STOCHASTIC, StateKeeping
from .scaling import zero_

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_NOT_NONE = functools.partial(operator.is_not, None)
_LR = operator.itemgetter("lr")
_PARAMS = operator.itemgetter("params")
BETA_NAMES = {"beta1": "betas[0]", "beta2": "betas[1]", "beta3": "betas[2]"}  # the ops' names


class FusedOptimizer(StateKeeping, torch.optim.Optimizer):
    """What the mtapply optimizers share: binding groups to plans, AMP, device step counters."""

    # takes GradScaler's grad_scale / found_inf itself, and grads unscaled by its unscale_
    _step_supports_amp_scaling = AmpScaling()
    _counts_steps = True  # a device step counter (Adam, LAMB); SGD and LARS keep none
    # whether groups of equal compile options step as one plan, each tensor reading its
    # group's hyperparameters (per-tensor rows): ops whose hyperparameters are plain numbers
    _merges_groups = False
    _SHARED = {"seed": 0}  # hyperparameters (by default) equal across groups to merge them
    _sparse_grads = False  # whether params with sparse grads step (by torch.optim's update)

    def __init__(self, params, defaults, flat_grads=False, master_weights=False):
        self._take_master_weights(master_weights)
        self._flat_grads = bool(flat_grads)
        self._flat = None
        self._group_changes = GroupChanges()
        self._merged = (0, None)  # (changes version, the merged group or None)
        self._groups_seen = 0  # the changes version at which the params were last looked at
        self._apart_seen = 0  # the changes version at which no param was in two groups
        self._latest = None  # the latest step, where a step may repeat it (`LatestStep`)
        super().__init__(params, defaults)
        self._keep_state()
        self._bound: dict = {}
        self._check_groups()  # as each step checks them again where they changed
        if self._flat_grads:
            self._refuse_dtensors()  # the flat buffers are made at the first zero_grad or step

    def _take_master_weights(self, master_weights) -> None:
        """master_weights=True: each float16 or bfloat16 param steps through an fp32 copy kept
        in its state (`MASTER`), which the kernel reads, updates and rounds into the param;
        refused with 8-bit state (run before torch's __init__, after state_bits is known)."""
        if not isinstance(master_weights, (bool, np.bool_)):
            raise TypeError(f"master_weights must be True or False, got {master_weights!r}")
        if master_weights and getattr(self, "state_bits", 32) == 8:
            raise ValueError(MASTER_8BIT.format(type(self).__name__))
        self.master_weights = bool(master_weights)

    def __getstate__(self):
        return dict(super().__getstate__(), _flat_grads=self._flat_grads,
                    master_weights=self.master_weights)

    def __setstate__(self, state) -> None:  # copy.deepcopy and pickle keep only torch's fields
        super().__setstate__(state)  # load_state_dict comes here too, with new groups
        for group in self.param_groups:  # an older pickle's groups
            self._fill_group(group)
        self._numbers_to_tensor_steps()
        self._keep_state()  # plans bound to the old state are dropped below
        self._flat_grads = state.get("_flat_grads", getattr(self, "_flat_grads", False))
        self.master_weights = state.get("master_weights", getattr(self, "master_weights", False))
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
        # torch's: "AdamW (" and the groups; "AdamW ()" before the first group is added
        _, _, groups = super().__repr__().partition("\n")
        rule = getattr(self, "rule", None)
        own = ((f"rule={rule!r}, " if rule is not None else "")
               + f"flat_grads={getattr(self, '_flat_grads', False)}")
        if getattr(self, "master_weights", False):
            own += ", master_weights=True"
        return f"{type(self).__module__}.{type(self).__qualname__} ({own}) (\n{groups or ')'}"

    # -- torch.optim.Optimizer interface ------------------------------------------------------

    step = lean_step()  # torch.optim's wrapper only where a profiler or a hook needs it

    def _plain_step(self, closure=None):
        loss = closure_loss(closure)
        if torch.compiler.is_compiling():  # being traced: the launch stays out of the graph
            _outside_graphs(FusedOptimizer._fused_step)(self)
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
        if self._flat is not None and self._flat.requires_grad_moved():  # one compiled scan
            self._follow_frozen()
        attributes = self.__dict__  # GradScaler.step sets grad_scale and found_inf there
        grad_scale, found_inf = attributes.get("grad_scale"), attributes.get("found_inf")
        if self._latest is not None and grad_scale is None and found_inf is None:
            if self._latest.repeat(self):  # launches only: no torch op to keep from autograd
                return
        self._latest = None
        with torch.no_grad():
            self._grouped_steps(grad_scale, found_inf)
        self._state_kept()

    def _follow_frozen(self) -> None:
        """With flat_grads, where a param was frozen or unfrozen since the last step: the groups
        bind again over the params that require grad. A frozen param keeps its view, which
        steps no more (as torch.optim skips a grad of None); an unfrozen one takes its view
        back, or where it has none, the buffers are made again around it in this step."""
        if not self._flat.follow_requires_grad():
            self._flat = None  # made again by this step, its grad copied in
        self._bound.clear()
        self._latest = None

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
        self._held = {}  # the groups found as bound in this step (`_as_bound`)
        flat = self._flat_grads_in_place()
        merged = self._merged_group()  # params edited in place merge again, as torch sees them
        if (merged is None) == ("merged" in self._bound):  # the other way's plans are stale
            self._bound.clear()
        prepared, self._made = [], []
        try:
            stepped = self._prepare_groups(merged, flat, prepared, grad_scale, found_inf)
        except BaseException:
            self._unmake_state()
            raise
        finally:
            self._made = None
        self._before_groups(grad_scale, found_inf, self._flat.trainable if flat else None)
        for index, group, bound, sparse in prepared:
            for own, members in by_group(group, sparse) if sparse else ():
                self._sparse_step(own, members)  # each with its own group's options
            self._launch_group(index, group, bound, grad_scale, found_inf)
        if self._flat is not None:
            self._flat.mark()
        if stepped and grad_scale is None and found_inf is None and self._repeats_steps():
            parts = [(index, part) for index, _, bound, _ in prepared for part in bound.parts]
            self._latest = LatestStep.of(parts, self._group_changes.version)

    def _prepare_groups(self, merged, flat, prepared: list, grad_scale, found_inf) -> bool:
        """Binds every group into `prepared` (index, group, bound, sparse params) and makes the
        refusals that need them all; returns whether every group steps by its bound parts."""
        stepped = flat
        for index, group in [("merged", merged)] if merged else enumerate(self.param_groups):
            bound = self._bound.get(index) if flat else None
            sparse = ()
            if bound is None or not bound.complete or bound.options != self._compile_options(group):
                dense, sparse = self._split_sparse(index, group, grad_scale, found_inf)
                bound = self._prepare_group(index, dense)
                stepped = False
                if self._flat is not None and index in self._bound:
                    self._bound[index].complete = self._bound[index].key == tuple(
                        id(p) for p in group["params"] if p.requires_grad)
                group = dense
            prepared.append((index, group, bound, sparse))
        self._check_prepared(prepared, grad_scale is not None or found_inf is not None)
        return stepped

    def _unmake_state(self) -> None:
        """After a refused step: the state its binding made is dropped, with the plans that
        point at it, so that the step leaves the optimizer as it found it."""
        for p in self._made:
            self.state.pop(p, None)
        if self._made:
            self._bound.clear()
            self._held = {}

    @classmethod
    def _repeats_steps(cls) -> bool:
        """Whether a step's host work is that of its parts' launches alone (no work across
        groups, no per-group host work), so that a step repeating the latest may skip it."""
        return (cls._before_groups is FusedOptimizer._before_groups
                and cls._launch_group is FusedOptimizer._launch_group
                and cls._step_part is FusedOptimizer._step_part)

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
                if is_dtensor(p):
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
            _outside_graphs(FusedOptimizer._zero_grad)(self, set_to_none)
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
                by_device.setdefault(g.device, []).append(local_tensor(g))
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

    def _check_prepared(self, prepared: list, scaled: bool) -> None:
        """Refusals that need every group bound (index, group, bound, sparse params), raised
        before any group steps; `scaled`: the step takes GradScaler's scale or inf flag."""

    def _before_groups(self, grad_scale, found_inf, flat_buffers) -> None:
        """Work that spans the groups (LAMB's global gradient norm). `flat_buffers`: with
        flat_grads and every grad in its view, tensors that hold all the grads that step (the
        buffers, or where a param is frozen, the other params' views)."""

    def _prepare_group(self, index, group) -> Bound | None:
        """The group bound to plans that point at this step's grads (None where no param
        has a grad); raises where the group cannot step, before any group launches."""
        # The common case costs one compiled scan (`Bound.holds`), or C-level scans of torch's
        # accessors: the same params, every one with a grad.
        held = self._as_bound(index, group)
        if held is not None:
            return held
        params = group["params"]
        options = self._compile_options(group)
        bound = self._bound.get(index)
        grads = list(map(_GRAD, params))
        same = (bound is not None and bound.options == options and len(bound.params) == len(params)
                and all(map(operator.is_, params, bound.params))
                and not any(map(operator.is_, grads, repeat(None))))
        if not same:
            params = self._stepping(params)
            if not params:
                if self._flat_grads:  # found as bound by the next steps, with nothing to launch
                    self._bound[index] = Bound.nothing(options)
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

    def _stepping(self, params) -> list:
        """The params that a step updates: those with a grad, as torch.optim's. Under
        flat_grads only those that require grad, since a frozen param keeps its view (zero,
        where torch.optim would see a grad of None)."""
        if self._flat_grads:
            return [p for p in params if p.requires_grad and p.grad is not None]
        return [p for p in params if p.grad is not None]

    def _as_bound(self, index, group) -> Bound | None:
        """The group's bound plans where the group is as they were bound (its params, their
        addresses, a dense grad each at its bound address: `Bound.holds`), else None; one
        compiled scan a step."""
        if index not in self._held:
            bound = self._bound.get(index)
            self._held[index] = bound if (bound is not None
                                          and bound.options == self._compile_options(group)
                                          and bound.holds(group["params"])) else None
        return self._held[index]

    def _launch_group(self, index, group, bound, grad_scale, found_inf) -> None:
        """Steps a group as `_prepare_group` prepared it."""
        if bound is not None:
            for part in bound.parts:
                self._step_part(part, group, grad_scale, found_inf)

    def _split_sparse(self, index, group, grad_scale, found_inf) -> tuple:
        """(the group without its params whose grads are sparse, those params), for optimizers
        that step them by `_sparse_step` (a C-level scan, or none where the group is as bound:
        its grads are dense then); else (the group, ())."""
        params = group["params"]
        if not self._sparse_grads:
            return group, ()
        if (self._as_bound(index, group) is not None
                or not any(map(_IS_SPARSE, filter(_NOT_NONE, map(_GRAD, params))))):
            return group, ()
        sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
        if any(map(self._takes_master, sparse)):
            raise RuntimeError(f"{type(self).__name__}(master_weights=True) does not take sparse "
                               "grads of float16 or bfloat16 params (torch.optim's sparse step "
                               "would update the params, not their fp32 masters): give them "
                               "dense grads")
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
                    or any(group.get(k, d) != groups[0].get(k, d) for k, d in self._SHARED.items())):
                return None
        return dict(groups[0], params=list(chain.from_iterable(map(_PARAMS, groups))),
                    groups=groups)

    def _merge_options(self, group) -> tuple:
        """What groups must share to step as one plan: their compile options, unless the
        optimizer gives some of those per tensor."""
        return self._compile_options(group)

    def _tensor_options(self, group) -> bool:
        """Whether a group gives a hyperparameter as a tensor that keeps its groups from
        stepping as one (an lr tensor does not: each tensor's row reads its group's; one
        read as a number at each step does, as a merged part keeps its numbers)."""
        return any(isinstance(value, torch.Tensor) for name, value in self._values(group).items()
                   if name != "lr")

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
        owner = group_owners({"groups": groups})  # groups may have moved in the list since the bind
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
                or not all(type(h.get("lr")) is float for h in per_group)
                or part.plan is not None and part.plan.spans_devices):  # (reads numbers)
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
            part.sums.zero_()  # empty shards add nothing: their sums are never written
        if part.counter is not None:  # the plan counts the step in it, or the host does
            hyper["step"] = float(part.counter) + 1.0 if part.host_counter else part.counter
        staging = part.staging
        if staging is not None:
            staging.before([p.grad for p in part.params])
        try:
            part.plan.step(grad_scale=scale, found_inf=skip, after_pass=part.after_pass, **hyper)
        finally:
            part.plan.release("grads", watch=False)
        if staging is not None:
            staging.after()
        if part.host_counter:
            part.counter.add_(1.0)
        _bump_versions(part.params)

    def _check_grads(self, params) -> None:
        """Refuses the grads a step cannot read: sparse ones, ones of another shape than their
        param's, and complex ones beside a real param (or the other way round)."""
        for p in params:
            if p.is_sparse or p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if p.grad.shape != p.shape:
                raise ValueError(f"param {_index_in(self.param_groups, p)} has shape "
                                 f"{tuple(p.shape)} but its grad {tuple(p.grad.shape)}: give it "
                                 f"a grad of its shape, or None to skip it this step")
            if p.is_complex() != p.grad.is_complex():  # (a complex param steps as its real view)
                raise TypeError(f"param {_index_in(self.param_groups, p)} is {p.dtype} but its "
                                f"grad {p.grad.dtype}: give it a grad of its dtype")

    def _bind(self, key, options, group, params, grads) -> Bound:
        self._check_grads(params)
        owner = group_owners(group) if "groups" in group else None  # params keep their group's
        for p in params:
            self._init_param_state(group["groups"][owner[id(p)]] if owner else group, p)
        # params of one device and one step count share a plan, those with fp32 masters apart
        classes: dict = {}
        counts: dict = {}  # one host read per step tensor (params of a plan share one)
        counting = self._counts(group)
        masters = self._takes_master if self.master_weights else _NO_MASTER
        spans = self._spans_devices(group)
        counted = [_count(self.state[p]["step"], counts) if counting else 0.0 for p in params]
        if counting and self._counts_per_group(group):
            counted = _group_counts(counted, [owner[id(p)] for p in params] if owner else None)
        for i, (p, count) in enumerate(zip(params, counted)):
            classes.setdefault((p.device.type if spans else p.device, count, masters(p)),
                               []).append(i)
        parts = []
        for (_, count, master), indices in classes.items():
            members = [params[i] for i in indices]
            lists = PlanLists(self.state, members, [grads[i] for i in indices], local_tensor)
            if master:
                lists.masters = lists.state(MASTER)
            plan = self._make_plan(group, lists)
            counter = None
            if counting:  # a plan over several GPUs has its steps counted on the host
                host = plan is not None and plan.spans_devices
                counter = self._counter(members, count, "cpu" if host else members[0].device)
            parts.append(Part(np.asarray(indices), members, plan, counter, lists.staging))
            if owner:
                parts[-1].group_of = np.array([owner[id(p)] for p in members], np.int64)
        return Bound(key, options, list(params), grads, parts)

    def _init_param_state(self, group, p) -> None:
        """Checks a param's state, or makes it where it has none (an optimizer that keeps no
        state for it leaves no empty entry, as torch.optim)."""
        state = self.state.get(p)
        if state:
            self._check_entry(group, p, state, lambda: f"optimizer.state of param "
                              f"{_index_in(self.param_groups, p)}")
            self._keep_master(p, state)  # made before the state that may start from the param
            self._init_state(group, p, state)
            return
        state = {}
        self._keep_master(p, state)
        self._init_state(group, p, state)
        if state:
            self.state[p] = state
            if self._made is not None:
                self._made.append(p)

    def _counts(self, group) -> bool:
        """Whether the group's params keep a device step counter."""
        return self._counts_steps

    def _counts_per_group(self, group) -> bool:
        """Whether the params of a group step with one count, the group's: a param that
        missed steps (a grad of None) takes the group's count when it steps again."""
        return False

    def _spans_devices(self, group) -> bool:
        """Whether the group's CUDA params on several GPUs step as one plan (a rule that sums
        over all of them), rather than one per GPU."""
        return False

    def _counter(self, params, count: float, device):
        """One step counter for params of equal step count, on `device`: their `state["step"]`."""
        counter = torch.tensor(count, dtype=torch.float32, device=device)
        for p in params:
            self.state[p]["step"] = counter
        return counter

    # -- hyperparameters ------------------------------------------------------------------------

    def _hyper(self, group, device) -> dict:
        """The group's hyperparameters as its plans on `device` take them: a tensor value
        as a device value there (`_device_value`)."""
        values = self._values(group)
        on_device = None
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                on_device = on_device or self._checking_spec(group).device_scalars
                # others are CPU tensors (`_check_group`), read on the host as numbers
                values[name] = (self._device_value(value, device, name, group)
                                if name in on_device else float(value))
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
        if self.master_weights and group.get("stochastic_rounding", False):  # set after the init
            raise ValueError(f"param group {index}: "
                             + MASTER_STOCHASTIC.format(type(self).__name__))
        values = self._checked_values(group)
        spec = self._checking_spec(group)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"param group {index}: Tensor {name} must be 1-element")
                if value.device.type == "cpu":
                    values[name] = float(value)
                elif name not in spec.device_scalars:
                    option = self._OPTION_NAMES.get(name, name)
                    raise TypeError(f"param group {index}: {option} is a tensor on "
                                    f"{value.device}, but {type(self).__name__} reads only "
                                    f"{' and '.join(spec.device_scalars)} on the device: give "
                                    f"{option} as a number or a CPU tensor")
        try:
            spec.arguments(**values)
        except (TypeError, ValueError) as error:
            word, space, rest = str(error).partition(" ")
            raise type(error)(f"param group {index}: {self._OPTION_NAMES.get(word, word)}{space}"
                              f"{rest}") from None

    # the op's names of options a user gives otherwise (betas), for messages
    _OPTION_NAMES: dict = {}
    _checked_at = 0  # the group changes version whose options were last checked
    _numeric_lrs = False  # whether every group's lr was a number at the last whole check
    _copies = None  # TensorCopies, made at the first tensor hyperparameter that needs one
    _made = None  # during a step's binding: the params whose state it made

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


def _NO_MASTER(param) -> bool:
    return False


def laid_out_as(zeros, form):
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


def _count(step, counts: dict) -> float:
    """A step tensor's count, read once however many params share it (`counts`: by id)."""
    count = counts.get(id(step))
    if count is None:
        count = counts[id(step)] = float(step)
    return count


def _group_counts(counts: list, owners) -> list:
    """Each param's step count as the largest of its group's (`owners`: each param's group in
    a merged group; None: one group)."""
    owners = owners or [0] * len(counts)
    largest: dict = {}
    for owner, count in zip(owners, counts):
        largest[owner] = max(largest.get(owner, count), count)
    return [largest[owner] for owner in owners]


def _index_in(groups: list, p) -> str:
    """Where param p is in the groups, for messages: "3 (param group 1)"."""
    for g, group in enumerate(groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                return f"{i} (param group {g})"
    return "(not in any param group)"


def group_owners(merged) -> dict:
    """id(param) -> the index of its own group, in a merged group."""
    return {id(q): k for k, g in enumerate(merged["groups"]) for q in g["params"]}


def by_group(group, params) -> list:
    """(param group, its params among `params`) pairs: the merged group's own groups, else the
    group itself."""
    if "groups" not in group:
        return [(group, params)]
    owner = group_owners(group)
    by_owner: dict = {}
    for p in params:
        by_owner.setdefault(owner[id(p)], []).append(p)
    return [(group["groups"][k], members) for k, members in by_owner.items()]


def _differ(a, b) -> bool:
    """Whether two groups' options differ: tensors by their memory (no read), else by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.data_ptr() == b.data_ptr())
    return a != b
