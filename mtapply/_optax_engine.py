"""The engine of `mtapply.optax`: one call per update (the FFI custom call on GPUs, a buffer
callback elsewhere), one plan step per call."""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
from collections import OrderedDict
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _xla
from ._dlpack import TensorRef, export
from ._launch import cupy_stream
from ._optax_ops import OptaxRule, is_array, zero_if_rounded_below
from ._optax_state import FLOATS, FlatLayout, flat_for, leaf_struct, tree_state
from .ops._spec import DeviceScalar, check_number
from .plan import Plan
from .rules._spec import sum_dtype_of

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # jax < 0.6.1: only the host fallback works
    buffer_callback = None

_CALLBACK_ENV = "MTAPPLY_OPTAX_CALLBACK"
_PLANS_PER_TREE = 4  # plans kept per tree signature, keyed by buffer addresses
_OPERANDS_PER_CALL = 3072  # per-leaf operands and results of one call (see Engine.apply)
_DLPACK_CPU = 1
_CARRIED = "scalars_out"  # the column of a rule's scalar state: a step argument, not a slot


# ---------------------------------------------------------------------------------------------
# The engine: one callback per update, one plan step per callback.


class Engine:
    """Runs a rule over whole pytrees. Holds the learning rate and the plans of its calls.

    A step is one call (the FFI custom call on GPUs, else a buffer callback) whose operands are
    grouped in columns, one per slot of the op (`_Column`): those updated in place (results that
    alias their operands), fresh results (updates), and inputs only read (grads; params when
    the step returns updates). The fused forms update params in place ("inplace"); the
    transformations return updates, computed by the kernel as new - old params ("delta") or,
    for rules that do not read params, as the step from zero params ("zero").

    With `flat` (the fused forms) each state slot is one buffer per dtype holding every leaf's
    state (`FlatLayout`), so a jitted step passes two arrays per slot instead of one per leaf:
    JAX's dispatch, a few microseconds per array, then stays below the kernel's time."""

    def __init__(self, rule: OptaxRule, learning_rate, flat: bool = False):
        if not callable(learning_rate) and not hasattr(learning_rate, "dtype"):
            check_number("learning_rate", learning_rate, low=0.0)
        self.rule, self.learning_rate = rule, learning_rate
        self.flat = flat and not rule.tree_state  # (8-bit state: a tree, its shapes its own)
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
            layouts = self._layouts(leaves) if flat_for(self.flat, leaves) else {}
            slots = [self.rule.init_slot(field, params, layouts.get(field))
                     for field in self.rule.slots]
        return self.rule.state_type(jnp.zeros([], jnp.int32), *slots,
                                    *self.rule.scalar_init(_carried_dtype(leaves)))

    def _layouts(self, leaves: list, state=None) -> dict:
        """State field -> its flat layout over these leaves: the params' dtypes, or the field's
        own (mu_dtype and the like). Given `state` (an update without params, whose leaves are
        the grads), a slot of one buffer keeps that buffer's dtype: the params' at init. A rule
        whose slots are shaped otherwise gives each leaf's slot itself (`slot_structs`)."""
        structs = [leaf_struct(x) for x in leaves]
        shaped = getattr(self.rule, "slot_structs", None)
        if shaped is not None:  # slots not shaped as the params (factored state)
            return {field: FlatLayout(shaped(field, structs)) for field in self.rule.slots}
        by_dtype: dict = {}
        dtypes = {}
        for field in self.rule.slots:
            dtype = self.rule.slot_dtypes.get(field)
            slot = getattr(state, field, None)
            if dtype is None and isinstance(slot, dict) and len(slot) == 1:
                dtype = jnp.dtype(next(iter(slot)))
            elif dtype is None and isinstance(slot, dict) and set(slot) != {
                    str(x.dtype) for x in structs}:  # (buffers of several dtypes)
                raise ValueError(
                    f"mtapply.optax.{self.rule.name}: the state keeps params of "
                    f"{' and '.join(sorted(slot))} in buffers by dtype, and grads of other "
                    f"dtypes cannot say which leaf is which: pass the params too, "
                    f"update(grads, state, params)")
            if dtype not in by_dtype:
                by_dtype[dtype] = FlatLayout(structs if dtype is None else [
                    jax.ShapeDtypeStruct(s.shape, dtype) for s in structs])
            dtypes[field] = dtype
        return {field: by_dtype[dtypes[field]] for field in self.rule.slots}

    def apply(self, params, grads, state, mode: str = "inplace", schedule_count=None):
        """(new params, new state) after one step, or (updates, new state) in the "delta" and
        "zero" modes (in "zero" params may be None); traceable, and traced by the callers.
        `schedule_count`: the count a learning-rate schedule takes, where a chain's state
        keeps its own (else the state's).

        The tree is stepped a thousand leaves or so per call (see the module docstring), the
        flat state's buffers passing through the calls in turn."""
        leaves, treedef = jax.tree.flatten(grads if mode == "zero" else params)
        like_params = treedef.flatten_up_to(grads if params is None else params)
        _check_leaves(self.rule.name, grads if params is None else params,
                      "grads" if params is None else "params")
        state_names = self.rule.plan_slots[1:-1]
        layouts = None
        if self.flat and len(like_params) == 1:  # one leaf: its slots like params (`flat_for`),
            state = tree_state(state, treedef.unflatten(like_params))  # older states were flat
        if flat_for(self.flat, like_params):
            by_field = self._layouts(like_params, state if params is None else None)
            layouts = {name: by_field[field] for name, field in zip(state_names, self.rule.slots)}
        slots = {name: self._slot_values(state, field, treedef, layouts and layouts[name])
                 for name, field in zip(state_names, self.rule.slots)}
        statics = self.rule.statics(grads if params is None else params, treedef) if leaves else ()
        extra, scalar_state = self.rule.per_step(self.learning_rate, state.count, state)
        scalars = self._scalars(state.count, grads, extra, _scalar_dtype(like_params),
                                state.count if schedule_count is None else schedule_count)
        carried = self._carried_in(state, _carried_dtype(like_params))
        step = functools.partial(self._step_part, leaves, treedef.flatten_up_to(grads), scalars,
                                 statics, layouts, mode)
        # A leaf without elements has no step: it stays out of the calls and goes through as is
        # (as an update, in the updates' dtype).
        firsts = [None if x.size else x if mode == "inplace" else
                  x.astype(self._update_dtype(x.dtype)) for x in leaves]
        per_leaf = {name: [values[i] if x.size == 0 else None for i, x in enumerate(leaves)]
                    for name, values in slots.items()} if not layouts else {}
        for part in self._parts(statics, [i for i, x in enumerate(leaves) if x.size], mode):
            if carried is not None:  # (in the part's sum dtype: its params' precision)
                carried = carried.astype(_carried_dtype([like_params[i] for i in part]))
            outs = step(part, [(name, values if layouts else [values[i] for i in part])
                               for name, values in slots.items()], carried)
            if carried is not None:  # the rule's scalar state, through the calls in turn
                carried = outs.pop(_CARRIED)[0]
            for i, x in zip(part, outs.pop("updates" if mode == "delta" else "params")):
                firsts[i] = x
            for name, values in outs.items():
                if layouts:
                    slots[name] = values
                else:
                    for i, x in zip(part, values):
                        per_leaf[name][i] = x
        read_only = dict(zip(state_names, self.rule.slots))
        new_slots = [getattr(state, read_only[name]) if name in self.rule.read_state else
                     dict(zip(layouts[name].names, slots[name])) if layouts else
                     treedef.unflatten(per_leaf[name]) for name in state_names]
        return (treedef.unflatten(firsts),
                self.rule.state_type(optax.safe_increment(state.count), *new_slots,
                                     *scalar_state,
                                     *self._carried_out(carried, _carried_dtype(like_params))))

    def _carried_in(self, state, dtype):
        """The rule's scalar state as the step takes it (`Rule.initial_scalars`): an array of
        `dtype` of three copies of the state's scalar fields, or None for rules without. Every
        copy holds the latest values, so the step's parity does not matter."""
        if not self.rule.carried:
            return None
        values = jnp.stack([jnp.asarray(getattr(state, name), dtype).reshape(())
                            for name in self.rule.carried])
        return jnp.concatenate([values, values, values])

    def _carried_out(self, carried, dtype) -> list:
        """The state's scalar fields (of `dtype`) from the array a step wrote (its latest
        values, last)."""
        if carried is None:
            return []
        n = len(self.rule.carried)
        return [carried[2 * n + k].astype(dtype) for k in range(n)]

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
        parts = [group[start: start + per_call] for group in groups
                 for start in range(0, len(group), per_call)]
        if len(parts) > 1 and getattr(self.rule, "whole_list", False):
            raise ValueError(
                f"mtapply.optax.{self.rule.name}: the rule sums over every leaf (a whole-list "
                f"sum, as clip_by_global_norm's norm), which one call computes, but this tree "
                f"of {len(stepped)} leaves takes {len(parts)} calls (at most {per_call} leaves "
                f"each): each would sum over its own part. Keep the tree to {per_call} leaves "
                f"(fewer, larger leaves; flat_state=True, the default, takes the most), or use "
                f"optax's own: optax.clip_by_global_norm before a chain, optax.contrib's prodigy "
                f"or dadapt_adamw")
        return parts

    def _step_part(self, leaves, grad_leaves, scalars, statics, layouts, mode, part: list,
                   state_part: list, carried=None) -> dict:
        """Column name -> arrays after one call over the leaves at indices `part`, with
        `state_part` the (slot, arrays) of their state and `carried` the rule's scalar state
        (or None). State slots the rule only reads (Prodigy's p0) are inputs of the call."""
        mine = [leaves[i] for i in part]
        written = [(name, arrays) for name, arrays in state_part
                   if name not in self.rule.read_state]
        aliased = (([("params", mine)] if mode == "inplace" else []) + written
                   + ([(_CARRIED, [carried])] if carried is not None else []))
        read = (([("params", mine)] if mode == "delta" else [])
                + [(name, arrays) for name, arrays in state_part if name in self.rule.read_state]
                + [(self.rule.plan_slots[-1], [grad_leaves[i] for i in part])])
        fresh = [] if mode == "inplace" else [
            ("updates" if mode == "delta" else "params",
             [jax.ShapeDtypeStruct(x.shape, self._update_dtype(x.dtype)) for x in mine])]
        return self._launch(aliased, fresh, read, scalars,
                            tuple(statics[i] for i in part) if statics else (),
                            layouts and {name: l.part(part) for name, l in layouts.items()},
                            mode, part[0])

    def _update_dtype(self, param_dtype):
        """The updates' dtype for params of `param_dtype`: optax's, which promotes the params'
        (the grads') with a state slot's own dtype (mu_dtype and the like: bfloat16 params
        with float32 moments give float32 updates)."""
        return jnp.result_type(param_dtype, *(d for d in self.rule.slot_dtypes.values()
                                              if d is not None))

    def _scalars(self, count, grads, extra, dtype, schedule_count) -> list:
        """The call's one-element operands (float32, or float64 for float64 params under
        jax_enable_x64): lr (the schedule's at `schedule_count`), the step, the grads' global
        norm where the rule takes it, the rule's per-step scalars, then its dynamic
        hyperparameters."""
        scalars = [self._learning_rate(schedule_count, dtype),
                   (count + 1).astype(dtype).reshape(1)]
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
        lr = jnp.asarray(lr, dtype)
        if lr.size != self.rule.lr_count:
            raise ValueError(f"mtapply.optax.{self.rule.name}: learning_rate must be a number (or "
                             f"a schedule giving one), got an array of shape {lr.shape}")
        return zero_if_rounded_below(lr).reshape(-1)  # one, or one per label

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
        carried = by_name.get(_CARRIED)
        if carried is not None:  # the rule's scalar state, stepped in place in its result
            hyper[_CARRIED] = DeviceScalar(ptr=0, obj=_CARRIED)
            scalar_operands[_CARRIED] = carried.start
        devices = sorted({d.local_hardware_id if d.local_hardware_id is not None else d.id
                          for d in jax.local_devices(backend="gpu")})
        elements = [int(np.prod(x.shape, dtype=np.int64)) for x in buffers]
        return _xla.prepare(spec, operand_table, offset_table, dtypes, numels, hyper,
                            scalar_operands, devices, elements,
                            _shapes(spec, by_name, layouts, buffers, operand_table))


