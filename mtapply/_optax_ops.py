"""How each mtapply op steps as an optax transformation: which slots it keeps, which of
optax's hyperparameters it reads, and how, per leaf class and per step."""
from __future__ import annotations

import ast
import functools
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _optax_rules
from ._optax_state import STATES, AdamState, LambState, LarsState, SgdState, initial_slot
from .lamb import LAMBSpec
from .lars import LARSSpec
from .ops import AdamSpec
from .ops._spec import DeviceScalar, check_number
from .rules import library
from .sgd import SGDSpec


# ---------------------------------------------------------------------------------------------
# Rules: how each mtapply op is bound and stepped.


# float32 rounding leaves a schedule that decays to 0 a few ulps below it at its end
# (optax.linear_schedule(1e-2, 0.0, 10) gives -1.5e-10 at step 10): such values step as 0
ROUNDED_BELOW_ZERO = 1e-6


def zero_if_rounded_below(value):
    """A traced hyperparameter `value` as 0 where it lies below 0 by at most
    ROUNDED_BELOW_ZERO; further below, it stays, to be refused as an lr is."""
    value = jnp.asarray(value)
    return jnp.where((value < 0) & (value >= -ROUNDED_BELOW_ZERO), jnp.zeros_like(value), value)


class OptaxRule:
    """One mtapply op as the adapter drives it. `slots` are the state fields that hold one
    buffer per param; `plan_slots` names the op's slots for params, those fields and grads;
    `statics(params, treedef)` gives the per-tree static choices the op needs (hashable), and
    `spec(statics)` the op itself.

    Hyperparameters given as numbers are fixed when the step is traced (`hyper`); those given
    as arrays (`dynamic`: traced by optax.inject_hyperparams, or concrete) become one-element
    operands of each call, read by the kernel from device memory, as the learning rate is. The
    built-in ops read only lr and the step there, so an op with dynamic hyperparameters runs
    as its rule (`mtapply._optax_rules`)."""

    name = ""
    state_type: type = AdamState
    slots: tuple = ()
    plan_slots: tuple = ()
    reads_params = True  # False: the update ignores the params' values
    global_norm = False  # the step takes the gradients' global L2 norm
    initial: dict = {}  # state field -> its initial value where not 0 ("params": a copy)
    scalar_fields: tuple = ()  # state fields after the slots: per-step scalars (see per_step)
    carried: tuple = ()  # state fields last: the rule's scalar state, which its step updates
    read_state: frozenset = frozenset()  # op slots of state fields the step only reads
    hyper: dict = {}  # op argument -> number
    dynamic: dict = {}  # op argument -> array: a scalar operand of every call
    slot_dtypes: dict = {}  # state field -> the dtype of its buffers, where not the params'
    tree_state = False  # True: the state stays a tree like params (flat_state does not apply)
    lr_count = 1  # the learning rates a step takes (one per label: `LabeledAdamRule`)

    def scalar_init(self, dtype) -> list:
        """The initial values of `scalar_fields`; a rule's scalar state of `dtype` (see
        `RuleOp.scalar_init`)."""
        return []

    def init_slot(self, field: str, params, layout):
        """State field `field` before the first step: a tree like params, or the flat buffers
        of `layout` (see `mtapply._optax_state.initial_slot`)."""
        return initial_slot(self.initial.get(field, 0.0), params, layout,
                            self.slot_dtypes.get(field))

    def per_step(self, learning_rate, count, state) -> tuple:
        """(extra step arguments after lr, step and the norm, new values of `scalar_fields`):
        for rules whose step takes scalars computed from earlier steps."""
        return [], []

    def statics(self, params, treedef) -> tuple:
        return ()

    def leaf_classes(self, statics):
        """None, or a class per leaf: the leaves of one class are stepped by calls of their own
        (whose `class_args` differ), for choices a rule cannot read per tensor."""
        return None

    def class_args(self, statics) -> dict:
        """Step arguments of a call whose leaves (one class) have `statics`."""
        return {}

    def spec(self, statics):
        raise NotImplementedError

    def fixed_args(self, statics, lr, step, *more) -> dict:
        """The op's step arguments from lr, step and the call's other per-step scalars (the
        global norm or `per_step`'s), with the numbers of `hyper`."""
        raise NotImplementedError

    def step_args(self, statics, lr, step, *more) -> dict:
        """The step arguments of a call whose scalars are lr, step, `more` (the per-step ones,
        then one per dynamic hyperparameter): numbers on the host, DeviceScalars on GPUs."""
        k = len(more) - len(self.dynamic)
        args = self.fixed_args(statics, lr, step, *more[:k])
        args.update(zip(self.dynamic, more[k:]))
        args.update(self.class_args(statics))
        return args

    def host_args(self, values: list, statics) -> dict:
        """`step_args` of the scalars read on the host (each a 1-D float64 array) for a call
        whose leaves have `statics`."""
        return self.step_args(statics, *(float(v[0]) for v in values))

    def _take_hyper(self, hyper: dict) -> None:
        self.hyper, self.dynamic = _split_hyper(self.name, hyper)


