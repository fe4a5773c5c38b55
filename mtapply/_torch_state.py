"""The state of mtapply's torch optimizers, kept, saved and loaded as torch.optim does.

A step's plans are bound to the state tensors they were given, so an optimizer must learn when
`optimizer.state` itself, a param's entry, or a tensor of an entry is replaced or deleted
(`optimizer.state[p] = {}` restarts p, as in torch.optim). `optimizer.state` is therefore a
`TrackedState` whose entries are `TrackedEntry` dicts: each such edit moves one counter (O(1)),
and a step that finds it moved binds its plans again. A dict put in as an entry is copied in
(edit it through `optimizer.state`); a state assigned whole (`optimizer.state = ...`) is taken
at the next step. Both pickle and deep-copy as torch's plain `defaultdict(dict)` of dicts.

`StateKeeping`, a base of mtapply's `torch.optim.Optimizer` subclasses, gives them:
- `state_dict()`: torch.optim's layout, with its pre- and post-hooks (the post-hooks see the
  saved form). Entries are copies of the live dicts, each param's `step` its own tensor as
  torch.optim keeps it: float32 on the param's device in fused groups, torch's scalar dtype
  (float64 under a float64 default dtype, else float32) on the param's device in capturable
  groups and on the CPU otherwise. List options are saved as lists; group keys beginning with
  "_" (a step's scratch values) are not saved.
- `load_state_dict()`: torch.optim's checks, hooks and casting (tensors to the param's device,
  floating ones to its dtype unless the optimizer keeps theirs, `step` as torch keeps it;
  strings are kept as they are). Group keys missing from an older state_dict take torch's
  defaults for torch's flags (maximize, foreach, ...) and the optimizer's defaults otherwise.
  Every param's entry is checked before anything changes: one that lacks a tensor the
  optimizer keeps raises KeyError naming it, as torch.optim would at the next step.
"""
from __future__ import annotations

import copy
import functools
import inspect
from collections import OrderedDict, defaultdict

import torch
from torch.optim.optimizer import required

from ._tracking import SetsThroughSetitem, notes_edits
from .adam8bit import THRESHOLD

# flags torch.optim added to its param groups over time, with the values its __setstate__ gives
# a group that lacks them
TORCH_FLAG_DEFAULTS = {"maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "fused": None, "amsgrad": False,
                       "nesterov": False, "centered": False}

# the state key of a 16-bit param's fp32 master (master_weights=True)
MASTER = "master_param"
_MASTER_DTYPES = (torch.float16, torch.bfloat16)

MASTER_STOCHASTIC = (
    "{}: master_weights=True with stochastic_rounding=True: the kernel rounds each 16-bit param "
    "to nearest from its fp32 master, which keeps the small updates that stochastic rounding "
    "would otherwise keep on average; use one of the two (stochastic_rounding needs no masters)")

MASTER_8BIT = (
    "{}: master_weights=True with state_bits=8: 8-bit state is stepped by the 8-bit walk, which "
    "updates the params in place and takes no fp32 master_params; use state_bits=16 or 32 with "
    "master_weights=True, or stochastic_rounding=True (bfloat16 params) with 8-bit state")

# mtapply's own group options, by their defaults: a group holds one only where it is set to
# another value, so that param groups (and checkpoints) hold torch.optim's keys alone and
# move between the two; code reads them with group.get(name, default)
OWN_OPTION_DEFAULTS = {"stochastic_rounding": False, "seed": 0, "min_8bit_size": THRESHOLD}


def own_options(**given) -> dict:
    """The mtapply-only group options of `given` that differ from their defaults."""
    return {name: value for name, value in given.items()
            if value != OWN_OPTION_DEFAULTS[name]}


class StateChanges:
    """A counter of edits of one optimizer's state."""

    __slots__ = ("version",)

    def __init__(self):
        self.version = 0

    def note(self) -> None:
        self.version += 1


class TrackedEntry(dict):
    """A param's state entry, noting every edit in its optimizer's `StateChanges`."""

    __slots__ = ("changes",)

    def __init__(self, entry, changes: StateChanges):
        super().__init__(entry)
        self.changes = changes

    def _changed(self) -> None:
        self.changes.note()

    def __reduce__(self):
        return dict, (dict(self),)


