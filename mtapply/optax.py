"""optax transformations run by mtapply's fused kernels, and a fused in-place train step.

    import mtapply.optax as mtx

    tx = optax.chain(optax.clip_by_global_norm(1.0), mtx.adamw(1e-3, weight_decay=0.01))
    updates, state = tx.update(grads, state, params)          # an optax.GradientTransformation

    opt = mtx.fused_adamw(1e-3, weight_decay=0.01)             # the fast path
    state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def train_step(params, batch, state):
        grads = jax.grad(loss)(params, batch)
        return opt.step(params, grads, state)                  # -> (params, state), in place

A rule written with `mtapply.rule` becomes one too: `transformation(rule, learning_rate,
**hyper)` and `fused(rule, learning_rate, **hyper)` (`alias(rule)` is its factory, for
`optax.inject_hyperparams`); `lion`, `adan`, `adagrad` and `rmsprop` (and their fused forms) are
the shipped rules of `mtapply.rules.library` with optax's arguments and semantics.

Hyperparameters. Each number may be an array, as `optax.inject_hyperparams` passes them (traced
under jit): it is then a one-element operand of the step, read by the kernel from device memory
as the learning rate is, so a new value in the state takes effect without recompiling. The
built-in ops read only lr and the step so; with an array b1 (or eps_root, nesterov, lamb's mask)
adam, sgd, lars and lamb run as their rules (`mtapply._optax_rules`), with optax's semantics.
Choices that shape the step (masks, the momentum trace, centered RMSprop) are made when the step
is traced, from Python values only: an array momentum keeps sgd's trace. Arrays are not range
checked (optax checks none).

`adam`, `adamw`, `sgd`, `lars` and `lamb` take optax's arguments and return
`optax.GradientTransformation`s whose `update` returns updates (new params - params, computed by
the kernel, which only reads the params), as optax's contract requires, so they compose with
`optax.chain` and `optax.apply_updates`. The fused forms (`fused_adam`, ...) return
`FusedOptimizer`: `step(params, grads, state) -> (params, state)` writes the new params and state
into the buffers of the old ones when the enclosing `jax.jit` donates them (`donated_step` is
`step` jitted with params and state donated), so a step moves each tensor through memory once and
nothing more.

State layout. Both forms keep each state slot (mu, nu, ...) in one flat buffer per dtype, every
leaf at a 16-byte aligned offset, so a jitted step passes a few state arrays instead of one per
param and slot: JAX's dispatch costs a few microseconds per array, more than the kernel on many
models. `tree_state(state, params)` gives any such state (or a chain's) with its slots as pytrees
like params, as optax keeps them; `flat_state` goes back. A state over a single array keeps
optax's layout: one buffer either way. The transformations take
`flat_state=False` to keep optax's layout throughout (for states sharded like the params).
A slot may keep its own dtype (mu_dtype, accumulator_dtype, state_dtype): one buffer of that
dtype. `optax.tree_map_params` maps a function over each flat buffer (the slot holds optax's
params placeholder after `init` of one); a map that pairs the slots with other trees like the
params (building sharding specs from the params' ones) needs flat_state=False.

JAX's transformations. `update` takes optax's extra arguments (GradientTransformationExtraArgs)
and ignores them; jax.vmap runs the step once per element (an ensemble); jax.grad through an
update raises a TypeError (the kernels have no derivative). Integer and complex params are
refused when the step is traced, naming the leaf. With jax_enable_x64, float64 params take a
float64 lr and step on the CPU (float32 on GPUs, where the kernels read float32 scalars).

Several devices. Under jax.pmap and jax.shard_map each device steps its own buffers (its shard
of each param, and a state made per shard or sharded like the params). Under jax.jit with
sharded params the step, which has no partitioning rule, runs on each device over whole copies
of its operands that XLA gathers: equal results, no saving of memory or work.

How it runs. On GPUs each update is one XLA FFI custom call, `mtapply_step` (`mtapply._xla`,
`csrc/xla_ffi.cpp`), prepared when the step is traced: the kernels are compiled and the tables
allocated on every local GPU, and at run time compiled code reads the buffers' addresses, uploads
the table records of those that moved on XLA's stream and launches the whole tree (one launch per
dtype group; two for LARS and LAMB), with lr and the step count read by the kernel from device
memory. A tree of more than about a thousand leaves is stepped by one call per thousand leaves,
the flat state passing through them in turn: XLA's compile time grows with the square of one
instruction's operands (97 s for one call over 10,000 leaves, 21 s in calls of 1,000). No
Python runs per step and the host never waits. The outputs that are updated in place alias
their inputs (`input_output_aliases`), so XLA hands the call buffers that already hold the old
values: the inputs themselves when they are donated and used nowhere else, otherwise fresh
copies; an array the caller still holds is therefore never written. Where the FFI handler cannot
be built, and on the CPU, the same step is one `jax.experimental.buffer_callback` (jax >= 0.6.1)
into mtapply (the NumPy backend on the CPU), with the same semantics; its plans are cached by
buffer addresses. MTAPPLY_OPTAX_CALLBACK (read at trace time) picks `buffer` (the callback on GPUs
too) or `host` (a `jax.pure_callback` into the NumPy backend that copies through the host, no
bfloat16) instead of the default `ffi`.

Semantics (the count in the state is the number of steps taken; the kernel's step is count + 1;
a schedule is evaluated at count, as optax does):
- adam: optax.adam. u = m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - b1**t) and likewise
  v_hat, as torch.optim.Adam (eps outside the root).
- adamw: optax.adamw's update -lr * (u + wd * p) equals torch.optim.AdamW's p *= 1 - lr * wd,
  p -= lr * u, which mtapply runs (decoupled_weight_decay=True).
- sgd: optax.sgd. The trace t = g + momentum * t (optax.trace) equals torch's momentum buffer
  with dampening 0, whose first-step buf = g is the same as a zero trace; nesterov alike.
- lars: mtapply's LARS (Paddle, You et al.), which differs from optax.lars when weight_decay > 0:
  the trust ratio divides by ||g|| + wd * ||p|| (optax: ||g + wd * p||). The state holds
  mtapply's velocity v (p -= v), minus optax.lars's trace. Equal to optax.lars when wd = 0.
- lamb: optax.lamb (the trust ratio always, use_nvlamb=True), with Apex FusedLAMB's options
  (see `mtapply.LAMBSpec`): use_nvlamb=False applies the trust ratio only where weight_decay != 0.
- Bias corrections (1 - b**t) are computed in float64 (optax: in float32, relative 7e-6 off for
  b2 = 0.999); moments of a 16-bit mu_dtype are computed in float32 and rounded once (optax
  rounds b1 * mu to mu_dtype first).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _optax_rules, _xla
from ._dlpack import TensorRef, export, row_major_strides
from ._launch import cupy_stream
from .ops import AdamSpec, LAMBSpec, LARSSpec, SGDSpec
from .ops._spec import DeviceScalar, check_number
from .plan import Plan
from .rules import library
from .rules._spec import list_name

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # jax < 0.6.1: only the host fallback works
    buffer_callback = None

_CALLBACK_ENV = "MTAPPLY_OPTAX_CALLBACK"
_PLANS_PER_TREE = 4  # plans kept per tree signature, keyed by buffer addresses
_OPERANDS_PER_CALL = 3072  # per-leaf operands and results of one call (see _Engine.apply)
_DLPACK_CPU = 1


# ---------------------------------------------------------------------------------------------
# States: pytrees of jax arrays, so they jit, checkpoint and shard like optax's.


class AdamState(NamedTuple):
    """State of `adam` and `adamw`: steps taken (int32) and the moments, pytrees like params."""

    count: Any
    mu: Any
    nu: Any


class SgdState(NamedTuple):
    """State of `sgd`: steps taken and the momentum trace (None without momentum)."""

    count: Any
    trace: Any = None


class LarsState(NamedTuple):
    """State of `lars`: steps taken and mtapply's LARS velocity (minus optax.lars's trace)."""

    count: Any
    momentum: Any


class LambState(NamedTuple):
    """State of `lamb`: steps taken and the moments, pytrees like params."""

    count: Any
    mu: Any
    nu: Any


_STATES = [AdamState, SgdState, LarsState, LambState]  # and the states of rules (_UserRule)


def tree_state(state, params):
    """`state` with each flat slot (one buffer per dtype, the default layout) given as a pytree
    like params, as optax keeps it (copies): for inspection, and for checkpoints read by code
    that expects optax's layout. `state` is an mtapply.optax state or any pytree holding them
    (a chain's); `params` the params it was made for."""
    return _convert_states(state, params, _slot_as_tree)


def flat_state(state, params):
    """The inverse of `tree_state`: each slot that is a pytree like params made flat
    (copies)."""
    return _convert_states(state, params, _slot_as_flat)


def _flat_for(flat: bool, leaves: list) -> bool:
    """Whether a state over these leaves is kept flat: asked for, and saving arrays (a tree
    of one leaf keeps its slots like params, as optax, whose layout it then is)."""
    return flat and len(leaves) > 1


def _convert_states(state, params, convert):
    leaves, treedef = jax.tree.flatten(params)
    structs = [_leaf_struct(x) for x in leaves]

    def one(node):
        if not isinstance(node, tuple(_STATES)):
            return node
        fields = getattr(type(node), "slot_fields", node._fields[1:])
        return node._replace(**{field: convert(structs, treedef, getattr(node, field), field)
                                for field in fields if getattr(node, field) is not None})

    return jax.tree.map(one, state, is_leaf=lambda node: isinstance(node, tuple(_STATES)))


def _slot_as_tree(structs, treedef, slot, field):
    """A flat slot as a pytree like params (one that already is stays). Its buffers' dtypes
    are the params' or, for a slot of another dtype (mu_dtype), that one dtype."""
    if jax.tree.structure(slot) == treedef:
        return slot
    names = {s.dtype.name for s in structs}
    if isinstance(slot, dict) and len(slot) == 1 and set(slot) != names:
        structs = [jax.ShapeDtypeStruct(s.shape, next(iter(slot))) for s in structs]
    layout = _FlatLayout(structs)
    return treedef.unflatten(layout.split(layout.buffers_of(slot, field)))


def _slot_as_flat(structs, treedef, slot, field):
    """A slot that is a pytree like params as flat buffers of its leaves' dtypes (a flat one
    stays). A slot of one leaf stays a tree: that is its flat layout (`_flat_for`)."""
    if len(structs) == 1:
        return _slot_as_tree(structs, treedef, slot, field)
    if jax.tree.structure(slot) != treedef and isinstance(slot, dict) and set(slot) <= set(_FLOATS):
        return slot
    leaves = treedef.flatten_up_to(slot)
    layout = _FlatLayout([jax.ShapeDtypeStruct(s.shape, _leaf_struct(x).dtype)
                          for s, x in zip(structs, leaves)])
    return dict(zip(layout.names, layout.join(leaves)))


class FusedOptimizer(NamedTuple):
    """The fused form: `step(params, grads, state) -> (params, state)`.

    `step` is pure; inside a `jax.jit` that donates params and state it updates them in place.
    `donated_step` is `step` jitted with params and state donated (they are invalid afterwards).
    The state keeps each moment of every param in one flat buffer per dtype (so a step passes
    a few arrays, not one per param); `tree_state(state, params)` gives it as pytrees like
    params, as optax keeps it (for inspection and checkpoints), and
    `flat_state(tree_state, params)` makes such a state flat again (the module's functions of
    the same names).
    """

    init: Callable
    step: Callable
    donated_step: Callable
    tree_state: Callable
    flat_state: Callable


# ---------------------------------------------------------------------------------------------
# Rules: how each mtapply op is bound and stepped.


class _Rule:
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
    hyper: dict = {}  # op argument -> number
    dynamic: dict = {}  # op argument -> array: a scalar operand of every call
    slot_dtypes: dict = {}  # state field -> the dtype of its buffers, where not the params'

    def scalar_init(self) -> list:
        """The initial values of `scalar_fields`."""
        return []

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
        if not _is_array(value):
            numbers[key] = value
            continue
        if value.size != 1:
            raise TypeError(f"mtapply.optax.{name}: {_OPTAX_NAMES.get(key, key)} must be a number "
                            f"or a one-element array, got shape {value.shape}")
        arrays[key] = value
    return numbers, arrays


def _is_array(value) -> bool:
    """An array (traced or not) rather than a number: a value the kernel reads from memory."""
    return isinstance(value, (jax.Array, np.ndarray))


def _is_number(value) -> bool:
    return not _is_array(value)


_OPTAX_NAMES = {"beta1": "b1", "beta2": "b2"}  # op argument -> optax's argument


class _Adam(_Rule):
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


class _LabeledAdam(_Adam):
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


class _Sgd(_Rule):
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


class _Lars(_Rule):
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


class _Lamb(_Rule):
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
            return _optax_rules.lamb(trust=self.flags["use_nvlamb"], adam_w_mode=self.flags[
                "adam_w_mode"], **self.switches).spec()
        return LAMBSpec(**self.flags)

    def fixed_args(self, statics, lr, step, norm=None, *more) -> dict:
        args = dict(lr=lr, step=step, **self.hyper)
        if not self.as_rule:
            return dict(args, global_grad_norm=norm, **self.switches)
        return args if norm is None else dict(args, global_grad_norm=norm)


class _UserRule(_Rule):
    """A user-written rule (`mtapply.rule`): its slots other than param and grad are the
    state, zero at first; learning_rate drives its `lr`, the other hyperparameters are numbers
    or arrays (device values) given here."""

    def __init__(self, rule, hyper: dict, initial: dict | None = None, name: str | None = None):
        self.user, self.name, self.initial = rule, name or rule.name, dict(initial or {})
        if "lr" not in rule.hyper:
            raise TypeError(f"rule {rule.name!r} has no lr: mtapply.optax passes learning_rate "
                            f"as the rule's lr hyperparameter")
        unknown = sorted(set(hyper) - set(rule.hyper) - {"lr"})
        if unknown:
            raise TypeError(f"rule {rule.name!r} has no hyperparameter {unknown[0]!r} (it takes "
                            f"{', '.join(rule.hyper)})")
        self._take_hyper({name: hyper.get(name, default) for name, default in rule.hyper.items()
                          if name != "lr"})
        missing = [name for name, value in self.hyper.items() if value is None]
        if missing:
            raise TypeError(f"rule {rule.name!r} needs {missing[0]}=... (a number or an array)")
        # the numbers checked now; arrays (read on the device) stand in as device values
        rule.spec().arguments(lr=0.0, step=1.0, **self.hyper,
                              **dict.fromkeys(self.dynamic, DeviceScalar(ptr=0, obj=None)))
        read_only = [s.name for s in rule.program.slots[1:] if not s.written and s.name != "grad"]
        if read_only:
            raise NotImplementedError(f"rule {rule.name!r}: slot {read_only[0]!r} is read-only; "
                                      f"mtapply.optax keeps only read-written slots as state")
        self.slots = tuple(name for name in rule.slots if name not in ("param", "grad"))
        self.plan_slots = ("params", *map(list_name, self.slots), "grads")
        self.reads_params = any(isinstance(node, ast.Name) and node.id == "param"
                                for line in rule.program.lines for node in ast.walk(line.expr))
        self.state_type = _rule_state_type(rule.name, self.slots, ())

    def spec(self, statics):
        return self.user.spec()

    def fixed_args(self, statics, lr, step, *more) -> dict:
        return dict(lr=lr, step=step, **self.hyper)


class _ScheduleFree(_UserRule):
    """Schedule-free AdamW's rule with optax.contrib's per-step scalars: the running maximum
    of the schedule's lr and the running sum of its weights (max_lr ** weight_lr_power), whose
    share this step is `ck`. The schedule is read at the step count (from 1) for the weights,
    and at the steps taken for the base step's lr, as optax does."""

    scalar_fields = ("weight_sum", "max_lr", "b1")

    def __init__(self, b1, b2, eps, weight_decay, weight_lr_power, state_dtype=None):
        rule = library.schedule_free_adamw()
        if _is_number(b1) and not 0.0 < check_number("b1", b1) < 1.0:
            raise ValueError(f"b1 must be in (0, 1) for schedule-free AdamW, got {b1}")
        self.weight_lr_power = (check_number("weight_lr_power", weight_lr_power)
                                if _is_number(weight_lr_power) else weight_lr_power)
        self.b1 = b1
        super().__init__(rule, dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, ck=0.0),
                         initial={"z": "params"}, name="schedule_free_adamw")
        del self.hyper["ck"]  # a step argument, computed per step
        self.state_type = _rule_state_type(rule.name, self.slots, self.scalar_fields)
        self.slot_dtypes = {"z": state_dtype} if state_dtype is not None else {}

    def scalar_init(self) -> list:
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


