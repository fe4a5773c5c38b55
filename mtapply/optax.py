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

`adam`, `adamw`, `sgd`, `lars` and `lamb` take optax's arguments and return
`optax.GradientTransformation`s whose `update` returns deltas (new params - params), as optax's
contract requires, so they compose with `optax.chain` and `optax.apply_updates`. The fused forms
(`fused_adam`, ...) return `FusedOptimizer(init, step, donated_step)`: `step(params, grads,
state) -> (params, state)` writes the new params and state into the buffers of the old ones when
the enclosing `jax.jit` donates them (`donated_step` is `step` jitted with params and state
donated), so a step moves each tensor through memory once. Prefer it: the transformation form
also writes a copy of the params and subtracts.

How it runs. Each update is one `jax.experimental.buffer_callback` (jax >= 0.6.1) inside a
jitted function, also when called eagerly. Its outputs (params and state) alias its inputs
(`input_output_aliases`), so XLA hands the callback buffers that already hold the old values:
the inputs themselves when they are donated and used nowhere else, otherwise fresh copies. An
array the caller still holds is therefore never written. The callback gives those buffers to
mtapply through DLPack and launches the whole tree in one plan step (one kernel launch per dtype
group; two for LARS and LAMB) on XLA's own stream (`ctx.stream`), with lr and the step count
read by the kernel from device memory: no host synchronisation. On the CPU the same callback
runs mtapply's NumPy backend on XLA's host buffers. Plans are cached by buffer addresses, so a
training loop whose buffers recur (the usual case with donation) does O(1) host work per step
besides reading the addresses; when only the grads move, the plan is rebound to them. With
MTAPPLY_OPTAX_CALLBACK=host (read at trace time) the update is a `jax.pure_callback` into the
NumPy backend instead: a slow fallback that copies through the host (no bfloat16).

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
- lamb: Apex FusedLAMB (see `mtapply.LAMBSpec`). Without weight decay the trust ratio applies
  only with use_nvlamb=True (optax.lamb always applies it); equal to optax.lamb when it applies.
Only learning_rate may be a schedule or an array; the other hyperparameters are Python numbers
fixed at construction (so `optax.inject_hyperparams` can drive learning_rate only).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _xla
from ._dlpack import TensorRef, export, row_major_strides
from .engine import Plan
from .ops import AdamSpec, LAMBSpec, LARSSpec, SGDSpec
from .ops._spec import DeviceScalar, check_number

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # jax < 0.6.1: only the host fallback works
    buffer_callback = None

_CALLBACK_ENV = "MTAPPLY_OPTAX_CALLBACK"
_PLANS_PER_TREE = 4  # plans kept per tree signature, keyed by buffer addresses
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


class FusedOptimizer(NamedTuple):
    """The fused form: `step(params, grads, state) -> (params, state)`.

    `step` is pure; inside a `jax.jit` that donates params and state it updates them in place.
    `donated_step` is `step` jitted with params and state donated (they are invalid afterwards).
    The state keeps each moment of every param in one flat buffer per dtype (so a step passes
    a few arrays, not one per param); `tree_state(state, params)` gives it as pytrees like
    params, as the transformation form keeps it (for inspection and checkpoints), and
    `flat_state(tree_state, params)` makes such a state flat again.
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
    `spec(statics)` the op itself."""

    name = ""
    state_type: type = AdamState
    slots: tuple = ()
    plan_slots: tuple = ()
    reads_params = True  # False: the update ignores the params' values
    global_norm = False  # the step takes the gradients' global L2 norm

    def statics(self, params, treedef) -> tuple:
        return ()

    def spec(self, statics):
        raise NotImplementedError

    def step_args(self, lr, step, norm=None) -> dict:
        raise NotImplementedError


class _Adam(_Rule):
    name, state_type, slots = "adam", AdamState, ("mu", "nu")
    plan_slots = ("params", "exp_avgs", "exp_avg_sqs", "grads")

    def __init__(self, b1, b2, eps, weight_decay):
        self.hyper = dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay)
        _check(AdamSpec().arguments, lr=0.0, step=1, **self.hyper)
        self.reads_params = weight_decay != 0

    def spec(self, statics):
        return AdamSpec(decoupled_weight_decay=True)

    def step_args(self, lr, step, norm=None) -> dict:
        return dict(lr=lr, step=step, **self.hyper)