class TrackedState(SetsThroughSetitem, defaultdict):
    """`optimizer.state`: a `defaultdict(dict)` whose param entries are `TrackedEntry` dicts,
    noting every edit of itself or of an entry in `changes`."""

    __slots__ = ("changes",)

    def __init__(self, state=()):
        super().__init__(dict)
        self.changes = StateChanges()
        for key, value in dict(state).items():
            dict.__setitem__(self, key, self._entry(value))

    def _entry(self, value):
        if isinstance(value, dict) and not (isinstance(value, TrackedEntry)
                                            and value.changes is self.changes):
            return TrackedEntry(value, self.changes)
        return value  # non-dict values (a hook's "test": 1) are kept as they are

    def __missing__(self, key):
        entry = TrackedEntry((), self.changes)  # an empty entry binds nothing: no change
        dict.__setitem__(self, key, entry)
        return entry

    def __setitem__(self, key, value) -> None:
        self.changes.note()
        dict.__setitem__(self, key, self._entry(value))

    def _changed(self) -> None:
        self.changes.note()

    def copy(self) -> defaultdict:
        return defaultdict(dict, {k: dict(v) if isinstance(v, dict) else v
                                  for k, v in self.items()})

    __copy__ = copy

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter(self.copy().items())

    def __repr__(self) -> str:
        return f"defaultdict({dict!r}, {dict.__repr__(self)})"


notes_edits(TrackedEntry, dict, ("__setitem__", "__delitem__", "clear", "pop", "popitem",
                                "setdefault", "update", "__ior__"))
notes_edits(TrackedState, dict, ("__delitem__", "clear", "pop", "popitem"))


def check_state_bits(state_bits, min_8bit_size) -> None:
    """`state_bits` (8, 16 or 32, as bitsandbytes' optim_bits) and `min_8bit_size` (the fewest
    elements a param's state takes 8 bits at) as an optimizer is given them."""
    if state_bits not in (8, 16, 32) or isinstance(state_bits, bool):
        raise ValueError(f"state_bits must be 8, 16 (bfloat16) or 32 (as bitsandbytes' "
                         f"optim_bits), got {state_bits!r}")
    if not isinstance(min_8bit_size, int) or isinstance(min_8bit_size, bool) or min_8bit_size < 1:
        raise ValueError(f"Invalid min_8bit_size: {min_8bit_size!r} (a whole number >= 1)")


def refuse_other_state_bits(owner: str, eight_bit: tuple, entry, where) -> None:
    """A param's loaded state saved with other state_bits than the optimizer `owner` keeps is
    refused, naming the entry: 8-bit scales where it keeps float state, or float state of a
    slot it keeps in 8 bits (`eight_bit`)."""
    for name in entry:
        if name.endswith("_absmax") and name[:-len("_absmax")] not in eight_bit:
            raise ValueError(f"{where()} holds {name!r}, 8-bit state (saved with "
                             f"state_bits=8); {owner} here keeps float state: make it with "
                             f"state_bits=8 to load it")
    for name in eight_bit:
        if name in entry and f"{name}_absmax" not in entry:
            raise ValueError(f"{where()} holds {name!r} without {name + '_absmax'!r} (float "
                             f"state, saved with state_bits=32 or 16); {owner} here keeps it "
                             f"in 8 bits: make it with state_bits=32 to load it, or give the "
                             "param an empty state (optimizer.state[p] = {})")


def check_eight_bit_slots(param, eight_bit: tuple, entry, where) -> None:
    """Each 8-bit slot of a loaded entry: uint8 codes with one float32 scale per 256 elements,
    or float32 values without scales (a param under min_8bit_size); slots not there yet (made
    at the param's first step) are skipped."""
    from ._dtensor import check_scales

    for name in eight_bit:
        if name not in entry:
            continue
        codes, scales = entry[name], entry[f"{name}_absmax"]
        if not (isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor)):
            raise ValueError(f"{where()} holds {name!r} or {name + '_absmax'!r} as a "
                             f"{type(codes).__name__}, not a tensor")
        check_scales(param, scales, where(), f"{name}_absmax")
        expected = torch.uint8 if scales.numel() else torch.float32
        if codes.dtype != expected:
            raise ValueError(f"{where()} holds {name!r} as {codes.dtype} beside "
                             f"{scales.numel()} scales: 8-bit state is uint8 codes with one "
                             "float32 scale per 256 elements, or float32 without scales")


def scalar_dtype(fused=False) -> torch.dtype:
    """The dtype of torch.optim's `step` tensors (its `_get_scalar_dtype`)."""
    if not fused and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32