@functools.lru_cache(maxsize=None)
def _rule_state_type(name: str, slots: tuple, scalars: tuple) -> type:
    """The state class of a rule (one per name and fields, so that every transformation of one
    rule keeps states of one pytree type): `count`, each state slot, then per-step scalars.
    Made at run time, it pickles as a call that makes it again."""
    title = "".join(part.title() for part in name.replace("-", "_").split("_")) or "Rule"
    state_type = NamedTuple(f"{title}State",
                            [("count", Any)] + [(s, Any) for s in (*slots, *scalars)])
    state_type.slot_fields = slots  # what tree_state and flat_state convert
    state_type.__reduce__ = lambda state: (_rule_state, (name, slots, scalars, tuple(state)))
    _STATES.append(state_type)
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


def _mask_leaves(mask, params, treedef, name: str) -> tuple:
    """A per-leaf mask (True, a pytree of bools like params, or a callable of params) as a
    tuple of Python bools: the plan needs them before the step runs."""
    if callable(mask):
        mask = mask(params)
    if mask is None or mask is True or mask is False:
        return (mask is not False,) * treedef.num_leaves
    leaves = treedef.flatten_up_to(mask)
    if not all(isinstance(leaf, (bool, np.bool_)) for leaf in leaves):
        raise TypeError(f"{name} must hold Python bools (one per param), known when the step is "
                        f"traced; got {[type(leaf).__name__ for leaf in leaves][:3]}")
    return tuple(bool(leaf) for leaf in leaves)


