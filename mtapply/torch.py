"""Drop-in `torch.optim` optimizers running mtapply's fused kernels: Adam, AdamW, SGD, LARS, LAMB,
Adamax, Adadelta, NAdam, RAdam, Adagrad, RMSprop, Adafactor, Lion, Adan,
ScheduleFreeAdamW, and any user-written rule (`optimizer(mtapply.rule(...), params, ...)`).

Constructor arguments, `defaults`, `param_groups` and the state layout are those of
`torch.optim.Adam` / `AdamW` / `SGD` (per param: a 0-d float32 `step`, `exp_avg`, `exp_avg_sq`,
`max_exp_avg_sq`; `momentum_buffer`), so checkpoints move between torch.optim and mtapply in both
directions. mtapply's own group options (`stochastic_rounding`, `seed`, `min_8bit_size`) are in
`defaults` and the groups only where set to other than their defaults (absent, a group takes
the default). Each param group is bound once to an mtapply plan (one launch per dtype group, two
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
number of params (see `mtapply._flat_grads` for what it checks). A frozen param (`requires_grad`
False) does not step, whatever its `.grad`, as torch.optim skips a grad of None; freezing or
unfreezing is seen at the next step, which binds the groups again. Until then the params have no
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

`master_weights=True` (Adam, AdamW, SGD, LARS, LAMB and every rule-run optimizer) steps each
float16 or bfloat16 param through an fp32 master in its state (`"master_param"`, made at the
param's first step from its values, saved and loaded with the rest): the plan takes the masters
as `master_params`, so the kernel updates the master and writes the param rounded from it in
the same pass, and the param's other state is float32 (unless `state_bits=16`). float32 and
float64 params make none and step as without it. A loaded state without masters makes them at
the next step from the params; an optimizer without the option drops loaded masters at the
next step. Refused: with 8-bit state (the 8-bit walk steps params in place), with stochastic
rounding, and with sparse grads of 16-bit params.

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

import operator
import weakref

import torch

from . import adam as _adam
from . import adam8bit as _adam8bit
from . import lamb as _lamb
from . import lars as _lars
from . import sgd as _sgd
from ._optimizer_step import bump_versions as _bump_versions
from ._torch_eight_bit import EightBitState
from ._torch_layouts import PlanLists, as_real, as_reals
from ._dtensor import check_scales, sharded_like, sharded_scales
from ._torch_binding import (Part, data_addresses, is_dtensor, local_tensor, local_tensors,
                             shard_groups)
from ._torch_checks import check_adam_args, check_one_element, check_torch_adam_flags
from ._torch_optimizer import BETA_NAMES, FusedOptimizer, by_group, group_owners, laid_out_as
from ._torch_adafactor import Adafactor
from ._torch_adaptive import DAdaptAdam, Prodigy
from ._torch_rules import (Adadelta, Adagrad, Adamax, Adan, AdEMAMix, Lion, NAdam, RAdam,
                           RMSprop, RuleOptimizer, ScheduleFreeAdamW, optimizer)
from ._torch_state import _NOT_DIFFERENTIABLE, MASTER, StateKeeping, own_options
from .ops.norms import L2NormSpec
from .plan import Plan
from .torch_galore import GaLoreAdamW
from .torch_muon import Muon

__all__ = ["LAMB", "LARS", "SGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "Adam8bit", "Adamax", "AdamW",
           "AdamW8bit", "Adan", "AdEMAMix", "DAdaptAdam",
           "GaLoreAdamW", "Lion", "Muon", "NAdam", "Prodigy", "RAdam", "RMSprop",
           "RuleOptimizer", "ScheduleFreeAdamW", "optimizer"]

_GRAD = operator.attrgetter("grad")
_DEREF = weakref.ref.__call__

# The rule-run optimizers are this module's, to users, reprs and pickles alike.
for _public in (Adadelta, Adafactor, Adagrad, Adamax, Adan, AdEMAMix, DAdaptAdam, Lion, NAdam, Prodigy,
                RAdam, RMSprop, RuleOptimizer, ScheduleFreeAdamW, optimizer):
    _public.__module__ = __name__


class BFloat16State:
    """`state_bits=16`: the state slots named in `_MOMENTS` (of real floating params) are kept
    in bfloat16; a step reads them as float32 and stores them rounded, and a checkpoint loads
    into that dtype. 32 (the default): the param's dtype, as torch.optim keeps them."""

    _MOMENTS: tuple = ()
    state_bits = 32

    def _take_state_bits(self, state_bits) -> None:
        if state_bits not in (16, 32) or isinstance(state_bits, bool):
            raise ValueError(f"{type(self).__name__} keeps its state in float32 or bfloat16: "
                             f"state_bits=32 or 16, got {state_bits!r}")
        self.state_bits = state_bits

    def __getstate__(self):  # a copy keeps its state's dtypes
        return dict(super().__getstate__(), state_bits=self.state_bits)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)  # (load_state_dict's state lacks it: it stays)
        self.__dict__.setdefault("state_bits", 32)

    def _state_dtype(self, group, name: str, param):
        if self.state_bits == 16 and param.is_floating_point() and name in self._MOMENTS:
            return torch.bfloat16
        return super()._state_dtype(group, name, param)

    def _moment(self, group, name: str, p):
        """A new state slot `name` of param `p`: zeros in its dtype and p's layout."""
        return torch.zeros_like(p, dtype=self._state_dtype(group, name, p),
                                memory_format=torch.preserve_format)