class _Sgd(_Rule):
    name, state_type, reads_params = "sgd", SgdState, False

    def __init__(self, momentum, nesterov):
        self.momentum = 0.0 if momentum is None else momentum
        self.nesterov = bool(nesterov) and self.momentum != 0
        self.slots = ("trace",) if self.momentum != 0 else ()
        self.plan_slots = ("params",) + (("momentum_buffers",) if self.slots else ()) + ("grads",)
        _check(SGDSpec(nesterov=self.nesterov).arguments, lr=0.0, step=1, momentum=self.momentum)

    def spec(self, statics):
        return SGDSpec(momentum_buffers=bool(self.slots), nesterov=self.nesterov)

    def step_args(self, lr, step, norm=None) -> dict:
        return dict(lr=lr, step=step, momentum=self.momentum)


class _Lars(_Rule):
    name, state_type, slots = "lars", LarsState, ("momentum",)
    plan_slots = ("params", "momentum_buffers", "grads")

    def __init__(self, weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask):
        self.hyper = dict(momentum=momentum, weight_decay=weight_decay,
                          trust_coefficient=trust_coefficient, eps=eps)
        _check(LARSSpec().arguments, lr=0.0, **self.hyper)
        self.trust_ratio_mask, self.weight_decay_mask = trust_ratio_mask, weight_decay_mask

    def statics(self, params, treedef) -> tuple:
        """mtapply's `exclude` flags: a tensor is excluded from both the trust ratio and weight
        decay, so the two masks must agree wherever weight decay is on."""
        adapt = _mask_leaves(self.trust_ratio_mask, params, treedef, "trust_ratio_mask")
        decay = _mask_leaves(self.weight_decay_mask, params, treedef, "weight_decay_mask")
        if self.hyper["weight_decay"] != 0 and adapt != decay:
            raise ValueError("mtapply.optax.lars excludes a tensor from both the trust ratio and "
                             "weight decay: pass the same weight_decay_mask and trust_ratio_mask")
        return tuple(not a for a in adapt)

    def spec(self, statics):
        return LARSSpec(exclude=list(statics) if any(statics) else None)

    def step_args(self, lr, step, norm=None) -> dict:
        return dict(lr=lr, **self.hyper)