# ---------------------------------------------------------------------------------------------
# The engine: one callback per update, one plan step per callback.


class _Engine:
    """Runs a rule over whole pytrees. Holds the learning rate and the plans of its calls.

    A step is one call (the FFI custom call on GPUs, else a buffer callback) whose operands are
    grouped in columns, one per slot of the op (`_Column`): those updated in place (results that
    alias their operands), fresh results (updates), and inputs only read (grads; params when
    the step returns updates). The fused forms update params in place ("inplace"); the
    transformations return updates, computed by the kernel as new - old params ("delta") or,
    for rules that do not read params, as the step from zero params ("zero").

    With `flat` (the fused forms) each state slot is one buffer per dtype holding every leaf's
    state (`_FlatLayout`), so a jitted step passes two arrays per slot instead of one per leaf:
    JAX's dispatch, a few microseconds per array, then stays below the kernel's time."""

    def __init__(self, rule: _Rule, learning_rate, flat: bool = False):
        if not callable(learning_rate) and not hasattr(learning_rate, "dtype"):
            check_number("learning_rate", learning_rate, low=0.0)
        self.rule, self.learning_rate, self.flat = rule, learning_rate, flat
        self.runner = _Runner(rule)  # what the callbacks hold
        self._ffi_plans: dict = {}  # the FFI handler's plan ids, by call key
        self._lock = threading.Lock()

    def init(self, params):
        """The rule's state: count 0 and buffers like params, zero unless the rule starts a
        slot at another value (optax's initial state). A tree without leaves (optax's params
        placeholder, which `optax.tree_map_params` passes) stands in each slot itself."""
        leaves = jax.tree.leaves(params)
        if not leaves:
            slots = [jax.tree.map(lambda x: x, params) for _ in self.rule.slots]
        else:
            _check_leaves(self.rule.name, params, "params")
            layouts = self._layouts(leaves) if _flat_for(self.flat, leaves) else {}
            slots = [_initial_slot(self.rule.initial.get(field, 0.0), params, layouts.get(field),
                                   self.rule.slot_dtypes.get(field))
                     for field in self.rule.slots]
        return self.rule.state_type(jnp.zeros([], jnp.int32), *slots, *self.rule.scalar_init())

    def _layouts(self, leaves: list, state=None) -> dict:
        """State field -> its flat layout over these leaves: the params' dtypes, or the field's
        own (mu_dtype and the like). Given `state` (an update without params, whose leaves are
        the grads), a slot of one buffer keeps that buffer's dtype: the params' at init."""
        structs = [_leaf_struct(x) for x in leaves]
        by_dtype: dict = {}
        dtypes = {}
        for field in self.rule.slots:
            dtype = self.rule.slot_dtypes.get(field)
            slot = getattr(state, field, None)
            if dtype is None and isinstance(slot, dict) and len(slot) == 1:
                dtype = jnp.dtype(next(iter(slot)))
            if dtype not in by_dtype:
                by_dtype[dtype] = _FlatLayout(structs if dtype is None else [
                    jax.ShapeDtypeStruct(s.shape, dtype) for s in structs])
            dtypes[field] = dtype
        return {field: by_dtype[dtypes[field]] for field in self.rule.slots}

    def apply(self, params, grads, state, mode: str = "inplace"):
        """(new params, new state) after one step, or (updates, new state) in the "delta" and
        "zero" modes (in "zero" params may be None); traceable, and traced by the callers.

        The tree is stepped a thousand leaves or so per call (see the module docstring), the
        flat state's buffers passing through the calls in turn."""
        leaves, treedef = jax.tree.flatten(grads if mode == "zero" else params)
        like_params = treedef.flatten_up_to(grads if params is None else params)
        _check_leaves(self.rule.name, grads if params is None else params,
                      "grads" if params is None else "params")
        state_names = self.rule.plan_slots[1:-1]
        layouts = None
        if self.flat and len(like_params) == 1:  # one leaf: its slots like params (`_flat_for`),
            state = tree_state(state, treedef.unflatten(like_params))  # older states were flat
        if _flat_for(self.flat, like_params):
            by_field = self._layouts(like_params, state if params is None else None)
            layouts = {name: by_field[field] for name, field in zip(state_names, self.rule.slots)}
        slots = {name: self._slot_values(state, field, treedef, layouts and layouts[name])
                 for name, field in zip(state_names, self.rule.slots)}
        statics = self.rule.statics(grads if params is None else params, treedef) if leaves else ()
        extra, scalar_state = self.rule.per_step(self.learning_rate, state.count, state)
        scalars = self._scalars(state.count, grads, extra, _scalar_dtype(like_params))
        step = functools.partial(self._step_part, leaves, treedef.flatten_up_to(grads), scalars,
                                 statics, layouts, mode)
        # A leaf without elements has no step: it stays out of the calls and goes through as is.
        firsts = [x if x.size == 0 else None for x in leaves]
        per_leaf = {name: [values[i] if x.size == 0 else None for i, x in enumerate(leaves)]
                    for name, values in slots.items()} if not layouts else {}
        for part in self._parts(statics, [i for i, x in enumerate(leaves) if x.size], mode):
            outs = step(part, [(name, values if layouts else [values[i] for i in part])
                               for name, values in slots.items()])
            for i, x in zip(part, outs.pop("updates" if mode == "delta" else "params")):
                firsts[i] = x
            for name, values in outs.items():
                if layouts:
                    slots[name] = values
                else:
                    for i, x in zip(part, values):
                        per_leaf[name][i] = x
        new_slots = [dict(zip(layouts[name].names, slots[name])) if layouts else
                     treedef.unflatten(per_leaf[name]) for name in state_names]
        return (treedef.unflatten(firsts),
                self.rule.state_type(optax.safe_increment(state.count), *new_slots,
                                     *scalar_state))

    def _parts(self, statics, stepped: list, mode: str) -> list:
        """The leaf indices of each call: the `stepped` leaves of each class of the rule (all
        leaves, mostly) in calls of at most `_leaves_per_call`."""
        classes = self.rule.leaf_classes(statics) if stepped else None
        if classes is None:
            groups = [stepped]
        else:
            groups = [[i for i in stepped if classes[i] == c]
                      for c in dict.fromkeys(classes[i] for i in stepped)]
        per_call = self._leaves_per_call(mode)
        return [group[start: start + per_call] for group in groups
                for start in range(0, len(group), per_call)]

    def _step_part(self, leaves, grad_leaves, scalars, statics, layouts, mode, part: list,
                   state_part: list) -> dict:
        """Column name -> arrays after one call over the leaves at indices `part`, with
        `state_part` the (slot, arrays) of their state."""
        mine = [leaves[i] for i in part]
        aliased = ([("params", mine)] if mode == "inplace" else []) + state_part
        read = (([("params", mine)] if mode == "delta" else [])
                + [(self.rule.plan_slots[-1], [grad_leaves[i] for i in part])])
        fresh = [] if mode == "inplace" else [
            ("updates" if mode == "delta" else "params",
             [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in mine])]
        return self._launch(aliased, fresh, read, scalars,
                            tuple(statics[i] for i in part) if statics else (),
                            layouts and {name: l.part(part) for name, l in layouts.items()},
                            mode, part[0])

    def _scalars(self, count, grads, extra, dtype) -> list:
        """The call's one-element operands (float32, or float64 for float64 params under
        jax_enable_x64): lr, the step, the grads' global norm where the rule takes it, the
        rule's per-step scalars, then its dynamic hyperparameters."""
        scalars = [self._learning_rate(count, dtype), (count + 1).astype(dtype).reshape(1)]
        if self.rule.global_norm:
            scalars.append(_global_norm(grads).astype(dtype).reshape(1))
        scalars += [jnp.asarray(x, dtype).reshape(1) for x in extra]
        scalars += [jnp.asarray(x, dtype).reshape(1) for x in self.rule.dynamic.values()]
        return scalars

    def _leaves_per_call(self, mode: str) -> int:
        """Leaves per call, from the operands and results each leaf adds to it: params (in and
        out, only in, or only out), grads, each state slot kept per leaf (in and out), and
        updates."""
        per_leaf = ({"inplace": 2, "delta": 2, "zero": 1}[mode] + 1
                    + (0 if self.flat else 2 * len(self.rule.slots)))
        return max(1, _OPERANDS_PER_CALL // per_leaf)

    @staticmethod
    def _slot_values(state, field, treedef, layout) -> list:
        """A state slot's arrays: one per leaf, or the flat buffers in layout order."""
        if layout is None:
            return treedef.flatten_up_to(getattr(state, field))
        return layout.buffers_of(getattr(state, field), field)

    def _learning_rate(self, count, dtype):
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        return jnp.asarray(lr, dtype).reshape(-1)  # one, or one per label

    def _launch(self, aliased, fresh, read, scalars, statics, layouts, mode, start) -> dict:
        """Column name -> arrays after the step over the leaves of one call (the first at
        `start`): one FFI custom call on GPUs, else one callback. It has no derivative: jax.grad
        through it raises a clear error; jax.vmap runs it once per element."""
        written = [x for _, arrays in aliased for x in arrays]
        inputs = written + [x for _, arrays in read for x in arrays] + scalars
        results = ([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written]
                   + [spec for _, specs in fresh for spec in specs])
        schema = _schema(aliased, fresh, read, layouts)
        signature = tuple((x.shape, str(x.dtype)) for x in inputs[:len(inputs) - len(scalars)])
        placed = tuple((name, tuple(layout.offsets)) for name, layout in (layouts or {}).items())
        key = (statics, mode, schema, signature, start, placed)
        mechanism = os.environ.get(_CALLBACK_ENV, "ffi")
        host = mechanism == "host" or buffer_callback is None
        n = (key, layouts, results, len(written), len(scalars))
        callback = functools.partial(self._host_call if host else self._callback_call, *n)
        wide = any(x.dtype == jnp.float64 for x in scalars)
        if host or (mechanism != "ffi" and not wide):
            call = callback
        else:  # GPUs: the FFI call, kernels that read float32 device scalars
            on_gpu = (functools.partial(self._ffi_call, *n, callback) if mechanism == "ffi"
                      else callback)
            if wide:
                on_gpu = _float32_scalars(on_gpu, len(scalars))
            call = functools.partial(jax.lax.platform_dependent, default=callback, cuda=on_gpu)
        outs = _without_derivative(call, self.rule.name)(*inputs)
        return {column.name: list(outs[column.start: column.start + column.count])
                for column in schema if column.place == "out"}

    def spec(self, key):
        return self.runner.spec(key)

    def _host_call(self, key, layouts, results, n_aliased, n_scalars, *inputs) -> list:
        """The step as one pure callback into the NumPy backend: the slow fallback, which
        copies through the host."""
        call = functools.partial(self.runner.host_callback, key, layouts, n_aliased, n_scalars)
        return list(jax.pure_callback(call, results, *inputs, vmap_method="sequential"))

    def _callback_call(self, key, layouts, results, n_aliased, n_scalars, *inputs) -> list:
        """The step as one buffer callback (the CPU, or GPUs without the FFI handler)."""
        # Flat positional inputs: buffer_callback checks alias indices against them.
        call = buffer_callback(functools.partial(self.runner.buffer_callback, key, layouts,
                                                 n_scalars),
                               results, input_output_aliases={i: i for i in range(n_aliased)},
                               vmap_method="sequential")
        return list(call(*inputs))

    def _ffi_call(self, key, layouts, results, n_aliased, n_scalars, fallback, *inputs) -> list:
        """The step as one `mtapply_step` custom call: compiled code reads the buffers'
        addresses and launches the kernels, no Python at run time (see mtapply._xla)."""
        if not _xla.available():
            return fallback(*inputs)
        with self._lock:
            plan_id = self._ffi_plans.get(key)
            if plan_id is None:
                plan_id = self._ffi_plans[key] = self._prepare(key, layouts, results, inputs,
                                                               n_scalars)
        call = jax.ffi.ffi_call(_xla.TARGET, results, vmap_method="sequential",
                                input_output_aliases={i: i for i in range(n_aliased)})
        return list(call(*inputs, plan=np.int64(plan_id)))

    def _prepare(self, key, layouts, results, inputs, n_scalars) -> int:
        """Registers the call's op with the FFI handler, which numbers a call's buffers results
        first, then inputs."""
        spec, by_name = self.spec(key), {column.name: column for column in key[2]}
        grads = by_name[self.rule.plan_slots[-1]]
        n, n_results = grads.count, len(results)
        operand_table = np.zeros((n, len(spec.slots)), np.int64)
        offset_table = np.zeros((n, len(spec.slots)), np.int64)
        for s, name in enumerate(spec.slots):
            column = by_name[name]
            base = column.start + (n_results if column.place == "in" else 0)
            if column.flat:
                layout = layouts[name]
                operand_table[:, s] = layout.operands(base)
                offset_table[:, s] = layout.byte_offsets()
            else:
                operand_table[:, s] = base + np.arange(n)
        buffers = list(results) + list(inputs)
        dtypes = [tuple(str(buffers[j].dtype) for j in row) for row in operand_table]
        numels = [int(np.prod(x.shape, dtype=np.int64)) for x in
                  inputs[grads.start: grads.start + n]]
        placeholders = [_xla.placeholder(k) for k in range(n_scalars)]
        hyper = self.rule.step_args(key[0], *placeholders)
        first_scalar = n_results + len(inputs) - n_scalars
        scalar_operands = {name: first_scalar + value.obj for name, value in hyper.items()
                           if isinstance(value, DeviceScalar)}
        devices = sorted({d.local_hardware_id if d.local_hardware_id is not None else d.id
                          for d in jax.local_devices(backend="gpu")})
        elements = [int(np.prod(x.shape, dtype=np.int64)) for x in buffers]
        return _xla.prepare(spec, operand_table, offset_table, dtypes, numels, hyper,
                            scalar_operands, devices, elements)


class _Runner:
    """What a step's callbacks run, kept apart from `_Engine`: the rule without the arrays it
    was given (traced ones would otherwise stay referenced by every compiled step), and the
    plans of the calls, cached by buffer addresses."""

    def __init__(self, rule: _Rule):
        self.rule = _static_view(rule)
        self._plans: OrderedDict = OrderedDict()  # the callbacks' plans, by buffer addresses
        self._lock = threading.Lock()  # XLA may run callbacks from several threads

    def spec(self, key):
        """The op of a call key: the rule's op in the call's param mode."""
        spec = self.rule.spec(key[0])
        return spec if key[1] == "inplace" else spec.with_param_mode(key[1])

    def buffer_callback(self, key, layouts, n_scalars, ctx, outs, *inputs) -> None:
        """Steps XLA's buffers: `outs` (the results) alias the first inputs where the schema
        says so, and then hold the old values; the scalars come last. Flat state is stepped
        through views of each leaf's part of its buffer."""
        scalars = inputs[len(inputs) - n_scalars:]
        outs = [_XlaBuffer(b) for b in outs]
        columns = _buffers_by_column(key[2], layouts, outs,
                                     [_XlaBuffer(b) for b in inputs[:len(inputs) - n_scalars]])
        kind, device_id = outs[0].__dlpack_device__()
        if kind == _DLPACK_CPU:
            values = [np.asarray(s).astype(np.float64).reshape(-1) for s in scalars]
            self._step(key, columns, self.rule.host_args(values, key[0]), None)
            return
        import cupy

        stream = ctx.stream
        # CuPy's pool then orders the reuse of a plan's memory on XLA's stream.
        with cupy.cuda.Device(device_id), cupy_stream(stream, device_id):
            values = [DeviceScalar(ptr=_device_address(s), obj=None) for s in scalars]
            self._step(key, columns, self.rule.step_args(key[0], *values), stream)

    def host_callback(self, key, layouts, n_aliased, n_scalars, *inputs) -> list:
        """The host fallback: new arrays from NumPy copies, through a fresh plan."""
        schema = key[2]
        outs = [np.array(x, copy=True) for x in inputs[:n_aliased]]
        outs += [np.empty(shape, column.dtype) for column in schema
                 if column.place == "out" and column.shapes for shape in column.shapes]
        values = [np.asarray(s).astype(np.float64).reshape(-1)
                  for s in inputs[len(inputs) - n_scalars:]]
        reads = [np.asarray(x) for x in inputs[:len(inputs) - n_scalars]]
        plan = Plan(self.spec(key), dict(_buffers_by_column(schema, layouts, outs, reads)))
        plan.step(**self.rule.host_args(values, key[0]))
        return outs

    def _step(self, key, columns: list, hyper: dict, stream) -> None:
        """One plan step over the buffers. Plans are cached by the buffers' addresses, which
        recur in a training loop. On a miss where only one column moved (typically fresh grads
        while params and state stay in place) a plan of the tree is rebound to them."""
        addresses = tuple(tuple(_address(b) for b in buffers) for _, buffers in columns)
        with self._lock:
            plan = self._plans.pop((key, addresses), None)
            if plan is None:
                plan = self._moved_plan(key, addresses, columns, stream)
            if plan is None:
                plan = Plan(self.spec(key), dict(columns), stream=stream)
            self._plans[(key, addresses)] = plan
            mine = [k for k in self._plans if k[0] == key]
            for old_key in mine[:-_PLANS_PER_TREE]:
                del self._plans[old_key]
            plan.step(stream=stream, **hyper)

    def _moved_plan(self, key, addresses: tuple, columns: list, stream):
        """The most recent plan of `key` whose buffers differ from `addresses` in one column
        only, rebound to `columns`; None if there is none. (Rebinding several columns one by
        one could meet stale addresses that XLA has since given to another column.)"""
        for old_key in reversed([k for k in self._plans if k[0] == key]):
            moved = [i for i, (old, new) in enumerate(zip(old_key[1], addresses)) if old != new]
            if len(moved) == 1:
                plan, (name, buffers) = self._plans.pop(old_key), columns[moved[0]]
                # XLA's buffers have the traced shapes and dtypes, dense: only addresses change.
                plan.rebind_addresses(name, buffers, np.asarray(addresses[moved[0]], np.uint64),
                                      stream=stream)
                return plan
        return None


def _static_view(rule: _Rule) -> _Rule:
    """A copy of `rule` whose array attributes (and array values of dict attributes) are None:
    what running a step needs, without keeping traced values alive."""
    view = copy.copy(rule)
    for name, value in vars(rule).items():
        if _is_array(value):
            setattr(view, name, None)
        elif isinstance(value, dict) and any(_is_array(v) for v in value.values()):
            setattr(view, name, {k: None if _is_array(v) else v for k, v in value.items()})
    return view


class _Column(NamedTuple):
    """One slot of a call's op: where its buffers are among the call's results ("out") or
    inputs ("in"), how many, whether they are a flat state's buffers, and for fresh results
    each leaf's shape and the dtype."""

    name: str
    place: str
    start: int
    count: int
    flat: bool
    shapes: tuple = ()
    dtype: str = ""


def _schema(aliased, fresh, read, layouts) -> tuple:
    """The columns of a call whose results are `aliased` then `fresh`, and whose inputs are
    `aliased` (the same buffers), then `read`, then the scalars; `layouts` (or None) holds the
    flat layout of each state column."""
    columns, start = [], 0
    for name, arrays in aliased:
        flat = layouts is not None and name in layouts
        columns.append(_Column(name, "out", start, len(arrays), flat))
        start += len(arrays)
    n_aliased = start
    for name, specs in fresh:
        columns.append(_Column(name, "out", start, len(specs), False,
                               tuple(tuple(x.shape) for x in specs), str(specs[0].dtype)))
        start += len(specs)
    start = n_aliased
    for name, arrays in read:
        columns.append(_Column(name, "in", start, len(arrays), False))
        start += len(arrays)
    return tuple(columns)


def _buffers_by_column(schema, layouts, outs: list, inputs: list) -> list:
    """(slot name, one buffer per leaf) of each column: the call's results and inputs as the
    schema places them, flat state as views of each leaf's part."""
    columns = []
    for column in schema:
        buffers = (outs if column.place == "out" else inputs)[column.start: column.start + column.count]
        if column.flat:
            buffers = layouts[column.name].views([export(b, "state", None) for b in buffers])
        columns.append((column.name, list(buffers)))
    return columns


def _address(buffer) -> int:
    if isinstance(buffer, TensorRef):
        return buffer.ptr
    return buffer.address()


class _FlatLayout:
    """Where a fused optimizer keeps each leaf's state: per state slot, one 1-D buffer per
    dtype of the params (a dict dtype name -> buffer), each leaf at an offset of a multiple of
    16 bytes, so the kernel's vector loads stay aligned."""

    def __init__(self, leaves: list):
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [np.dtype(x.dtype) for x in leaves]
        self.names = list(dict.fromkeys(d.name for d in self.dtypes))
        ends = dict.fromkeys(self.names, 0)
        self.offsets = []  # in elements of the leaf's dtype
        for shape, dtype in zip(self.shapes, self.dtypes):
            self.offsets.append(ends[dtype.name])
            per_vector = 16 // dtype.itemsize
            size = int(np.prod(shape, dtype=np.int64))
            ends[dtype.name] += -(-size // per_vector) * per_vector
        self.sizes = ends

    def part(self, indices: list) -> _FlatLayout:
        """The layout of the leaves at `indices`, in the same buffers."""
        part = copy.copy(self)
        part.shapes = [self.shapes[i] for i in indices]
        part.dtypes = [self.dtypes[i] for i in indices]
        part.offsets = [self.offsets[i] for i in indices]
        return part

    def full(self, value: float = 0.0) -> dict:
        return {name: jnp.full(max(self.sizes[name], 1), value, name) for name in self.names}

    def buffers_of(self, slot: dict, field: str) -> list:
        """The slot's buffers in layout order, checked against the layout."""
        if not isinstance(slot, dict) or set(slot) != set(self.names):
            raise ValueError(f"state.{field} holds {type(slot).__name__}, not this optimizer's flat "
                             f"state for these params: make the state with its init(params)")
        buffers = [slot[name] for name in self.names]
        for name, buffer in zip(self.names, buffers):
            if buffer.shape != (max(self.sizes[name], 1),) or buffer.dtype != name:
                raise ValueError(f"state.{field}[{name!r}] is {buffer.dtype}{list(buffer.shape)}, "
                                 f"not this flat state's {name}[{max(self.sizes[name], 1)}] for "
                                 f"these params: make the state with init(params) (a map over "
                                 f"the state that changes shapes or dtypes, as "
                                 f"optax.tree_map_params can, needs flat_state=False)")
        return buffers

    def split(self, buffers) -> list:
        """Each leaf's state, cut out of the buffers (copies; through the host for concrete
        arrays, where thousands of small device slices would each dispatch)."""
        if _traced(buffers):
            by_name = dict(zip(self.names, buffers))
            return [by_name[d.name][o: o + _size(s)].reshape(s)
                    for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]
        device = _device_of(buffers[0])
        by_name = {name: np.asarray(buffer) for name, buffer in zip(self.names, buffers)}
        return [jax.device_put(by_name[d.name][o: o + _size(s)].reshape(s), device)
                for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]

    def join(self, leaves) -> list:
        """The buffers holding `leaves` (one per leaf, in order) at their offsets, zero
        between them (built on the host for concrete arrays: a device concatenation of
        thousands of operands compiles slowly)."""
        leaves = list(leaves)
        if _traced(leaves):
            return self._join_traced(leaves)
        device = _device_of(leaves[0]) if leaves else None
        buffers = {name: np.zeros(max(self.sizes[name], 1), name) for name in self.names}
        for leaf, d, o in zip(leaves, self.dtypes, self.offsets):
            buffers[d.name][o: o + leaf.size] = np.asarray(leaf, d).reshape(-1)
        return [jax.device_put(buffers[name], device) for name in self.names]

    def _join_traced(self, leaves: list) -> list:
        parts = {name: [] for name in self.names}
        ends = dict.fromkeys(self.names, 0)
        for leaf, d, o in zip(leaves, self.dtypes, self.offsets):
            if o > ends[d.name]:
                parts[d.name].append(jnp.zeros(o - ends[d.name], d))
            parts[d.name].append(leaf.reshape(-1))
            ends[d.name] = o + leaf.size
        out = []
        for name in self.names:
            total = max(self.sizes[name], 1)
            if total > ends[name]:
                parts[name].append(jnp.zeros(total - ends[name], name))
            out.append(jnp.concatenate(parts[name]))
        return out

    def views(self, buffers: list) -> list:
        """TensorRefs of each leaf's part of flat buffers: `buffers` holds the TensorRefs of
        each slot's buffers (in `names` order), slot after slot; the views come likewise."""
        width, views = len(self.names), []
        for k in range(0, len(buffers), width):
            by_name = dict(zip(self.names, buffers[k: k + width]))
            for shape, dtype, offset in zip(self.shapes, self.dtypes, self.offsets):
                buffer = by_name[dtype.name]
                views.append(dataclasses.replace(
                    buffer, ptr=buffer.ptr + offset * dtype.itemsize, shape=shape,
                    numel=int(np.prod(shape, dtype=np.int64)), strides=row_major_strides(shape)))
        return views

    def operands(self, base: int) -> np.ndarray:
        """The buffer operand of each leaf, the slot's buffers being operands base, base + 1..."""
        return np.array([base + self.names.index(d.name) for d in self.dtypes], np.int64)

    def byte_offsets(self) -> np.ndarray:
        return np.array([o * d.itemsize for o, d in zip(self.offsets, self.dtypes)], np.int64)


def _initial_slot(value, params, layout, dtype=None):
    """A state slot's first value: a number (or a scalar array) everywhere, or ("params") a
    copy of the params; of `dtype` where given, else of each param's dtype."""
    if isinstance(value, str) and value == "params":
        if layout is None:
            return jax.tree.map(lambda p: jnp.array(p, dtype or _leaf_struct(p).dtype), params)
        return dict(zip(layout.names, layout.join(jax.tree.leaves(params))))
    if layout is None:
        return jax.tree.map(lambda p: jnp.full(np.shape(p), value, dtype or _leaf_struct(p).dtype),
                            params)
    return layout.full(value)


def _leaf_struct(x) -> jax.ShapeDtypeStruct:
    """A leaf's shape and the dtype JAX gives it (Python numbers and NumPy float64 arrays
    become float32 unless jax_enable_x64 is on)."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(dtype))


_FLOATS = ("float16", "bfloat16", "float32", "float64")  # what the kernels step


def _check_leaves(name: str, tree, what: str) -> None:
    """TypeError naming the first leaf that the kernels cannot step (integers, complex
    numbers), raised when the step is traced."""
    leaves = jax.tree.leaves(tree)
    if all(_leaf_struct(x).dtype.name in _FLOATS for x in leaves):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = _leaf_struct(leaf).dtype
        if dtype.name not in _FLOATS:
            kind = "complex" if jnp.issubdtype(dtype, jnp.complexfloating) else "integer"
            raise TypeError(f"mtapply.optax.{name}: {what}{jax.tree_util.keystr(path)} has "
                            f"dtype {dtype.name}; mtapply's kernels step float16, bfloat16, "
                            f"float32 and float64 arrays: cast it to one of those, or use "
                            f"optax's own transformation for {kind} params")


def _scalar_dtype(leaves: list):
    """The dtype of a call's scalar operands: float64 for float64 params (jax_enable_x64),
    else float32 (what the kernels read on GPUs)."""
    wide = any(_leaf_struct(x).dtype == np.float64 for x in leaves)
    return jnp.float64 if wide else jnp.float32


def _float32_scalars(call, n_scalars: int):
    """`call` given its last `n_scalars` inputs as float32 (the GPU kernels read float32 device
    scalars)."""
    def narrowed(*inputs):
        k = len(inputs) - n_scalars
        return call(*inputs[:k], *(x.astype(jnp.float32) for x in inputs[k:]))
    return narrowed


def _without_derivative(call, name: str):
    """`call` with a JVP rule that refuses: the kernels have no derivative, and JAX's own
    error (a callback or custom call without JVP) does not say what to do instead."""
    step = jax.custom_jvp(call)

    def refuse(primals, tangents):
        raise TypeError(f"mtapply.optax.{name}: jax.grad (or jvp, linearize) through an "
                        f"optimizer update is not supported: mtapply's kernels have no "
                        f"derivative. Differentiate through optax's own transformation, or "
                        f"take the update out of the differentiated function "
                        f"(jax.lax.stop_gradient on its inputs)")

    step.defjvp(refuse)
    return step


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _traced(arrays) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in arrays)


def _device_of(array):
    """The one device of a concrete array (its first, for arrays on several)."""
    devices = getattr(array, "devices", None)
    return next(iter(devices())) if devices is not None else None


def _global_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None)  # optax >= 0.2.5
    return norm(tree) if norm is not None else optax.global_norm(tree)


class _XlaBuffer:
    """An XLA buffer of a running callback as mtapply ingests it, through DLPack.

    mtapply refuses jax arrays (immutable); these are the mutable buffers XLA lends the callback
    (outputs writable, inputs exported read-only). Row-major, as XLA passes custom-call buffers.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer):
        self.buffer = buffer

    def __dlpack__(self, **kwargs):
        return self.buffer.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.buffer.__dlpack_device__()

    def address(self) -> int:
        if self.buffer.__dlpack_device__()[0] == _DLPACK_CPU:
            return np.asarray(self.buffer).__array_interface__["data"][0]
        return _device_address(self.buffer)


def _device_address(buffer) -> int:
    try:
        return int(buffer.__cuda_array_interface__["data"][0])
    except Exception:  # a dtype the interface cannot describe (bfloat16): ask DLPack
        return export(_XlaBuffer(buffer), "buffer", None).ptr


# ---------------------------------------------------------------------------------------------
# Public constructors.


def _transformation(rule: _Rule, learning_rate, flat_state: bool) -> optax.GradientTransformation:
    """An optax.GradientTransformation whose update returns updates (new params - params),
    written by the kernel itself: params are only read, and not at all by rules that do not
    depend on them."""
    engine = _Engine(rule, learning_rate, flat=flat_state)

    def step(updates, state, params):
        if not rule.reads_params:  # the step from zero params is the update itself
            return engine.apply(params, updates, state, mode="zero")
        if params is None:
            raise ValueError(f"mtapply.optax.{rule.name} with these options reads the params: "
                             f"call update(grads, state, params)")
        return engine.apply(params, updates, state, mode="delta")

    jitted = jax.jit(step)

    def update(updates, state, params=None, **extra_args):
        del extra_args  # arguments for other transformations of a chain (loss, ...)
        return jitted(updates, state, params)

    transformation = _Transformation(engine.init, update)
    transformation.mtapply = (rule, learning_rate, flat_state)
    return transformation


class _Transformation(optax.GradientTransformationExtraArgs):
    """An optax transformation (its update takes optax's extra arguments, and ignores them)
    that knows its rule (`mtapply`: rule, learning rate, flat_state), so that
    `multi_transform` can run several as one."""


def _fused(rule: _Rule, learning_rate) -> FusedOptimizer:
    engine = _Engine(rule, learning_rate, flat=True)
    optimizer = _Fused(engine.init, jax.jit(engine.apply),
                       jax.jit(engine.apply, donate_argnums=(0, 2)), tree_state, flat_state)
    optimizer.mtapply = (rule, learning_rate, True)
    return optimizer


class _Fused(FusedOptimizer):
    """A FusedOptimizer that knows its rule (as `_Transformation`), for
    `fused_multi_transform`."""


def _refuse(name: str, **options) -> None:
    """NotImplementedError for optax options mtapply's kernels do not have (structural ones:
    None, bools, masks)."""
    for option, (value, default) in options.items():
        if value is not default and value != default:
            raise NotImplementedError(f"mtapply.optax.{name}: {option}={value!r} is not supported "
                                      f"(only {option}={default!r}); use optax.{name} for it")


def _state_dtype(name: str, option: str, dtype):
    """optax's mu_dtype (and the like) as the dtype a state slot keeps: None (the params'),
    or a floating dtype the kernels store (canonical: float32 for float64 without x64)."""
    if dtype is None:
        return None
    dtype = jax.dtypes.canonicalize_dtype(jnp.dtype(dtype))
    if dtype.name not in _FLOATS:
        raise NotImplementedError(f"mtapply.optax.{name}: {option}={dtype.name} is not "
                                  f"supported: mtapply keeps states in float16, bfloat16, "
                                  f"float32 or float64; use optax.{name} for {dtype.name} states")
    return dtype


def _adam_rule(name, b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay=0.0, mask=None):
    if callable(weight_decay):
        raise TypeError(f"mtapply.optax.{name}: weight_decay must be a number, not a schedule")
    return _Adam(b1, b2, eps, weight_decay, mask, eps_root=eps_root, nesterov=nesterov,
                 mu_dtype=_state_dtype(name, "mu_dtype", mu_dtype), name=name)


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
         nesterov=False, flat_state=True) -> optax.GradientTransformation:
    """optax.adam on mtapply's fused kernel (update: -lr * m_hat / (sqrt(v_hat) + eps)).

    Args:
        learning_rate: a number, a scalar array, or an optax schedule of the step count.
        b1, b2, eps, eps_root, mu_dtype, nesterov: as optax.adam. Each number may be an array
            (optax.inject_hyperparams passes them so), read by the kernel from device memory;
            mu_dtype is a floating dtype (float16, bfloat16, float32, float64).
        flat_state: keep mu and nu each in one flat buffer per dtype (see `tree_state`), so
            that a jitted step passes a few state arrays instead of one per param and slot;
            False keeps them as pytrees like params, as optax does (for states sharded like
            the params), at JAX's dispatch cost of a few microseconds per array and step.

    Returns:
        An optax.GradientTransformation with state `AdamState(count, mu, nu)`.

    Example:
        >>> tx = optax.chain(optax.clip_by_global_norm(1.0), mtapply.optax.adam(1e-3))
    """
    return _transformation(_adam_rule("adam", b1, b2, eps, eps_root, mu_dtype, nesterov),
                           learning_rate, flat_state)


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
          weight_decay=1e-4, mask=None, *, nesterov=False,
          flat_state=True) -> optax.GradientTransformation:
    """optax.adamw on mtapply's fused kernel: p -= lr * (u + weight_decay * p), u as in `adam`.

    Args as optax.adamw (numbers or arrays, as in `adam`); weight_decay is not a schedule;
    mask, as optax's (a pytree of bools like params, or a callable of params giving one:
    weight decay only where True), is fixed per tree when the step is traced and read by the
    kernel per tensor, so the whole tree stays one call; flat_state as in `adam`. Params are
    required by update.
    """
    rule = _adam_rule("adamw", b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay, mask)
    return _transformation(rule, learning_rate, flat_state)