def _split_hyper(name: str, hyper: dict) -> tuple:
    """(numbers, arrays) of `hyper`: the arrays (one element each) become device values."""
    numbers, arrays = {}, {}
    for key, value in hyper.items():
        if not is_array(value):
            numbers[key] = value
            continue
        if value.size != 1:
            raise TypeError(f"mtapply.optax.{name}: {_OPTAX_NAMES.get(key, key)} must be a number "
                            f"or a one-element array, got shape {value.shape}")
        arrays[key] = value
    return numbers, arrays


def is_array(value) -> bool:
    """An array (traced or not) rather than a number: a value the kernel reads from memory."""
    return isinstance(value, (jax.Array, np.ndarray))


def is_number(value) -> bool:
    return not is_array(value)


_OPTAX_NAMES = {"beta1": "b1", "beta2": "b2", "beta3": "b3"}  # op argument -> optax's argument


class AdamRule(OptaxRule):
    """adam and adamw: the built-in AdamW op, or optax's Adam written as a rule where a
    hyperparameter is an array, eps_root is not 0 or nesterov is on. `mask` (optax.adamw's)
    puts weight decay only on the leaves where it is True: a flag per tensor of the built-in op,
    a call of its own for the leaves without weight decay in the rule."""

    name, state_type, slots = "adam", AdamState, ("mu", "nu")
    plan_slots = ("params", "exp_avgs", "exp_avg_sqs", "grads")

    def __init__(self, b1, b2, eps, weight_decay, mask=None, *, eps_root=0.0, nesterov=False,
                 mu_dtype=None, name="adam"):
        self.name = name
        self._take_hyper(dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                              eps_root=eps_root))
        numbers = {k: v for k, v in self.hyper.items() if k != "eps_root"}
        _check(AdamSpec().arguments, lr=0.0, step=1, **numbers)
        if "eps_root" in self.hyper:
            self.hyper["eps_root"] = check_number("eps_root", self.hyper["eps_root"], low=0.0)
        self.nesterov = bool(nesterov)
        self.as_rule = bool(self.dynamic) or self.nesterov or self.hyper.get("eps_root", 0.0) != 0
        if not self.as_rule:
            del self.hyper["eps_root"]  # the built-in op has none
        self.decays = "weight_decay" in self.dynamic or self.hyper["weight_decay"] != 0
        self.reads_params = self.decays
        self.mask = mask  # optax.adamw's: weight decay on the leaves where it is True
        self.slot_dtypes = {"mu": mu_dtype} if mu_dtype is not None else {}

    def statics(self, params, treedef) -> tuple:
        """The weight-decay flag of each leaf, where a mask leaves some out."""
        if self.mask is None or not self.decays:
            return ()
        decays = _mask_leaves(self.mask, params, treedef, "mask")
        return () if all(decays) else decays

    def leaf_classes(self, statics):
        return statics if self.as_rule and statics else None

    def class_args(self, statics) -> dict:
        return {"weight_decay": 0.0} if self.as_rule and statics and not statics[0] else {}

    def spec(self, statics):
        if self.as_rule:
            return _optax_rules.adam(self.nesterov).spec()
        return AdamSpec(decoupled_weight_decay=True, decay_mask=statics or None)

    def fixed_args(self, statics, lr, step, *more) -> dict:
        return dict(lr=lr, step=step, **self.hyper)