class Adam(BFloat16State, FusedOptimizer):
    """`torch.optim.Adam` (and, with decoupled_weight_decay=True, AdamW) on mtapply's fused
    kernel. Same arguments; `foreach`, `fused` and `capturable` are accepted for compatibility
    (the step is always fused and capturable), `differentiable=True` is refused. Turning amsgrad
    on starts `max_exp_avg_sq` at zero where torch.optim raises KeyError.
    `stochastic_rounding=True` stores bfloat16 params rounded stochastically (no master
    weights needed), the random bits keyed by `seed`, the step and the param's place."""

    def __new__(cls, *args, state_bits=32, **kwargs):
        """`state_bits=8` (bitsandbytes' optim_bits) makes the 8-bit class: Adam8bit, or
        AdamW8bit for AdamW, which take Adam's arguments too."""
        if state_bits == 8 and not issubclass(cls, Adam8bit):
            if cls not in (Adam, AdamW):  # a user's subclass keeps its own methods
                raise ValueError(f"{cls.__name__}(state_bits=8): a subclass of Adam or AdamW "
                                 f"keeps float moments; subclass mtapply.torch.Adam8bit or "
                                 f"AdamW8bit for 8-bit ones")
            eight = AdamW8bit if cls is AdamW else Adam8bit
            if not issubclass(eight, cls):  # (AdamW8bit is no AdamW): Python will not init it
                made = super().__new__(eight)
                made.__init__(*args, state_bits=8, **kwargs)
                return made
            cls = eight
        elif state_bits not in (8, 16, 32) or isinstance(state_bits, bool):
            raise ValueError(f"state_bits must be 8, 16 (bfloat16) or 32 (as bitsandbytes' "
                             f"optim_bits), got {state_bits!r}")
        return super().__new__(cls)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 flat_grads=False, stochastic_rounding=False, seed=0, state_bits=32,
                 master_weights=False):
        check_adam_args(lr, betas, eps, weight_decay)
        check_torch_adam_flags(lr, betas, foreach, fused, capturable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay,
                        **own_options(stochastic_rounding=stochastic_rounding, seed=seed))
        self.state_bits = state_bits  # 16: bfloat16 moments (real params), made at first steps
        super().__init__(params, defaults, flat_grads, master_weights)

    _merges_groups = True
    _OPTION_NAMES = BETA_NAMES
    _MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _compile_options(self, group) -> tuple:
        return (bool(group["amsgrad"]), bool(group.get("decoupled_weight_decay", False)),
                bool(group["maximize"]), bool(group.get("stochastic_rounding", False)))

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name in self._MOMENTS[:2]:
                state[name] = self._moment(group, name, p)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._moment(group, "max_exp_avg_sq", p)

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
                               master_params=lists.masters, amsgrad=amsgrad,
                               decoupled_weight_decay=decoupled, maximize=maximize,
                               stochastic_rounding=stochastic)

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
                 seed=0, state_bits=32, master_weights=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, flat_grads=flat_grads,
                         stochastic_rounding=stochastic_rounding, seed=seed,
                         state_bits=state_bits, master_weights=master_weights)

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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, decoupled_weight_decay=False,
                 min_8bit_size=_adam8bit.THRESHOLD, flat_grads=False, stochastic_rounding=False,
                 seed=0, state_bits=8, master_weights=False, **torch_flags):
        if master_weights:  # before the other checks: the option itself is what is refused
            raise ValueError(_8BIT_MASTERS.format(name=type(self).__name__))
        # Adam's flags, for Adam(..., state_bits=8): foreach, capturable, differentiable, fused
        unknown = sorted(set(torch_flags) - {"foreach", "capturable", "differentiable", "fused"})
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                            f"{unknown[0]!r}")
        if state_bits != 8:
            raise ValueError(f"{type(self).__name__} keeps 8-bit moments: for state_bits="
                             f"{state_bits!r} use mtapply.torch."
                             f"{type(self).__name__.replace('8bit', '')}")
        if amsgrad:
            raise ValueError("amsgrad=True with 8-bit moments is not supported: use "
                             "state_bits=32 for amsgrad")
        if torch_flags.get("differentiable"):
            raise ValueError(_NOT_DIFFERENTIABLE.format(type(self).__name__))
        check_torch_adam_flags(lr, betas, torch_flags.get("foreach"), torch_flags.get("fused"),
                               torch_flags.get("capturable", False))
        check_adam_args(lr, betas, eps, weight_decay)
        if min_8bit_size < 1:
            raise ValueError(f"Invalid min_8bit_size: {min_8bit_size} (at least 1)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                        **own_options(min_8bit_size=min_8bit_size,
                                      stochastic_rounding=stochastic_rounding, seed=seed))
        self.state_bits = 8
        FusedOptimizer.__init__(self, params, defaults, flat_grads)

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            form = as_real(p.detach())  # as the plan steps it: complex as real
            # a DTensor's shard (see mtapply._dtensor), in 8 bits where the whole param is
            shard = as_real(local_tensor(p).detach())
            eight_bit = form.numel() >= group.get("min_8bit_size", _adam8bit.THRESHOLD)
            made = _adam8bit.adam8bit_state([shard],
                                            threshold=0 if eight_bit else shard.numel() + 1)
            for name, column in zip(_8BIT_STATE, made.lists()):
                scales = name.endswith("_absmax")
                value = column[0] if scales else laid_out_as(column[0], shard)
                if is_dtensor(p):
                    value = sharded_scales(p, value, eight_bit) if scales else sharded_like(p, value)
                state[name] = value

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
            check_scales(param, scales, where(), name + "_absmax")
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