def multi_transform(transforms: dict, param_labels) -> optax.GradientTransformation:
    """optax.multi_transform, in one call where the labels' transformations allow it.

    Where every transformation is this module's `adam` or `adamw` (any learning rate or
    schedule, weight decay and mask per label) with the same b1, b2, eps and flat_state, the
    whole tree is one op: each leaf reads its label's lr, from one array of the labels' lrs
    per step, and its label's weight decay (a mask, as each label's adamw gives it, is taken
    over the whole tree). The state is then one `AdamState` over the whole tree (not optax's
    per-label states). Otherwise this is optax.multi_transform itself, each label its own call.

    Args:
        transforms: label -> GradientTransformation.
        param_labels: a pytree of labels like params (or a prefix of it), or a callable of
            params giving one.
    """
    labeled = _labeled(transforms, param_labels)
    if labeled is None:
        return optax.multi_transform(transforms, param_labels)
    return _transformation(*labeled)


def fused_multi_transform(optimizers: dict, param_labels) -> FusedOptimizer:
    """`multi_transform` as a fused step, of this module's `fused_adam`/`fused_adamw`
    optimizers of the same b1, b2 and eps: `opt.step(params, grads, state) -> (params, state)`
    over the whole tree in one call, each leaf with its label's learning rate, weight decay and
    mask."""
    labeled = _labeled(optimizers, param_labels)
    if labeled is None:
        raise ValueError("fused_multi_transform takes mtapply.optax.fused_adam or fused_adamw "
                         "optimizers of the same b1, b2 and eps: use multi_transform (with "
                         "optax.multi_transform's semantics) for other transformations")
    rule, learning_rates, _ = labeled
    return _fused(rule, learning_rates)