class LabeledAdamRule(AdamRule):
    """adam/adamw rules, one per label of a tree's leaves (`multi_transform`), as one op: each
    leaf reads its label's lr from one array of them per step (by label, in the kernel) and
    its label's weight decay as a factor per tensor; beta1, beta2 and eps are the labels'
    common values."""

    def __init__(self, rules: dict, param_labels):
        first = next(iter(rules.values()))
        decays = any(rule.hyper["weight_decay"] != 0 for rule in rules.values())
        super().__init__(first.hyper["beta1"], first.hyper["beta2"], first.hyper["eps"],
                         1.0 if decays else 0.0)
        self.rules, self.param_labels = rules, param_labels
        self.lr_count = len(rules)

    def statics(self, params, treedef) -> tuple:
        """(label index, weight-decay factor) of each leaf."""
        names = list(self.rules)
        labels = _label_leaves(self.param_labels, params, treedef, names)
        factors = {name: rule.hyper["weight_decay"] * np.asarray(
            _mask_leaves(rule.mask, params, treedef, "mask") if rule.mask is not None
            else (True,) * treedef.num_leaves, np.float64) for name, rule in self.rules.items()}
        return tuple((label, float(factors[names[label]][i])) for i, label in enumerate(labels))

    def leaf_classes(self, statics):
        return None

    def spec(self, statics):
        labels, factors = zip(*statics) if statics else ((), ())
        return AdamSpec(decoupled_weight_decay=True, lr_labels=labels,
                        decay_mask=factors if self.reads_params else None)

    def host_args(self, values: list, statics) -> dict:
        lrs = values[0]  # one per label; each tensor takes its label's
        return self.step_args(statics, tuple(float(lrs[label]) for label, _ in statics),
                              *(float(v[0]) for v in values[1:]))


def _label_leaves(param_labels, params, treedef, names: list) -> list:
    """The index in `names` of each leaf's label; `param_labels` is a pytree of labels like
    params (or a prefix of it), or a callable of params giving one."""
    labels = param_labels(params) if callable(param_labels) else param_labels
    try:
        leaves = treedef.flatten_up_to(
            jax.tree.map(lambda label, sub: jax.tree.map(lambda _: label, sub), labels, params))
    except (ValueError, TypeError) as error:
        raise ValueError(f"param_labels must be a pytree of labels like params (or a prefix "
                         f"of it), or a callable of params giving one: {error}") from None
    index = {name: k for k, name in enumerate(names)}
    for i, label in enumerate(leaves):
        if label not in index:
            raise ValueError(f"param_labels gives leaf {i} the label {label!r}, which transforms "
                             f"has no transformation for: labels are {', '.join(map(repr, names))}")
    return [index[label] for label in leaves]


class SgdRule(OptaxRule):
    """sgd: the built-in SGD op, or optax's trace written as a rule when momentum is an array
    (then the trace is kept, as optax keeps it for any momentum given)."""

    name, state_type, reads_params = "sgd", SgdState, False

    def __init__(self, momentum, nesterov, accumulator_dtype=None):
        self._take_hyper(dict(momentum=0.0 if momentum is None else momentum))
        self.as_rule = bool(self.dynamic)
        moving = self.as_rule or self.hyper["momentum"] != 0
        self.nesterov = bool(nesterov) and moving
        self.slots = ("trace",) if moving else ()
        self.plan_slots = ("params",) + (("momentum_buffers",) if self.slots else ()) + ("grads",)
        if not self.as_rule:
            _check(SGDSpec(nesterov=self.nesterov).arguments, lr=0.0, step=1, **self.hyper)
        self.slot_dtypes = {"trace": accumulator_dtype} if accumulator_dtype is not None else {}

    def spec(self, statics):
        if self.as_rule:
            return _optax_rules.sgd(self.nesterov).spec()
        return SGDSpec(momentum_buffers=bool(self.slots), nesterov=self.nesterov)

    def fixed_args(self, statics, lr, step, *more) -> dict:
        return dict(lr=lr, step=step, **self.hyper)