class _Lamb(_Rule):
    name, state_type, slots = "lamb", LambState, ("mu", "nu")
    plan_slots = ("params", "exp_avgs", "exp_avg_sqs", "grads")

    def __init__(self, b1, b2, eps, weight_decay, adam_w_mode, use_nvlamb, grad_averaging,
                 bias_correction, max_grad_norm):
        self.hyper = dict(beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                          grad_averaging=grad_averaging, bias_correction=bias_correction,
                          max_grad_norm=max_grad_norm)
        self.flags = dict(adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb)
        _check(LAMBSpec(**self.flags).arguments, lr=0.0, step=1, global_grad_norm=0.0,
               **self.hyper)
        self.global_norm = max_grad_norm > 0

    def spec(self, statics):
        return LAMBSpec(**self.flags)

    def step_args(self, lr, step, norm=None) -> dict:
        return dict(lr=lr, step=step, global_grad_norm=norm, **self.hyper)


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
    """Runs a rule over whole pytrees. Holds the learning rate and the plans of its callbacks.

    With `flat` (the fused forms) each state slot is one buffer per dtype holding every leaf's
    state (`_FlatLayout`), so a jitted step passes two arrays per slot instead of one per leaf:
    JAX's dispatch, a few microseconds per array, then stays below the kernel's time."""

    def __init__(self, rule: _Rule, learning_rate, flat: bool = False):
        if not callable(learning_rate) and not hasattr(learning_rate, "dtype"):
            check_number("learning_rate", learning_rate, low=0.0)
        self.rule, self.learning_rate, self.flat = rule, learning_rate, flat
        self._plans: OrderedDict = OrderedDict()  # the callbacks' plans, by buffer addresses
        self._ffi_plans: dict = {}  # the FFI handler's plan ids, by tree signature
        self._lock = threading.Lock()  # XLA may run callbacks from several threads

    def init(self, params):
        """The rule's state: count 0 and zero buffers like params (optax's initial state)."""
        if self.flat:
            layout = _FlatLayout(jax.tree.leaves(params))
            zeros = [layout.zeros() for _ in self.rule.slots]
        else:
            zeros = [jax.tree.map(jnp.zeros_like, params) for _ in self.rule.slots]
        return self.rule.state_type(jnp.zeros([], jnp.int32), *zeros)

    def tree_state(self, state, params):
        """A flat state with each slot as a pytree like params (copies)."""
        leaves, treedef = jax.tree.flatten(params)
        layout = _FlatLayout(leaves)
        slots = [treedef.unflatten(layout.split(layout.buffers_of(getattr(state, s), s)))
                 for s in self.rule.slots]
        return self.rule.state_type(state.count, *slots)

    def flat_state(self, state, params):
        """A state whose slots are pytrees like params, made flat (copies)."""
        leaves, treedef = jax.tree.flatten(params)
        layout = _FlatLayout(leaves)
        slots = [dict(zip(layout.names, layout.join(treedef.flatten_up_to(getattr(state, s)))))
                 for s in self.rule.slots]
        return self.rule.state_type(state.count, *slots)

    def apply(self, params, grads, state):
        """(new params, new state) after one step; traceable, and traced by the callers."""
        leaves, treedef = jax.tree.flatten(params)
        grad_leaves = treedef.flatten_up_to(grads)
        layout = _FlatLayout(leaves) if self.flat else None
        if layout is None:
            slot_values = [treedef.flatten_up_to(getattr(state, s)) for s in self.rule.slots]
        else:
            slot_values = [layout.buffers_of(getattr(state, s), s) for s in self.rule.slots]
        count = state.count
        scalars = [self._learning_rate(count), (count + 1).astype(jnp.float32).reshape(1)]
        if self.rule.global_norm:
            scalars.append(_global_norm(grads).astype(jnp.float32).reshape(1))
        written = leaves + [x for values in slot_values for x in values]
        if leaves:
            statics = self.rule.statics(params, treedef)
            written = self._launch(written, grad_leaves, scalars, statics, layout)
        n, m = len(leaves), len(slot_values[0]) if slot_values else 0
        new_values = [written[n + k * m: n + (k + 1) * m] for k in range(len(self.rule.slots))]
        if layout is None:
            new_slots = [treedef.unflatten(values) for values in new_values]
        else:
            new_slots = [dict(zip(layout.names, values)) for values in new_values]
        new_state = self.rule.state_type(optax.safe_increment(count), *new_slots)
        return treedef.unflatten(written[:n]), new_state

    def _learning_rate(self, count):
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        return jnp.asarray(lr, jnp.float32).reshape(1)

    def _launch(self, written: list, grads: list, scalars: list, statics: tuple, layout) -> list:
        """The written arrays after the step: one FFI custom call on GPUs, else one callback."""
        signature = tuple((x.shape, str(x.dtype)) for x in written + grads)
        key = (statics, layout is not None, signature)
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written]
        mechanism = os.environ.get(_CALLBACK_ENV, "ffi")
        call = self._host_call if mechanism == "host" or buffer_callback is None else self._callback_call
        callback = functools.partial(call, key, layout, len(grads), len(scalars))
        if mechanism != "ffi" or buffer_callback is None:
            return callback(*written, *grads, *scalars)
        on_gpu = functools.partial(self._ffi_call, key, results, len(grads), len(scalars), layout,
                                   callback)
        return list(jax.lax.platform_dependent(*written, *grads, *scalars, default=callback,
                                               cuda=on_gpu))

    def _host_call(self, key, layout, n_grads, n_scalars, *operands) -> list:
        """The step as one pure callback into the NumPy backend: the slow fallback, which
        copies through the host."""
        written, grads, scalars = _split(operands, n_grads, n_scalars)
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written]
        return list(jax.pure_callback(functools.partial(self._host_callback, key, layout),
                                      results, written, grads, scalars))

    def _callback_call(self, key, layout, n_grads, n_scalars, *operands) -> list:
        """The step as one buffer callback (the CPU, or GPUs without the FFI handler)."""
        written = _split(operands, n_grads, n_scalars)[0]
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written]
        # Flat positional inputs: buffer_callback checks alias indices against them.
        call = buffer_callback(functools.partial(self._buffer_callback, key, layout, n_scalars),
                               results, input_output_aliases={i: i for i in range(len(written))})
        return list(call(*operands))

    def _ffi_call(self, key, results, n_grads, n_scalars, layout, fallback, *operands) -> list:
        """The step as one `mtapply_step` custom call: compiled code reads the buffers'
        addresses and launches the kernels, no Python at run time (see mtapply._xla)."""
        if not _xla.available():
            return fallback(*operands)
        with self._lock:
            plan_id = self._ffi_plans.get(key)
            if plan_id is None:
                plan_id = self._ffi_plans[key] = self._prepare(key, operands, n_grads, n_scalars,
                                                               layout)
        call = jax.ffi.ffi_call(_xla.TARGET, results,
                                input_output_aliases={i: i for i in range(len(results))})
        return list(call(*operands, plan=np.int64(plan_id)))

    def _prepare(self, key, operands, n_grads, n_scalars, layout) -> int:
        """Registers the rule's op over this tree with the FFI handler. The call's buffers are
        its results (params, then each state slot), then its arguments (the same, then the
        grads, then the scalars)."""
        spec, n = self.rule.spec(key[0]), n_grads
        n_results = len(operands) - n_grads - n_scalars
        zeros = np.zeros(n, np.int64)
        columns = {"params": (np.arange(n), zeros)}
        per_slot = (n_results - n) // max(len(self.rule.slots), 1)
        for k, name in enumerate(self.rule.plan_slots[1:-1]):
            base = n + k * per_slot
            columns[name] = ((layout.operands(base), layout.byte_offsets()) if layout is not None
                             else (base + np.arange(n), zeros))
        columns[self.rule.plan_slots[-1]] = (2 * n_results + np.arange(n), zeros)  # the grads
        operand_table = np.stack([columns[slot][0] for slot in spec.slots], axis=1)
        offset_table = np.stack([columns[slot][1] for slot in spec.slots], axis=1)
        # an operand index counts the results first; a written input aliases its result
        array_of = [operands[i if i < n_results else i - n_results] for i in range(2 * n_results + n)]
        dtypes = [tuple(str(array_of[j].dtype) for j in row) for row in operand_table]
        params = operands[:n]
        numels = [int(np.prod(x.shape, dtype=np.int64)) for x in params]
        placeholders = [_xla.placeholder(k) for k in range(n_scalars)]
        hyper = self.rule.step_args(*placeholders)
        scalar_operands = {name: 2 * n_results + n + value.obj for name, value in hyper.items()
                           if isinstance(value, DeviceScalar)}
        devices = sorted({d.local_hardware_id if d.local_hardware_id is not None else d.id
                          for d in jax.local_devices(backend="gpu")})
        return _xla.prepare(spec, operand_table, offset_table, dtypes, numels, hyper,
                            scalar_operands, devices)

    def _buffer_callback(self, key, layout, n_scalars, ctx, outs, *inputs) -> None:
        """Steps XLA's buffers in place: `outs` alias the first inputs, so they hold the old
        values; then come the grads and the scalars. Flat state is stepped through views of
        each leaf's part of its buffer."""
        grads, scalars = inputs[len(outs):-n_scalars], inputs[-n_scalars:]
        outs, grads = [_XlaBuffer(b) for b in outs], [_XlaBuffer(b) for b in grads]
        if layout is not None:
            outs = outs[:len(grads)] + layout.views(
                [export(b, "state", None) for b in outs[len(grads):]])
        kind, device_id = outs[0].__dlpack_device__()
        if kind == _DLPACK_CPU:
            values = [float(np.asarray(s).reshape(-1)[0]) for s in scalars]
            self._step(key, outs, grads, values, None)
            return
        import cupy

        stream = ctx.stream
        # CuPy's pool then orders the reuse of a plan's memory on XLA's stream.
        with cupy.cuda.Device(device_id), _cupy_stream(stream, device_id):
            values = [DeviceScalar(ptr=_device_address(s), obj=None) for s in scalars]
            self._step(key, outs, grads, values, stream)

    def _host_callback(self, key, layout, written, grads, scalars) -> list:
        """The host fallback: new arrays from NumPy copies, through a fresh plan."""
        outs = [np.array(x, copy=True) for x in written]
        values = [float(np.asarray(s).reshape(-1)[0]) for s in scalars]
        leaves = outs
        if layout is not None:
            leaves = outs[:len(grads)] + layout.views([export(b, "state", None)
                                                       for b in outs[len(grads):]])
        plan = self._new_plan(key, leaves, [np.asarray(g) for g in grads], None)
        plan.step(**self.rule.step_args(*values))
        return outs

    def _step(self, key, outs: list, grads: list, scalars: list, stream) -> None:
        """One plan step over the buffers. Plans are cached by the buffers' addresses, which
        recur in a training loop. On a miss where only one slot moved (typically fresh grads
        while params and state stay in place) a plan of the tree is rebound to them."""
        columns = _columns(outs + grads, len(grads))
        with self._lock:
            plan = self._plans.pop((key, columns), None)
            if plan is None:
                plan = self._moved_plan(key, columns, outs + grads, stream)
            if plan is None:
                plan = self._new_plan(key, outs, grads, stream)
            self._plans[(key, columns)] = plan
            mine = [k for k in self._plans if k[0] == key]
            for old_key in mine[:-_PLANS_PER_TREE]:
                del self._plans[old_key]
            plan.step(stream=stream, **self.rule.step_args(*scalars))

    def _moved_plan(self, key, columns: tuple, buffers: list, stream):
        """The most recent plan of `key` whose buffers differ from `columns` in one slot only,
        rebound to `buffers`; None if there is none. (Rebinding several slots one by one could
        meet stale addresses that XLA has since given to another slot.)"""
        n = len(columns[0])
        for old_key in reversed([k for k in self._plans if k[0] == key]):
            moved = [i for i, (old, new) in enumerate(zip(old_key[1], columns)) if old != new]
            if len(moved) == 1:
                plan, i = self._plans.pop(old_key), moved[0]
                # XLA's buffers have the traced shapes and dtypes, dense: only addresses change.
                plan.rebind_addresses(self.rule.plan_slots[i], buffers[i * n: (i + 1) * n],
                                      np.asarray(columns[i], np.uint64), stream=stream)
                return plan
        return None

    def _new_plan(self, key, outs: list, grads: list, stream):
        n = len(grads)
        buffers = outs + grads
        columns = {name: buffers[c * n: (c + 1) * n] for c, name in enumerate(self.rule.plan_slots)}
        return Plan(self.rule.spec(key[0]), columns, stream=stream)