def _labeled(transforms: dict, param_labels):
    """(rule, learning rates, flat_state) of `transforms` as one op over the labels, or None
    where they cannot be one (see `multi_transform`)."""
    found = [getattr(t, "mtapply", None) for t in transforms.values()]
    if not found or any(f is None or type(f[0]) is not _Adam or f[0].as_rule or f[0].slot_dtypes
                        for f in found) or len(
            {(rule.hyper["beta1"], rule.hyper["beta2"], rule.hyper["eps"], flat)
             for rule, _, flat in found}) != 1:
        return None
    rule = _LabeledAdam({label: rule for label, (rule, _, _) in zip(transforms, found)},
                        param_labels)
    rates = [lr for _, lr, _ in found]

    def learning_rates(count):
        return jnp.stack([jnp.asarray(lr(count) if callable(lr) else lr, jnp.float32).reshape(())
                          for lr in rates])

    return rule, learning_rates, found[0][2]


def sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None, *,
        flat_state=True) -> optax.GradientTransformation:
    """optax.sgd on mtapply's fused kernel: t = g + momentum * t; p -= lr * t (Nesterov:
    p -= lr * (g + momentum * t)). momentum None or 0 keeps no trace. flat_state as in `adam`.

    momentum may be an array (then the trace is kept); accumulator_dtype is the trace's
    dtype, as optax's.

    Returns:
        An optax.GradientTransformation with state `SgdState(count, trace)`.
    """
    return _transformation(_sgd_rule(momentum, nesterov, accumulator_dtype), learning_rate,
                           flat_state)