class StateKeeping:
    """State tracking, `state_dict` and `load_state_dict` of an mtapply torch optimizer (see
    the module docstring). Subclasses say which entries a param's state must hold
    (`_required_state`) and which loaded tensors keep their dtype (`_keeps_dtype`)."""

    _torch_flag_defaults = TORCH_FLAG_DEFAULTS  # those of the torch.optim counterpart

    # -- the live state --------------------------------------------------------------------------

    def _keep_state(self) -> None:
        """Tracks `self.state` from now on (after torch's __init__, __setstate__, or a state
        assigned whole); the next step binds again."""
        self.state = self._tracked_state = TrackedState(self.state)
        self._state_seen = -1

    def _state_moved(self) -> bool:
        """O(1): whether the state was replaced or edited since the latest step (`_state_kept`)."""
        tracked = self.__dict__.get("_tracked_state")
        if self.state is tracked and tracked.changes.version == self._state_seen:
            return False
        if self.state is not tracked:
            self._keep_state()
        return True

    def _state_kept(self) -> None:
        """After a step: its own edits of the state (new entries, counters) are seen."""
        self._state_seen = self._tracked_state.changes.version

    # -- checks ------------------------------------------------------------------------------------

    def _required_state(self, group, param) -> tuple:
        """The names a param's non-empty state must hold (an empty one is made afresh)."""
        return ()

    def _keeps_dtype(self, key, value) -> bool:
        """Whether a loaded state tensor keeps its dtype rather than take `_state_dtype`'s."""
        return False

    def _state_dtype(self, group, name: str, param):
        """The dtype of a param's floating state entry `name`: the param's, as torch.optim's;
        float32 for a param stepped through an fp32 master (`master_weights`), and for the
        master itself."""
        if name == MASTER or self._takes_master(param):
            return torch.float32
        return param.dtype

    # -- master weights ----------------------------------------------------------------------------

    master_weights = False  # whether 16-bit params step through fp32 masters (`MASTER` in state)

    def _takes_master(self, param) -> bool:
        """Whether `param` steps through an fp32 master: a float16 or bfloat16 param of an
        optimizer made with master_weights=True."""
        return self.master_weights and param.dtype in _MASTER_DTYPES

    def _keep_master(self, param, entry) -> None:
        """Makes the fp32 master of a param that takes one and whose entry has none (its first
        step, or a state loaded without masters): a float32 copy of the param's current
        values. An entry that holds a master its param does not take (loaded into an optimizer
        without master_weights, or of a float32 param) loses it, so that none goes stale."""
        if self._takes_master(param):
            if MASTER not in entry:
                entry[MASTER] = param.detach().to(torch.float32,
                                                  memory_format=torch.preserve_format)
        elif MASTER in entry:
            del entry[MASTER]

    def _check_master(self, param, entry, where) -> None:
        """A param's master, where its entry holds one: a floating tensor shaped as the param."""
        master = entry.get(MASTER)
        if master is None:
            return
        if (not isinstance(master, torch.Tensor) or not master.is_floating_point()
                or tuple(master.shape) != tuple(param.shape)):
            held = (f"{master.dtype} of shape {tuple(master.shape)}"
                    if isinstance(master, torch.Tensor) else type(master).__name__)
            raise ValueError(f"{where()} holds {MASTER!r} as {held}: a master is a float32 copy "
                             f"of its param, shaped {tuple(param.shape)}; give the param's entry "
                             f"none (del optimizer.state[p][{MASTER!r}]) to make it afresh from "
                             "the param")

    def _check_entry(self, group, param, entry, where) -> None:
        """Raises where a param's non-empty state lacks what the optimizer keeps, or holds a
        tensor of the wrong kind. `where()`: how to name the entry in a message."""
        self._check_master(param, entry, where)
        _check_step(entry.get("step"), where)
        names = self._required_state(group, param)
        for name in names:
            if name not in entry:
                raise KeyError(
                    f"{where()} has no {name!r}: {type(self).__name__} keeps "
                    f"{', '.join(map(repr, names))} per param. Load a state_dict saved by "
                    f"mtapply.torch's {type(self).__name__} with the same options (other "
                    f"libraries' states are laid out otherwise), or give the param an empty "
                    "state (optimizer.state[p] = {}) to start it afresh")
            value = entry[name]
            if (name != "step" and isinstance(value, torch.Tensor)
                    and not value.is_floating_point() and not self._keeps_dtype(name, value)):
                raise ValueError(f"{where()} holds {name!r} as {value.dtype}: "
                                 f"{type(self).__name__} keeps it in a floating dtype")

    def _refuse_flags(self, group) -> None:
        """Raises for a param group's option mtapply refuses (added or loaded)."""
        if group.get("differentiable"):
            raise ValueError(_NOT_DIFFERENTIABLE.format(type(self).__name__))
        if self.master_weights and group.get("stochastic_rounding", False):
            raise ValueError(MASTER_STOCHASTIC.format(type(self).__name__))

    def _fill_group(self, group) -> None:
        """Keys of an older state_dict's or pickle's group, as torch.optim's __setstate__ and
        the optimizer's defaults give them."""
        for key, default in self.defaults.items():
            if key not in group and (key != "differentiable" or _takes(type(self), key)):
                value = self._torch_flag_defaults.get(key, default)
                if value is required:
                    raise ValueError(f"the loaded param group lacks {key!r}, which "
                                     f"{type(self).__name__} requires (it has no default)")
                group[key] = value

    def _numbers_to_tensor_steps(self) -> None:
        """A number `step` (an older or edited state_dict) becomes a tensor, as torch.optim's."""
        for group in self.param_groups:
            fused, capturable = group.get("fused"), group.get("capturable")
            for p in group["params"]:
                entry = self.state.get(p)
                if isinstance(entry, dict) and "step" in entry and not torch.is_tensor(entry["step"]):
                    entry["step"] = torch.tensor(float(entry["step"]), dtype=scalar_dtype(fused),
                                                 device=p.device if fused or capturable else None)

    # -- state_dict --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # they see the saved form
        try:
            saved = torch.optim.Optimizer.state_dict(self)  # packing and pre-hooks: torch's
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        param_at, group_at = {}, {}
        for packed, group in zip(saved["param_groups"], self.param_groups):
            for index, p in zip(packed["params"], group["params"]):
                param_at.setdefault(index, p)
                group_at.setdefault(index, group)
        reads: dict = {}  # one host read per shared step counter
        saved["state"] = {k: self._saved_entry(v, param_at.get(k), group_at.get(k), reads)
                          if isinstance(v, dict) else v for k, v in saved["state"].items()}
        saved["param_groups"] = [{k: list(v) if isinstance(v, list) else v
                                  for k, v in packed.items() if not str(k).startswith("_")}
                                 for packed in saved["param_groups"]]
        for hook in post_hooks.values():
            result = hook(self, saved)
            if result is not None:
                saved = result
        return saved

    @staticmethod
    def _saved_entry(entry, param, group, reads: dict) -> dict:
        saved = dict(entry)
        step = saved.get("step")
        if param is None or not isinstance(step, torch.Tensor):
            return saved
        fused, capturable = group.get("fused"), group.get("capturable")
        if fused or capturable:  # on the device, as torch.optim keeps it there
            saved["step"] = step.to(device=param.device, dtype=scalar_dtype(fused), copy=True)
        else:
            if id(step) not in reads:
                reads[id(step)] = step.item()
            saved["step"] = torch.tensor(reads[id(step)], dtype=scalar_dtype())
        return saved

    # -- load_state_dict ---------------------------------------------------------------------------

    @torch._disable_dynamo
    def load_state_dict(self, state_dict) -> None:
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        owner = {}  # saved param id -> (param, its group as loaded)
        for ids, group, loaded in zip([s["params"] for s in saved_groups], groups, saved_groups):
            loaded["params"] = group["params"]
            if "param_names" in group and "param_names" not in loaded:
                loaded["param_names"] = group["param_names"]
            self._fill_group(loaded)
            self._refuse_flags(loaded)
            owner.update((k, (p, loaded)) for k, p in zip(ids, group["params"]))
        state = defaultdict(dict)
        for k, value in state_dict["state"].items():
            if k not in owner:
                state[k] = value  # kept as it is, as torch.optim keeps it
                continue
            p, group = owner[k]
            if isinstance(value, dict) and value:
                self._check_entry(group, p, value, lambda k=k: f"the loaded state of param {k}")
            state[p] = self._loaded(p, value, group)
        self.__setstate__({"state": state, "param_groups": saved_groups})
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _loaded(self, param, value, group, key=None):
        """A loaded state value as torch.optim casts it, strings and kept dtypes aside."""
        if isinstance(value, torch.Tensor):
            if key == "step":
                if group.get("fused") or group.get("capturable"):
                    return value.to(dtype=torch.float32, device=param.device)
                return value
            if param.is_floating_point() and not self._keeps_dtype(key, value):
                return value.to(dtype=self._state_dtype(group, key, param), device=param.device)
            return value.to(device=param.device)
        if isinstance(value, dict):
            return {k: self._loaded(param, v, group, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._loaded(param, v, group) for v in value)
        return value


def _check_step(step, where) -> None:
    """A step count held on the host (a number, or a CPU tensor: read without a sync) is a
    whole number >= 0; one on a GPU is checked by the kernels, which then write nothing."""
    if isinstance(step, torch.Tensor):
        if step.device.type != "cpu" or step.numel() != 1 or step.is_complex():
            return
        step = step.item()
    if isinstance(step, (int, float)) and not (step >= 0 and float(step).is_integer()):
        raise ValueError(f"{where()} holds 'step' {step!r}: a step count is a whole number >= 0; "
                         f"load a state saved by the optimizer, or give the param an empty state "
                         f"(optimizer.state[p] = {{}}) to start it afresh")


@functools.cache
def _takes(cls, argument: str) -> bool:
    """Whether the constructor of `cls` takes `argument` (torch.optim's __setstate__ puts
    "differentiable" in every optimizer's defaults, whether it takes it or not)."""
    return argument in inspect.signature(cls.__init__).parameters


_NOT_DIFFERENTIABLE = ("differentiable=True: {}'s fused step is not differentiable (autograd "
                       "cannot see through its kernels); use the torch.optim optimizer with "
                       "differentiable=True for that")