def _split(operands: tuple, n_grads: int, n_scalars: int) -> tuple:
    """(written, grads, scalars) of a step's operands."""
    n_written = len(operands) - n_grads - n_scalars
    return (operands[:n_written], operands[n_written: n_written + n_grads],
            operands[n_written + n_grads:])


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

    def zeros(self) -> dict:
        return {name: jnp.zeros(max(self.sizes[name], 1), name) for name in self.names}

    def buffers_of(self, slot: dict, field: str) -> list:
        """The slot's buffers in layout order, checked against the layout."""
        if not isinstance(slot, dict) or set(slot) != set(self.names):
            raise ValueError(f"state.{field} holds {type(slot).__name__}, not this optimizer's flat "
                             f"state for these params: make the state with its init(params)")
        buffers = [slot[name] for name in self.names]
        for name, buffer in zip(self.names, buffers):
            if buffer.shape != (max(self.sizes[name], 1),):
                raise ValueError(f"state.{field}[{name!r}] has shape {buffer.shape}, not that of "
                                 f"these params' state ({max(self.sizes[name], 1)},): make the "
                                 f"state with init(params)")
        return buffers

    def split(self, buffers) -> list:
        """Each leaf's state, cut out of the buffers (copies)."""
        by_name = dict(zip(self.names, buffers))
        return [by_name[d.name][o: o + int(np.prod(s, dtype=np.int64))].reshape(s)
                for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]

    def join(self, leaves) -> list:
        """The buffers holding `leaves` (one per leaf, in order) at their offsets."""
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