def _shapes(spec, by_name: dict, layouts, buffers: list, operand_table) -> dict | None:
    """Spec slot -> each leaf's shape of it, for a factored rule's kernels (None for others):
    a tree slot's from its buffers, a flat slot's (laid out as the params) from its layout."""
    if not getattr(getattr(spec, "program", None), "factored", False):
        return None
    return {name: (layouts[name].shapes if by_name[name].flat
                   else [tuple(buffers[j].shape) for j in operand_table[:, s]])
            for s, name in enumerate(spec.slots)}


class _Runner:
    """What a step's callbacks run, kept apart from `Engine`: the rule without the arrays it
    was given (traced ones would otherwise stay referenced by every compiled step), and the
    plans of the calls, cached by buffer addresses."""

    def __init__(self, rule: OptaxRule):
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
        columns, carried = _split_carried(columns)
        kind, device_id = outs[0].__dlpack_device__()
        if kind == _DLPACK_CPU:
            values = [np.asarray(s).astype(np.float64).reshape(-1) for s in scalars]
            with self._in_optax_words():
                self._step(key, columns, {**self.rule.host_args(values, key[0]), **carried}, None)
            return
        import cupy

        stream = ctx.stream
        # CuPy's pool then orders the reuse of a plan's memory on XLA's stream.
        with cupy.cuda.Device(device_id), cupy_stream(stream, device_id):
            values = [DeviceScalar(ptr=_device_address(s), obj=None) for s in scalars]
            self._step(key, columns, {**self.rule.step_args(key[0], *values), **carried}, stream)

    def host_callback(self, key, layouts, n_aliased, n_scalars, *inputs) -> list:
        """The host fallback: new arrays from NumPy copies, through a fresh plan."""
        schema = key[2]
        outs = [np.array(x, copy=True) for x in inputs[:n_aliased]]
        outs += [np.empty(shape, column.dtype) for column in schema
                 if column.place == "out" and column.shapes for shape in column.shapes]
        values = [np.asarray(s).astype(np.float64).reshape(-1)
                  for s in inputs[len(inputs) - n_scalars:]]
        reads = [np.asarray(x) for x in inputs[:len(inputs) - n_scalars]]
        columns, carried = _split_carried(_buffers_by_column(schema, layouts, outs, reads))
        with self._in_optax_words():
            plan = Plan(self.spec(key), dict(columns))
            plan.step(**self.rule.host_args(values, key[0]), **carried)
        return outs

    @contextlib.contextmanager
    def _in_optax_words(self):
        """A value refused on the host (a schedule's, or one the step computes) named as
        optax's function names it."""
        try:
            yield
        except (TypeError, ValueError) as error:
            words = getattr(self.rule, "in_optax_words", None)
            if words is None:
                raise
            raise words(error) from None

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