def _sgd_rule(momentum, nesterov, accumulator_dtype) -> _Sgd:
    return _Sgd(momentum, nesterov, _state_dtype("sgd", "accumulator_dtype", accumulator_dtype))


def lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
         eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False, *,
         flat_state=True) -> optax.GradientTransformation:
    """mtapply's LARS (Paddle's lars_momentum, You et al. 2017) with optax.lars's arguments.

    Per tensor: local_lr = lr * trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps) (lr when a
    norm is 0); v = momentum * v + local_lr * (g + wd * p); p -= v. A leaf whose
    trust_ratio_mask is False takes a plain momentum step with lr and no weight decay, so
    weight_decay_mask must equal trust_ratio_mask when weight_decay > 0. Differs from optax.lars
    when weight_decay > 0 (see the module docstring); nesterov is not supported. flat_state as
    in `adam`.

    Returns:
        An optax.GradientTransformation with state `LarsState(count, momentum)`.
    """
    _refuse("lars", nesterov=(nesterov, False))
    rule = _Lars(weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask)
    return _transformation(rule, learning_rate, flat_state)


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None,
         *, adam_w_mode=True, use_nvlamb=True, grad_averaging=True, bias_correction=True,
         max_grad_norm=0.0, flat_state=True) -> optax.GradientTransformation:
    """optax.lamb, with Apex FusedLAMB's options (`mtapply.LAMBSpec`) besides optax's arguments.

    u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p;  p -= lr * ||p|| / ||u|| * u (1 where
    a norm is 0). use_nvlamb=False takes Apex's default instead: the trust ratio only where
    weight_decay != 0. mask (optax's) puts weight decay only on the leaves where it is True.
    max_grad_norm > 0 divides the grads by global_norm / max_grad_norm when that exceeds 1
    (norm computed in the step). Numbers may be arrays, as in `adam`; flat_state as in `adam`.

    Returns:
        An optax.GradientTransformation with state `LambState(count, mu, nu)`.
    """
    return _transformation(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode,
                                      use_nvlamb, grad_averaging, bias_correction, max_grad_norm),
                           learning_rate, flat_state)