_8BIT_MASTERS = (
    "{name}(master_weights=True): 8-bit moments are stepped by the 8-bit kernel, which updates "
    "the params in place and takes no fp32 master_params; use mtapply.torch.Adam or AdamW "
    "(state_bits=16 or 32) with master_weights=True, or stochastic_rounding=True for bfloat16 "
    "params with 8-bit moments")


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay, default 1e-2) with 8-bit moments: see `Adam8bit`."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, min_8bit_size=_adam8bit.THRESHOLD,
                 flat_grads=False, stochastic_rounding=False, seed=0, state_bits=8,
                 master_weights=False, **torch_flags):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=True,
                         min_8bit_size=min_8bit_size, flat_grads=flat_grads,
                         stochastic_rounding=stochastic_rounding, seed=seed,
                         state_bits=state_bits, master_weights=master_weights, **torch_flags)

    def _compile_options(self, group) -> tuple:
        return (False, True, bool(group["maximize"]), bool(group.get("stochastic_rounding", False)))


class SGD(EightBitState, BFloat16State, FusedOptimizer):
    """`torch.optim.SGD` on mtapply's fused kernel, including its first-step momentum. Params
    with sparse grads take torch.optim's own per-tensor update (on the same stream; GradScaler
    is not taken there), the others the fused step; `differentiable=True` is refused.
    `stochastic_rounding=True` rounds bfloat16 params stochastically (see `Adam`); each param's
    state then also counts its steps (`step`), which key the random bits with `seed`.
    `state_bits=16` keeps the momentum buffers in bfloat16 (see `BFloat16State`);
    `state_bits=8` keeps them in 8 bits (`momentum_buffer` uint8 codes beside
    `momentum_buffer_absmax`, float32 for params under `min_8bit_size` elements; see
    `mtapply._torch_eight_bit`), stepped by `mtapply.rules.library.sgd` in 8 bits. As
    bitsandbytes' SGD8bit, 8-bit SGD needs momentum (without it SGD keeps no state), and it
    takes dense grads only."""

    _MOMENTS = ("momentum_buffer",)
    _EIGHT_BIT = ("momentum_buffer",)

    _counts_steps = False
    _merges_groups = True
    _sparse_grads = True
    _torch_flag_defaults = dict(StateKeeping._torch_flag_defaults, fused=False)  # torch.optim.SGD's

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None,
                 flat_grads=False, stochastic_rounding=False, seed=0, state_bits=32,
                 min_8bit_size=4096, master_weights=False):
        self._take_state_bits(state_bits, min_8bit_size)
        check_one_element(lr, "lr")
        if not (isinstance(lr, torch.Tensor) or lr >= 0.0):
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if state_bits == 8 and momentum == 0:
            raise ValueError(_SGD_8BIT_MOMENTUM.format(where="", momentum=momentum))
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused,
                        **own_options(stochastic_rounding=stochastic_rounding, seed=seed))
        super().__init__(params, defaults, flat_grads, master_weights)

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
        # as bound with momentum, every param has its buffer
        if group["momentum"] != 0 and self._as_bound(index, group) is None:
            fresh = [p for p in self._stepping(group["params"])
                     if self.state.get(p, {}).get("momentum_buffer") is None]
            if fresh:
                self._check_grads(fresh)  # (their first step launches after every check)
                stepped = set(map(id, fresh))
                group = dict(group, params=[p for p in group["params"] if id(p) not in stepped])
        return fresh, super()._prepare_group(index, group)

    def _launch_group(self, index, group, prepared, grad_scale, found_inf) -> None:
        # (fresh params, bound) from _prepare_group; a bound group alone on the flat_grads path
        fresh, bound = prepared if isinstance(prepared, tuple) else ((), prepared)
        for own, params in by_group(group, fresh) if fresh else ():  # each with its options
            self._first_step(own, params, grad_scale, found_inf)
        super()._launch_group(index, group, bound, grad_scale, found_inf)

    def _first_step(self, group, params, grad_scale, found_inf) -> None:
        """The first step of params without momentum buffers: torch's step=1 (the buffers set
        to the grad) over new state, one launch per device (params with fp32 masters apart);
        with state_bits=8 the library rule in 8 bits, the buffers stored as codes."""
        fresh = {p: self._first_state(group, p) for p in params}
        by_device: dict = {}
        for p in params:
            by_device.setdefault((p.device, MASTER in fresh[p]), []).append(p)
        for (device, master), members in by_device.items():
            part = Part(None, members, None, None)
            lists = PlanLists(fresh, members, [p.grad for p in members], local_tensor)
            options = dict(self._hyper(group, device), step=1,
                           stochastic_rounding=self._counts(group),
                           grad_scale=part.on_device(grad_scale), found_inf=part.on_device(found_inf))
            if lists.staging:
                lists.staging.before([p.grad for p in members])
            if self.state_bits == 8:
                rule = self._eight_bit_rule(group)
                rule.step(lists.bound, lists.grads, *map(lists.state, rule.slots[2:]), **options)
            else:
                _sgd.sgd_step(lists.bound, lists.grads, lists.state("momentum_buffer"), **options,
                              master_params=lists.state(MASTER) if master else None,
                              nesterov=group["nesterov"], maximize=group["maximize"])
            if lists.staging:
                lists.staging.after()
        _bump_versions(params)
        for p in params:
            self.state[p].update(fresh[p])
            if self._counts(group):
                self.state[p]["step"] = torch.tensor(1.0)  # the first step is taken

    def _first_state(self, group, p) -> dict:
        """A param's new momentum buffer (8-bit codes and scales with state_bits=8), and the
        fp32 master its state holds or one made from the param."""
        if self.state_bits == 8:
            codes, scales = self._eight_bit_slot(group, "momentum_buffer", p)
            return {"momentum_buffer": codes, "momentum_buffer_absmax": scales}
        entry = {"momentum_buffer": self._moment(group, "momentum_buffer", p)}
        if self.master_weights:
            self._keep_master(p, self.state[p])
            if MASTER in self.state[p]:
                entry[MASTER] = self.state[p][MASTER]
        return entry

    def _library_rule(self, group):
        from .rules import library

        return library.sgd(True, bool(group["nesterov"]), bool(group["maximize"]))

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)
        if self.state_bits == 8 and group["momentum"] == 0:
            raise ValueError(_SGD_8BIT_MOMENTUM.format(where=f"param group {index}: ",
                                                       momentum=group["momentum"]))

    def _split_sparse(self, index, group, grad_scale, found_inf) -> tuple:
        dense, sparse = super()._split_sparse(index, group, grad_scale, found_inf)
        # refused while the step is prepared: before any group has launched
        if sparse and self.state_bits == 8:
            raise RuntimeError("SGD(state_bits=8) does not take sparse grads (torch.optim's "
                               "sparse step keeps float buffers): give the params dense grads, "
                               "or use state_bits=32")
        if sparse and self._counts(group):
            raise RuntimeError("SGD(stochastic_rounding=True) does not take sparse grads: give "
                               "the params dense grads")
        if sparse and self.state_bits == 16:
            raise RuntimeError("SGD(state_bits=16) does not take sparse grads (torch.optim's "
                               "sparse step keeps its buffers in the param's dtype): give the "
                               "params dense grads, or use state_bits=32")
        return dense, sparse

    def _sparse_step(self, group, params) -> None:
        from torch.optim.sgd import sgd

        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum else []
        sgd(params, [p.grad for p in params], buffers, has_sparse_grad=True, foreach=False,
            weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        for p, buffer in zip(params, buffers):
            self.state[p]["momentum_buffer"] = buffer

    def _make_plan(self, group, lists):
        if self.state_bits == 8:  # (momentum is on: checked with the group)
            return self._eight_bit_plan(group, lists, self._counts(group))
        buffers = lists.state("momentum_buffer") if group["momentum"] else None
        return _sgd.sgd_plan(lists.bound, lists.grads, buffers, master_params=lists.masters,
                             nesterov=group["nesterov"], maximize=group["maximize"],
                             stochastic_rounding=self._counts(group))

    def _init_state(self, group, p, state) -> None:
        buffer = state.get("momentum_buffer")
        if group["momentum"] != 0 and buffer is None and self.state_bits == 8:
            state["momentum_buffer"], state["momentum_buffer_absmax"] = self._eight_bit_slot(
                group, "momentum_buffer", p)
        elif group["momentum"] != 0 and buffer is None:
            state["momentum_buffer"] = self._moment(group, "momentum_buffer", p)
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


_SGD_8BIT_MOMENTUM = (
    "{where}SGD with state_bits=8 keeps its momentum buffers in 8 bits, and momentum={momentum} "
    "keeps none (bitsandbytes' SGD8bit requires momentum too): give momentum > 0, or "
    "state_bits=32 for plain SGD")


class LARS(EightBitState, BFloat16State, FusedOptimizer):
    """LARS (You et al. 2017; see `mtapply.lars_step`) as a torch optimizer. A param group
    with `exclude=True` (biases, norm layers) takes plain momentum steps without adaptation or
    weight decay. State per param: `momentum_buffer` (bfloat16 with `state_bits=16`; with
    `state_bits=8` uint8 codes beside `momentum_buffer_absmax`, float32 for params under
    `min_8bit_size` elements, stepped by `mtapply.rules.library.lars` in 8 bits: its norms sum
    params and grads only, so the buffer takes the 8-bit walk)."""

    _counts_steps = False
    _merges_groups = True

    _MOMENTS = ("momentum_buffer",)
    _EIGHT_BIT = ("momentum_buffer",)

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001,
                 eps=0.0, exclude=False, *, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 master_weights=False):
        self._take_state_bits(state_bits, min_8bit_size)
        check_one_element(lr, "lr")
        for name, value in (("learning rate", lr), ("momentum", momentum),
                            ("weight_decay", weight_decay), ("trust_coefficient", trust_coefficient),
                            ("epsilon", eps)):
            if not isinstance(value, torch.Tensor) and not value >= 0.0:
                raise ValueError(f"Invalid {name} value: {value}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, exclude=exclude)
        super().__init__(params, defaults, flat_grads, master_weights)

    def _compile_options(self, group) -> tuple:
        if "groups" in group:  # merged: each tensor is excluded as its own group says
            return tuple(bool(g["exclude"]) for g in group["groups"])
        return (bool(group["exclude"]),)

    def _merge_options(self, group) -> tuple:
        return ()  # exclude is a per-tensor flag of the plan

    def _init_state(self, group, p, state) -> None:
        if "momentum_buffer" not in state and self.state_bits == 8:
            state["momentum_buffer"], state["momentum_buffer_absmax"] = self._eight_bit_slot(
                group, "momentum_buffer", p)
        elif "momentum_buffer" not in state:
            state["momentum_buffer"] = self._moment(group, "momentum_buffer", p)

    def _required_state(self, group, param) -> tuple:
        return ("momentum_buffer",)

    def _library_rule(self, group):
        from .rules import library

        return library.lars()

    def _hyper(self, group, device) -> dict:
        hyper = super()._hyper(group, device)
        if self.state_bits == 8:  # the rule's: an excluded tensor neither adapts nor decays
            kept = 0.0 if group["exclude"] else 1.0
            hyper.update(adapt=kept, decay_on=kept)
        return hyper

    def _make_plan(self, group, lists):
        if self.state_bits == 8:  # exclude by tensor: the values of adapt and decay_on
            return self._eight_bit_plan(group, lists, False)
        owner = group_owners(group) if "groups" in group else None
        exclude = [bool((group["groups"][owner[id(p)]] if owner else group)["exclude"])
                   for p in lists.params]
        return _lars.lars_plan(lists.bound, lists.grads, lists.state("momentum_buffer"),
                               exclude=exclude, master_params=lists.masters)

    def _values(self, group) -> dict:
        return dict(lr=group["lr"], momentum=group["momentum"],
                    weight_decay=group["weight_decay"],
                    trust_coefficient=group["trust_coefficient"], eps=group["eps"])

    def _checking_spec(self, group):
        return _lars.LARSSpec()


class LAMB(EightBitState, BFloat16State, FusedOptimizer):
    """LAMB with Apex FusedLAMB's arguments and semantics (see `mtapply.lamb_step`). With
    max_grad_norm > 0 the grads of every group are clipped by their global norm, computed on
    the device (one launch per device and dtype, with a plan bound once, like the step's).
    State per param: `step`, `exp_avg`, `exp_avg_sq` (the moments bfloat16 with `state_bits=16`;
    with `state_bits=8` uint8 codes beside `exp_avg_absmax` and `exp_avg_sq_absmax`, float32 for
    params under `min_8bit_size` elements, stepped by `mtapply.rules.library.lamb` in 8 bits:
    its first pass sums ||p|| and ||u|| over the moments as the update reads them)."""

    _OPTION_NAMES = BETA_NAMES
    _merges_groups = True

    _MOMENTS = ("exp_avg", "exp_avg_sq")
    _EIGHT_BIT = ("exp_avg", "exp_avg_sq")
    _UNSIGNED = ("exp_avg_sq",)

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0,
                 use_nvlamb=False, *, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 master_weights=False):
        self._take_state_bits(state_bits, min_8bit_size)
        check_adam_args(lr, betas, eps, weight_decay)
        if max_grad_norm < 0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, adam_w_mode=bool(adam_w_mode),
                        use_nvlamb=bool(use_nvlamb))
        super().__init__(params, defaults, flat_grads, master_weights)
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
        params = [p for g in self.param_groups for p in self._stepping(g["params"])]
        if params:
            self._grad_norm.compute(params, list(map(_GRAD, params)), grad_scale)

    def _compile_options(self, group) -> tuple:
        return (bool(group.get("adam_w_mode", True)), bool(group.get("use_nvlamb", False)))

    def _init_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name in self._MOMENTS:
                if self.state_bits == 8:
                    state[name], state[f"{name}_absmax"] = self._eight_bit_slot(group, name, p)
                else:
                    state[name] = self._moment(group, name, p)

    def _required_state(self, group, param) -> tuple:
        return ("step", "exp_avg", "exp_avg_sq")

    def _library_rule(self, group):
        from .rules import library

        return library.lamb(*self._compile_options(group))

    def _make_plan(self, group, lists):
        if self.state_bits == 8:
            return self._eight_bit_plan(group, lists, False)
        adam_w_mode, use_nvlamb = self._compile_options(group)
        return _lamb.lamb_plan(lists.bound, lists.grads, lists.state("exp_avg"),
                               lists.state("exp_avg_sq"), master_params=lists.masters,
                               adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb)

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
        if self.state_bits == 8:  # the rule's: numbers for its flags, no norm where none clips
            hyper.update(grad_averaging=float(hyper["grad_averaging"]),
                         bias_correction=float(hyper["bias_correction"]))
            if norm is None:
                del hyper["global_grad_norm"]
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
        if is_dtensor(grads[0]):  # the norm over every rank's shards
            import torch.distributed as dist

            squared = norm.square()
            for group in shard_groups(grads[0]):
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
        local = as_reals(local_tensors(grads))  # a complex grad: the norm of its complex values
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
            entry[2].rebind_addresses("tensors", local, data_addresses(local), keep_alive=False)
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