def _columns(buffers: list, n: int) -> tuple:
    """The buffers' addresses, one tuple per slot of n buffers."""
    addresses = [b.ptr if isinstance(b, TensorRef) else b.address() for b in buffers]
    return tuple(tuple(addresses[i: i + n]) for i in range(0, len(addresses), n))


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


class _StreamRef:
    """XLA's stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _cupy_stream(handle: int, device_id: int):
    """XLA's stream as a CuPy stream (CuPy 14's from_external; ExternalStream before it)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamRef(handle))
    return cupy.cuda.ExternalStream(handle, device_id)


# ---------------------------------------------------------------------------------------------
# Public constructors.


def _transformation(rule: _Rule, learning_rate) -> optax.GradientTransformation:
    """An optax.GradientTransformation whose update returns new params - params."""
    engine = _Engine(rule, learning_rate)

    def update(updates, state, params=None):
        if not rule.reads_params:  # the step from zero params is the update itself
            zeros = jax.tree.map(jnp.zeros_like, updates)
            return engine.apply(zeros, updates, state)
        if params is None:
            raise ValueError(f"mtapply.optax.{rule.name} with these options reads the params: "
                             f"call update(grads, state, params)")
        new_params, state = engine.apply(params, updates, state)
        return jax.tree.map(lambda new, old: new - old, new_params, params), state

    return optax.GradientTransformation(engine.init, jax.jit(update))