def _lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
               grad_averaging, bias_correction, max_grad_norm) -> _Lamb:
    if callable(weight_decay):
        raise TypeError("mtapply.optax.lamb: weight_decay must be a number, not a schedule")
    return _Lamb(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                 grad_averaging, bias_correction, max_grad_norm)


def fused_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
               nesterov=False) -> FusedOptimizer:
    """`adam` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_adam_rule("adam", b1, b2, eps, eps_root, mu_dtype, nesterov), learning_rate)


def fused_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
                weight_decay=1e-4, mask=None, *, nesterov=False) -> FusedOptimizer:
    """`adamw` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    rule = _adam_rule("adamw", b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay, mask)
    return _fused(rule, learning_rate)


def fused_sgd(learning_rate, momentum=None, nesterov=False,
              accumulator_dtype=None) -> FusedOptimizer:
    """`sgd` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_sgd_rule(momentum, nesterov, accumulator_dtype), learning_rate)


def fused_lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
               eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False) -> FusedOptimizer:
    """`lars` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    _refuse("lars", nesterov=(nesterov, False))
    rule = _Lars(weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask)
    return _fused(rule, learning_rate)


def fused_lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0,
               mask=None, *, adam_w_mode=True, use_nvlamb=True, grad_averaging=True,
               bias_correction=True, max_grad_norm=0.0) -> FusedOptimizer:
    """`lamb` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                             grad_averaging, bias_correction, max_grad_norm), learning_rate)


def _lion_rule(b1, b2, mu_dtype, weight_decay, mask) -> _UserRule:
    _refuse("lion", mask=(mask, None))
    if callable(weight_decay):
        raise TypeError("mtapply.optax.lion: weight_decay must be a number, not a schedule")
    rule = _UserRule(library.lion(), dict(beta1=b1, beta2=b2, weight_decay=weight_decay))
    dtype = _state_dtype("lion", "mu_dtype", mu_dtype)
    rule.slot_dtypes = {"exp_avg": dtype} if dtype is not None else {}
    return rule


def lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3, mask=None, *,
         flat_state=True) -> optax.GradientTransformation:
    """optax.lion on the rule `mtapply.rules.library.lion`: p -= lr * (sign(b1 * m + (1 - b1)
    * g) + weight_decay * p); m = b2 * m + (1 - b2) * g. mu_dtype is the moment's dtype; mask
    only takes its default; the state is `LionState(count, exp_avg)`."""
    return _transformation(_lion_rule(b1, b2, mu_dtype, weight_decay, mask), learning_rate,
                           flat_state)


def fused_lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3,
               mask=None) -> FusedOptimizer:
    """`lion` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_lion_rule(b1, b2, mu_dtype, weight_decay, mask), learning_rate)