class LarsRule(OptaxRule):
    """lars: the built-in LARS op (a tensor excluded by the masks takes a plain momentum step),
    or the same written as a rule when a hyperparameter is an array (excluded leaves then
    stepped by calls of their own)."""

    name, state_type, slots = "lars", LarsState, ("momentum",)
    plan_slots = ("params", "momentum_buffers", "grads")

    def __init__(self, weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask):
        self._take_hyper(dict(momentum=momentum, weight_decay=weight_decay,
                              trust_coefficient=trust_coefficient, eps=eps))
        _check(LARSSpec().arguments, lr=0.0, **self.hyper)
        self.as_rule = bool(self.dynamic)
        self.trust_ratio_mask, self.weight_decay_mask = trust_ratio_mask, weight_decay_mask

    def statics(self, params, treedef) -> tuple:
        """(trust ratio on, weight decay on) of each leaf. The built-in op excludes a tensor
        from both at once, so there the masks must agree wherever weight decay is on."""
        adapt = _mask_leaves(self.trust_ratio_mask, params, treedef, "trust_ratio_mask")
        decay = _mask_leaves(self.weight_decay_mask, params, treedef, "weight_decay_mask")
        if not self.as_rule and self.hyper["weight_decay"] != 0 and adapt != decay:
            raise ValueError("mtapply.optax.lars excludes a tensor from both the trust ratio and "
                             "weight decay: pass the same weight_decay_mask and trust_ratio_mask")
        return tuple(zip(adapt, decay))

    def leaf_classes(self, statics):
        return statics if self.as_rule and not all(a and d for a, d in statics) else None

    def class_args(self, statics) -> dict:
        if not (self.as_rule and statics):
            return {}
        adapt, decay = statics[0]
        return {"adapt": float(adapt), "decay_on": float(decay)}

    def spec(self, statics):
        if self.as_rule:
            return _optax_rules.lars().spec()
        exclude = [not adapt for adapt, _ in statics]
        return LARSSpec(exclude=exclude if any(exclude) else None)

    def fixed_args(self, statics, lr, step, *more) -> dict:
        return dict(lr=lr, **self.hyper)  # LARS takes no step


class LambRule(OptaxRule):
    """lamb: the built-in LAMB op, or the same written as a rule where a hyperparameter is an
    array, eps_root is not 0 or a weight-decay mask is given (optax.lamb's; masked leaves
    stepped by calls of their own)."""

    name, state_type, slots = "lamb", LambState, ("mu", "nu")
    plan_slots = ("params", "exp_avgs", "exp_avg_sqs", "grads")

    def __init__(self, b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                 grad_averaging, bias_correction, max_grad_norm):
        self._take_hyper(dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                              max_grad_norm=max_grad_norm, eps_root=eps_root))
        self.flags = dict(adam_w_mode=bool(adam_w_mode), use_nvlamb=bool(use_nvlamb))
        self.switches = dict(grad_averaging=bool(grad_averaging),
                             bias_correction=bool(bias_correction))
        numbers = {k: v for k, v in self.hyper.items() if k != "eps_root"}
        _check(LAMBSpec(**self.flags).arguments, lr=0.0, step=1, global_grad_norm=0.0,
               **numbers)
        if "eps_root" in self.hyper:
            self.hyper["eps_root"] = check_number("eps_root", self.hyper["eps_root"], low=0.0)
        self.mask = mask
        self.as_rule = (bool(self.dynamic) or mask is not None
                        or self.hyper.get("eps_root", 0.0) != 0)
        if not self.as_rule:
            del self.hyper["eps_root"]
        self.global_norm = "max_grad_norm" in self.dynamic or self.hyper["max_grad_norm"] > 0

    def statics(self, params, treedef) -> tuple:
        """The weight-decay flag of each leaf, where a mask leaves some out."""
        if self.mask is None:
            return ()
        decays = _mask_leaves(self.mask, params, treedef, "mask")
        return () if all(decays) else decays

    def leaf_classes(self, statics):
        return statics if statics else None

    def class_args(self, statics) -> dict:
        return {"weight_decay": 0.0} if statics and not statics[0] else {}

    def spec(self, statics):
        if self.as_rule:
            return _optax_rules.lamb(self.flags["adam_w_mode"], self.flags["use_nvlamb"]).spec()
        return LAMBSpec(**self.flags)

    def fixed_args(self, statics, lr, step, norm=None, *more) -> dict:
        args = dict(lr=lr, step=step, **self.hyper)
        if not self.as_rule:
            return dict(args, global_grad_norm=norm, **self.switches)
        args.update((name, 1.0 if on else 0.0) for name, on in self.switches.items())
        return args if norm is None else dict(args, global_grad_norm=norm)