def _fused(rule: _Rule, learning_rate) -> FusedOptimizer:
    engine = _Engine(rule, learning_rate, flat=True)
    return FusedOptimizer(engine.init, jax.jit(engine.apply),
                          jax.jit(engine.apply, donate_argnums=(0, 2)), engine.tree_state,
                          engine.flat_state)


def _refuse(name: str, **options) -> None:
    """NotImplementedError for optax options mtapply's kernels do not have."""
    for option, (value, default) in options.items():
        if value is not default and value != default:
            raise NotImplementedError(f"mtapply.optax.{name}: {option}={value!r} is not supported "
                                      f"(only {option}={default!r}); use optax.{name} for it")


def _adam_rule(name, b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay=0.0, mask=None):
    _refuse(name, eps_root=(eps_root, 0.0), mu_dtype=(mu_dtype, None), nesterov=(nesterov, False),
            mask=(mask, None))
    if callable(weight_decay):
        raise TypeError(f"mtapply.optax.{name}: weight_decay must be a number, not a schedule")
    return _Adam(b1, b2, eps, weight_decay)


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
         nesterov=False) -> optax.GradientTransformation:
    """optax.adam on mtapply's fused kernel (update: -lr * m_hat / (sqrt(v_hat) + eps)).

    Args:
        learning_rate: a number, a scalar array, or an optax schedule of the step count.
        b1, b2, eps: as optax.adam. eps_root, mu_dtype and nesterov only take their defaults.

    Returns:
        An optax.GradientTransformation with state `AdamState(count, mu, nu)`.

    Example:
        >>> tx = optax.chain(optax.clip_by_global_norm(1.0), mtapply.optax.adam(1e-3))
    """
    return _transformation(_adam_rule("adam", b1, b2, eps, eps_root, mu_dtype, nesterov),
                           learning_rate)


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
          weight_decay=1e-4, mask=None, *, nesterov=False) -> optax.GradientTransformation:
    """optax.adamw on mtapply's fused kernel: p -= lr * (u + weight_decay * p), u as in `adam`.

    Args as optax.adamw; weight_decay is a number; mask (weight decay on some leaves only),
    eps_root, mu_dtype and nesterov only take their defaults. Params are required by update.
    """
    rule = _adam_rule("adamw", b1, b2, eps, eps_root, mu_dtype, nesterov, weight_decay, mask)
    return _transformation(rule, learning_rate)