def _adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask) -> _UserRule:
    _refuse("adan", mask=(mask, None))
    if callable(weight_decay):
        raise TypeError("mtapply.optax.adan: weight_decay must be a number, not a schedule")
    return _UserRule(library.adan(), dict(beta1=b1, beta2=b2, beta3=b3, eps=eps,
                                          eps_root=eps_root, weight_decay=weight_decay),
                     name="adan")


def adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0, weight_decay=0.0,
         mask=None, *, flat_state=True) -> optax.GradientTransformation:
    """optax.adan on the rule `mtapply.rules.library.adan` (optax's arguments; mask only takes
    its default). The state is `AdanState(count, m, v, n, prev_grad)`."""
    return _transformation(_adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask),
                           learning_rate, flat_state)


def fused_adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=0.0,
               weight_decay=0.0, mask=None) -> FusedOptimizer:
    """`adan` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_adan_rule(b1, b2, b3, eps, eps_root, weight_decay, mask), learning_rate)


def _adagrad_rule(initial_accumulator_value, eps) -> _UserRule:
    if _is_number(initial_accumulator_value):
        check_number("initial_accumulator_value", initial_accumulator_value, low=0.0)
    return _UserRule(library.adagrad_optax(), dict(eps=eps), name="adagrad",
                     initial={"sum_of_squares": initial_accumulator_value})


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7, *,
            flat_state=True) -> optax.GradientTransformation:
    """optax.adagrad on the rule `mtapply.rules.library.adagrad_optax`: s += g^2;
    p -= lr * g / sqrt(s + eps) (no step where s is 0). State `AdagradOptaxState(count,
    sum_of_squares)`."""
    return _transformation(_adagrad_rule(initial_accumulator_value, eps), learning_rate,
                           flat_state)


def fused_adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7) -> FusedOptimizer:
    """`adagrad` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_adagrad_rule(initial_accumulator_value, eps), learning_rate)


def _rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered, momentum, nesterov,
                  bias_correction) -> _UserRule:
    _refuse("rmsprop", bias_correction=(bias_correction, False))
    if nesterov and momentum is None:
        raise ValueError("mtapply.optax.rmsprop: nesterov=True needs a momentum")
    rule = library.rmsprop_optax(bool(centered), momentum is not None, bool(nesterov),
                                 bool(eps_in_sqrt))
    hyper = dict(decay=decay, eps=eps) | ({} if momentum is None else dict(momentum=momentum))
    if _is_number(initial_scale):
        check_number("initial_scale", initial_scale)
    return _UserRule(rule, hyper, initial={"nu": initial_scale}, name="rmsprop")


def rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
            centered=False, momentum=None, nesterov=False, bias_correction=False, *,
            flat_state=True) -> optax.GradientTransformation:
    """optax.rmsprop on the rule `mtapply.rules.library.rmsprop_optax`, with optax's arguments
    (bias_correction only takes its default)."""
    return _transformation(_rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered,
                                         momentum, nesterov, bias_correction),
                           learning_rate, flat_state)


def fused_rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
                  centered=False, momentum=None, nesterov=False,
                  bias_correction=False) -> FusedOptimizer:
    """`rmsprop` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_rmsprop_rule(decay, eps, initial_scale, eps_in_sqrt, centered, momentum,
                                nesterov, bias_correction), learning_rate)


def _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps, weight_decay,
                        weight_lr_power, state_dtype):
    if warmup_steps is not None:
        learning_rate = optax.warmup_constant_schedule(0.0, learning_rate, warmup_steps)
    dtype = _state_dtype("schedule_free_adamw", "state_dtype", state_dtype)
    return _ScheduleFree(b1, b2, eps, weight_decay, weight_lr_power, dtype), learning_rate


def schedule_free_adamw(learning_rate=0.0025, *, warmup_steps=None, b1=0.9, b2=0.999, eps=1e-8,
                        weight_decay=0.0, weight_lr_power=2.0, state_dtype=None,
                        flat_state=True) -> optax.GradientTransformation:
    """optax.contrib.schedule_free_adamw on the rule `mtapply.rules.library.schedule_free_adamw`
    (optax's arguments; state_dtype is z's dtype). The params are schedule-free's y;
    evaluate with `schedule_free_eval_params(state, params)`. State
    `ScheduleFreeAdamwState(count, z, nu, weight_sum, max_lr, b1)`."""
    rule, learning_rate = _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps,
                                              weight_decay, weight_lr_power, state_dtype)
    return _transformation(rule, learning_rate, flat_state)


def fused_schedule_free_adamw(learning_rate=0.0025, *, warmup_steps=None, b1=0.9, b2=0.999,
                              eps=1e-8, weight_decay=0.0, weight_lr_power=2.0,
                              state_dtype=None) -> FusedOptimizer:
    """`schedule_free_adamw` as a fused step: `opt.step(params, grads, state)`."""
    rule, learning_rate = _schedule_free_rule(learning_rate, warmup_steps, b1, b2, eps,
                                              weight_decay, weight_lr_power, state_dtype)
    return _fused(rule, learning_rate)


def schedule_free_eval_params(state, params):
    """The params to evaluate with (schedule-free's x) from a `schedule_free_adamw` state (or a
    chain's holding one) and the trained params y: (y - (1 - b1) z) / b1."""
    found = [node for node in jax.tree.leaves(state, is_leaf=lambda n: hasattr(n, "max_lr"))
             if hasattr(node, "max_lr")]
    if not found:
        raise ValueError("schedule_free_eval_params needs the state of schedule_free_adamw")
    z, b1 = tree_state(found[0], params).z, found[0].b1
    return jax.tree.map(lambda y, zi: (y - (1.0 - b1) * zi) / b1, params, z)


def transformation(rule, learning_rate, *, flat_state=True,
                   **hyper) -> optax.GradientTransformation:
    """A user-written rule (`mtapply.rule`) as an optax transformation, like `adam`:
    learning_rate (a number, array or schedule) is the rule's `lr`; the other hyperparameters
    are numbers (the rule's defaults where not given). The state holds `count` and each
    read-written slot besides param, zero at first."""
    return _transformation(_UserRule(rule, hyper), learning_rate, flat_state)


def alias(rule) -> Callable:
    """The rule as an optax factory, like `adam`: `alias(rule)(learning_rate, **hyper,
    flat_state=True)` is `transformation(rule, ...)`, and its signature lists the rule's
    hyperparameters with their defaults, so that `optax.inject_hyperparams(alias(rule))` can
    hold each of them in its state (and change them between steps).

    Example:
        >>> tx = optax.inject_hyperparams(mtapply.optax.alias(my_rule))(learning_rate=1e-3)
    """
    kinds = inspect.Parameter
    signature = inspect.Signature(
        [kinds("learning_rate", kinds.POSITIONAL_OR_KEYWORD)]
        + [kinds(name, kinds.KEYWORD_ONLY, **({} if default is None else {"default": default}))
           for name, default in rule.hyper.items() if name != "lr"]
        + [kinds("flat_state", kinds.KEYWORD_ONLY, default=True)])

    def factory(learning_rate, *, flat_state=True, **hyper):
        return transformation(rule, learning_rate, flat_state=flat_state, **hyper)

    factory.__signature__ = signature
    factory.__name__ = factory.__qualname__ = rule.name
    return factory


def fused(rule, learning_rate, **hyper) -> FusedOptimizer:
    """A user-written rule as a fused step, like `fused_adam`."""
    return _fused(_UserRule(rule, hyper), learning_rate)


__all__ = ["AdamState", "FusedOptimizer", "LambState", "LarsState", "SgdState", "adagrad", "adam",
           "alias",
           "adamw", "adan", "flat_state", "fused", "fused_adagrad", "fused_adam", "fused_adamw",
           "fused_adan", "fused_lamb", "fused_lars", "fused_lion", "fused_multi_transform",
           "fused_rmsprop", "fused_schedule_free_adamw", "fused_sgd", "lamb", "lars", "lion",
           "multi_transform", "rmsprop", "schedule_free_adamw", "schedule_free_eval_params",
           "sgd", "transformation", "tree_state"]