class UserRule(OptaxRule):
    """A user-written rule (`mtapply.rule`): its slots other than param and grad are the
    state, zero at first; learning_rate drives its `lr` (a rule without one, as a chain without
    scale_by_learning_rate, takes none), the other hyperparameters are numbers or arrays
    (device values) given here, or, for a chain's scheduled ones (`schedules`), the schedule's
    value at the step count, computed at each update and passed as a per-step scalar."""

    optax_names = _OPTAX_NAMES  # a hyperparameter's name in optax's function of this `name`

    def in_optax_words(self, error: Exception) -> Exception:
        """A refusal of the rule's op as optax's function (its name and its arguments' names)
        says it; a user's rule keeps the error as it is."""
        if self.optax_function is None:
            return error
        word, space, rest = str(error).partition(" ")
        word = {"lr": "learning_rate", **self.optax_names}.get(word, word)
        return type(error)(f"mtapply.optax.{self.optax_function}: {word}{space}{rest}")

    def __init__(self, rule, hyper: dict, initial: dict | None = None, name: str | None = None,
                 scalars: dict | None = None):
        self.user, self.name = rule, name or rule.name
        self.optax_function = name  # None: a user's rule, which keeps its own names
        self.initial = {slot: "params" if value == "param" else value  # as declared, or given
                        for slot, value in rule.initial.items() if value != 0.0}
        self.initial.update(initial or {})
        # the rule's scalar state: fields of the state, passed to each step and taken back
        self.carried = tuple(rule.scalars)
        self.scalar_values = {**rule.scalars, **(scalars or {})}  # before step 1
        self.has_lr = "lr" in rule.hyper
        unknown = sorted(set(hyper) - set(rule.hyper) - {"lr"})
        if unknown:
            raise TypeError(f"rule {rule.name!r} has no hyperparameter {unknown[0]!r} (it takes "
                            f"{', '.join(rule.hyper)})")
        self.schedules = dict(_chained(rule, "schedules"))  # a chain's scheduled hyperparameters
        given = sorted(set(hyper) & set(self.schedules))
        if given:
            raise TypeError(f"rule {rule.name!r}: {given[0]} is scheduled (a link's schedule "
                            f"gives it at each step): it takes no value")
        self._take_hyper({name: hyper.get(name, default) for name, default in rule.hyper.items()
                          if name != "lr" and name not in self.schedules})
        missing = [name for name, value in self.hyper.items() if value is None]
        if missing:
            raise TypeError(f"rule {rule.name!r} needs {missing[0]}=... (a number or an array)")
        # the numbers checked now; arrays and schedules (read on the device) stand in as
        # device values
        try:
            rule.spec().arguments(**({"lr": 0.0} if self.has_lr else {}), step=1.0, **self.hyper,
                                  **dict.fromkeys((*self.dynamic, *self.schedules),
                                                  DeviceScalar(ptr=0, obj=None)),
                                  **({"scalars_out": DeviceScalar(ptr=0, obj=None)}
                                     if self.carried else {}))
        except (TypeError, ValueError) as error:
            raise self.in_optax_words(error) from None
        self.slots = tuple(name for name in rule.slots if name not in ("param", "grad"))
        op_slots = dict(zip(rule.slots, rule.spec().slots))  # the op's name of each slot
        self.plan_slots = ("params", *(op_slots[name] for name in self.slots), "grads")
        # read-only slots (Prodigy's p0, a copy of the params at first) are state the step
        # reads and passes on as it is
        self.read_state = frozenset(op_slots[s.name] for s in rule.program.slots[1:]
                                    if not s.written and s.name != "grad")
        self.reads_params = _reads_params(rule.program)
        self.state_type = _rule_state_type(rule.name, self.slots, self.carried)
        self.masks = dict(_chained(rule, "masks"))  # a chain's links' (optax's masks)
        self.whole_list = bool(rule.program.totals)  # sums over every leaf: one call
        self.norm_hyper = None  # the hyperparameter the grads' global norm goes to, if any

    def scalar_init(self, dtype) -> list:
        """The rule's scalar state before step 1, of `dtype` as the step keeps it: float64
        where every param is float64, else float32 (`RuleSpec.sum_dtype`)."""
        return [jnp.asarray(self.scalar_values[name], dtype) for name in self.carried]

    def statics(self, params, treedef) -> tuple:
        """Each leaf's flags of the masks (one per masked hyperparameter), where a mask
        leaves some leaf out."""
        if not self.masks:
            return ()
        flags = list(zip(*(_mask_leaves(mask, params, treedef, f"the mask of {name!r}")
                           for name, mask in self.masks.items())))
        if all(all(leaf) for leaf in flags):
            return ()
        if self.whole_list and len(set(flags)) > 1:
            raise ValueError(
                f"mtapply.optax.{self.name}: the masks ({', '.join(self.masks)}) split the "
                f"leaves into calls of their own, but the rule sums over every leaf "
                f"(clip_by_global_norm's norm) in one call: mask a chain without whole-list "
                f"sums, or put the masked link in a transformation of its own in optax.chain")
        return tuple(flags)

    def leaf_classes(self, statics):
        return statics if statics else None

    def class_args(self, statics) -> dict:
        """0 for each masked hyperparameter the call's leaves (one class) are masked out of."""
        if not statics:
            return {}
        return {name: 0.0 for name, on in zip(self.masks, statics[0]) if not on}

    def spec(self, statics):
        return self.user.spec()

    def per_step(self, learning_rate, count, state) -> tuple:
        """Each scheduled hyperparameter's value at the count of steps taken (optax's)."""
        return [zero_if_rounded_below(schedule(count)) for schedule in self.schedules.values()], []

    def take_global_norm(self, hyper: str) -> None:
        """Pass the grads' global L2 norm, taken at each step, as the hyperparameter `hyper`
        (LAMB's global_grad_norm, which its max_grad_norm clips by)."""
        self.norm_hyper, self.global_norm = hyper, True

    def fixed_args(self, statics, lr, step, *more) -> dict:
        norm = None
        if self.norm_hyper is not None:
            norm, *more = more
        args = dict(step=step, **self.hyper, **dict(zip(self.schedules, more)))
        if self.has_lr:
            args["lr"] = lr
        if norm is not None:
            args[self.norm_hyper] = norm
        return args