def sgd(learning_rate, momentum=None, nesterov=False,
        accumulator_dtype=None) -> optax.GradientTransformation:
    """optax.sgd on mtapply's fused kernel: t = g + momentum * t; p -= lr * t (Nesterov:
    p -= lr * (g + momentum * t)). momentum None or 0 keeps no trace.

    Returns:
        An optax.GradientTransformation with state `SgdState(count, trace)`.
    """
    _refuse("sgd", accumulator_dtype=(accumulator_dtype, None))
    return _transformation(_Sgd(momentum, nesterov), learning_rate)


def lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
         eps=0.0, trust_ratio_mask=True, momentum=0.9,
         nesterov=False) -> optax.GradientTransformation:
    """mtapply's LARS (Paddle's lars_momentum, You et al. 2017) with optax.lars's arguments.

    Per tensor: local_lr = lr * trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps) (lr when a
    norm is 0); v = momentum * v + local_lr * (g + wd * p); p -= v. A leaf whose
    trust_ratio_mask is False takes a plain momentum step with lr and no weight decay, so
    weight_decay_mask must equal trust_ratio_mask when weight_decay > 0. Differs from optax.lars
    when weight_decay > 0 (see the module docstring); nesterov is not supported.

    Returns:
        An optax.GradientTransformation with state `LarsState(count, momentum)`.
    """
    _refuse("lars", nesterov=(nesterov, False))
    rule = _Lars(weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask)
    return _transformation(rule, learning_rate)


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None,
         *, adam_w_mode=True, use_nvlamb=False, grad_averaging=True, bias_correction=True,
         max_grad_norm=0.0) -> optax.GradientTransformation:
    """LAMB with Apex FusedLAMB's semantics (`mtapply.LAMBSpec`) and optax.lamb's arguments.

    u = m_hat / (sqrt(v_hat) + eps) + wd * p;  p -= lr * ||p|| / ||u|| * u, the trust ratio
    applied when weight_decay != 0 or use_nvlamb (optax.lamb: always). max_grad_norm > 0 divides
    the grads by global_norm / max_grad_norm when that exceeds 1 (norm computed in the step).
    eps_root and mask only take their defaults.

    Returns:
        An optax.GradientTransformation with state `LambState(count, mu, nu)`.
    """
    return _transformation(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode,
                                      use_nvlamb, grad_averaging, bias_correction, max_grad_norm),
                           learning_rate)


def _lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
               grad_averaging, bias_correction, max_grad_norm) -> _Lamb:
    _refuse("lamb", eps_root=(eps_root, 0.0), mask=(mask, None))
    return _Lamb(b1, b2, eps, weight_decay, adam_w_mode, use_nvlamb, grad_averaging,
                 bias_correction, max_grad_norm)


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
    _refuse("sgd", accumulator_dtype=(accumulator_dtype, None))
    return _fused(_Sgd(momentum, nesterov), learning_rate)


def fused_lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
               eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False) -> FusedOptimizer:
    """`lars` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    _refuse("lars", nesterov=(nesterov, False))
    rule = _Lars(weight_decay, trust_coefficient, eps, momentum, trust_ratio_mask,
                 weight_decay_mask)
    return _fused(rule, learning_rate)


def fused_lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0,
               mask=None, *, adam_w_mode=True, use_nvlamb=False, grad_averaging=True,
               bias_correction=True, max_grad_norm=0.0) -> FusedOptimizer:
    """`lamb` as a fused step: `opt.step(params, grads, state) -> (params, state)`."""
    return _fused(_lamb_rule(b1, b2, eps, eps_root, weight_decay, mask, adam_w_mode, use_nvlamb,
                             grad_averaging, bias_correction, max_grad_norm), learning_rate)


__all__ = ["AdamState", "FusedOptimizer", "LambState", "LarsState", "SgdState", "adam", "adamw",
           "fused_adam", "fused_adamw", "fused_lamb", "fused_lars", "fused_sgd", "lamb", "lars",
           "sgd"]