def _static_view(rule: OptaxRule) -> OptaxRule:
    """A copy of `rule` whose array attributes (and array values of dict attributes) are None:
    what running a step needs, without keeping traced values alive."""
    view = copy.copy(rule)
    for name, value in vars(rule).items():
        if is_array(value):
            setattr(view, name, None)
        elif isinstance(value, dict) and any(is_array(v) for v in value.values()):
            setattr(view, name, {k: None if is_array(v) else v for k, v in value.items()})
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
        flat = layouts is not None and name in layouts  # a read-only state slot's buffers
        columns.append(_Column(name, "in", start, len(arrays), flat))
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


def _split_carried(columns: list) -> tuple:
    """(the plan's columns, {"scalars_out": buffer} or {}): a rule's scalar state is a step
    argument of the plan, not one of its slots."""
    carried = {name: buffers[0] for name, buffers in columns if name == _CARRIED}
    return [(name, buffers) for name, buffers in columns if name != _CARRIED], carried


def _address(buffer) -> int:
    if isinstance(buffer, TensorRef):
        return buffer.ptr
    return buffer.address()


def _check_leaves(name: str, tree, what: str) -> None:
    """TypeError naming the first leaf that the kernels cannot step (integers, complex
    numbers), raised when the step is traced."""
    leaves = jax.tree.leaves(tree)
    if all(leaf_struct(x).dtype.name in FLOATS for x in leaves):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = leaf_struct(leaf).dtype
        if dtype.name not in FLOATS:
            kind = "complex" if jnp.issubdtype(dtype, jnp.complexfloating) else "integer"
            raise TypeError(f"mtapply.optax.{name}: {what}{jax.tree_util.keystr(path)} has "
                            f"dtype {dtype.name}; mtapply's kernels step float16, bfloat16, "
                            f"float32 and float64 arrays: cast it to one of those, or use "
                            f"optax's own transformation for {kind} params")


def _scalar_dtype(leaves: list):
    """The dtype of a call's scalar operands: float64 for float64 params (jax_enable_x64),
    else float32 (what the kernels read on GPUs)."""
    wide = any(leaf_struct(x).dtype == np.float64 for x in leaves)
    return jnp.float64 if wide else jnp.float32


def _carried_dtype(leaves: list):
    """The dtype of a rule's scalar state over these params (`rules._spec.sum_dtype_of`;
    float64 only under jax_enable_x64)."""
    return jnp.dtype(sum_dtype_of(leaf_struct(x).dtype.name for x in leaves))


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