class ScheduleFreeRule(UserRule):
    """Schedule-free AdamW's rule with optax.contrib's per-step scalars: the running maximum
    of the schedule's lr and the running sum of its weights (max_lr ** weight_lr_power), whose
    share this step is `ck`. The schedule is read at the step count (from 1) for the weights,
    and at the steps taken for the base step's lr, as optax does."""

    scalar_fields = ("weight_sum", "max_lr", "b1")

    def __init__(self, b1, b2, eps, weight_decay, weight_lr_power, state_dtype=None):
        rule = library.schedule_free_adamw()
        if is_number(b1) and not 0.0 < check_number("b1", b1) < 1.0:
            raise ValueError(f"b1 must be in (0, 1) for schedule-free AdamW, got {b1}")
        self.weight_lr_power = (check_number("weight_lr_power", weight_lr_power)
                                if is_number(weight_lr_power) else weight_lr_power)
        self.b1 = b1
        super().__init__(rule, dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, ck=0.0),
                         name="schedule_free_adamw")  # z starts as the params (the rule's)
        del self.hyper["ck"]  # a step argument, computed per step
        self.state_type = _rule_state_type(rule.name, self.slots, self.scalar_fields)
        self.slot_dtypes = {"z": state_dtype} if state_dtype is not None else {}

    def scalar_init(self, dtype) -> list:  # (its own, kept in float32)
        return [jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32),
                jnp.asarray(self.b1, jnp.float32)]

    def per_step(self, learning_rate, count, state) -> tuple:
        lr = learning_rate(count + 1) if callable(learning_rate) else learning_rate
        max_lr = jnp.maximum(state.max_lr, jnp.asarray(lr, jnp.float32))
        weight = max_lr ** self.weight_lr_power
        total = state.weight_sum + weight
        ck = jnp.where(jnp.isnan(weight) | jnp.isnan(total), jnp.nan,
                       jnp.nan_to_num(weight / total, nan=0.0, posinf=jnp.inf))
        return [ck], [total, max_lr, state.b1]

    def fixed_args(self, statics, lr, step, ck=None, *more) -> dict:
        return dict(lr=lr, step=step, ck=ck, **self.hyper)


class DAdaptRule(UserRule):
    """Prodigy's and D-Adaptation's rules (made with `given_correction`) with optax.contrib's
    bias correction: sqrt(1 - b2**t) / (1 - b1**t) computed at each step as optax computes it
    (in the default float dtype: float32 unless jax_enable_x64), a per-step scalar."""

    optax_names = {"beta1": "betas[0]", "beta2": "betas[1]"}

    def __init__(self, rule, hyper: dict, name: str, scalars: dict):
        self.betas = hyper["beta1"], hyper["beta2"]
        super().__init__(rule, dict(hyper, correction=1.0), name=name, scalars=scalars)
        del self.hyper["correction"]  # a step argument, computed per step

    def per_step(self, learning_rate, count, state) -> tuple:
        beta1, beta2 = self.betas
        count_inc = optax.safe_increment(count)
        return [((1 - beta2 ** count_inc) ** 0.5) / (1 - beta1 ** count_inc)], []

    def fixed_args(self, statics, lr, step, correction=None, *more) -> dict:
        return dict(lr=lr, step=step, correction=correction, **self.hyper)


@functools.lru_cache(maxsize=None)
def _rule_state_type(name: str, slots: tuple, scalars: tuple) -> type:
    """The state class of a rule (one per name and fields, so that every transformation of one
    rule keeps states of one pytree type): `count`, each state slot, then per-step scalars.
    Made at run time, it pickles as a call that makes it again."""
    words = re.sub(r"\W", "_", name).split("_")  # a chain's name joins its links' with "+"
    title = "".join(part.title() for part in words) or "Rule"
    if not title.isidentifier():
        title = f"Rule{title}"
    state_type = NamedTuple(f"{title}State",
                            [("count", Any)] + [(s, Any) for s in (*slots, *scalars)])
    state_type.slot_fields = slots  # what tree_state and flat_state convert
    state_type.__reduce__ = lambda state: (_rule_state, (name, slots, scalars, tuple(state)))
    STATES.append(state_type)
    return state_type


def _rule_state(name: str, slots: tuple, scalars: tuple, values: tuple):
    """A rule's state of these fields and values (what an unpickled one is made by)."""
    return _rule_state_type(name, slots, scalars)(*values)


def _check(arguments: Callable, **hyper) -> None:
    """Runs an op's own hyperparameter checks at construction, naming optax's arguments."""
    try:
        arguments(**hyper)
    except (TypeError, ValueError) as error:
        message = str(error).replace("beta1", "b1").replace("beta2", "b2")
        raise type(error)(message) from None


def _reads_params(program) -> bool:
    """Whether a step's update depends on the params' values: a sum or a line reads them,
    other than as `param = param + x` or `param - x` (x not reading them), whose step from zero
    params is the update itself, exactly (a chain's last line, optax's apply_updates)."""
    if "param" in program.first_pass_slots:
        return True
    for line in program.lines:
        expr = line.expr
        if (line.target == "param" and isinstance(expr, ast.BinOp)
                and isinstance(expr.op, (ast.Add, ast.Sub))
                and isinstance(expr.left, ast.Name) and expr.left.id == "param"):
            expr = expr.right
        if any(isinstance(node, ast.Name) and node.id == "param" for node in ast.walk(expr)):
            return True
    return False


def _chained(rule, name: str) -> dict:
    """A chain's `masks` or `schedules` (mtapply.rules.chain.ChainRule), or those of the
    chain a rule with 8-bit state was made of; {} for other rules."""
    found = getattr(rule, name, None)
    if found is None:
        found = getattr(getattr(rule, "rule", None), name, None)
    return found or {}


def _mask_leaves(mask, params, treedef, name: str) -> tuple:
    """A per-leaf mask (True, a pytree of bools like params or a prefix of it, or a callable
    of params giving one) as a tuple of Python bools: the plan needs them before the step
    runs."""
    if callable(mask):
        mask = mask(params)
    if mask is None or mask is True or mask is False:
        return (mask is not False,) * treedef.num_leaves
    try:
        leaves = treedef.flatten_up_to(mask)
    except (ValueError, TypeError):  # a prefix of the params' tree (as optax takes)
        try:
            leaves = treedef.flatten_up_to(jax.tree.map(
                lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask,
                treedef.unflatten([0] * treedef.num_leaves)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{name} must be a pytree of bools like the params (or a prefix "
                             f"of it), or a callable of the params giving one: {error}") from None
    if not all(isinstance(leaf, (bool, np.bool_)) for leaf in leaves):
        raise TypeError(f"{name} must hold Python bools (one per param), known when the step is "
                        f"traced; got {[type(leaf).__name__ for leaf in leaves][:3]}")
    return tuple(bool(leaf) for leaf in leaves)
