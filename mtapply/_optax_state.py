"""The states of `mtapply.optax`: pytrees of jax arrays, kept flat (one buffer per dtype and
slot) or like params, and the conversions between the two."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._dlpack import row_major_strides


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


STATES = [AdamState, SgdState, LarsState, LambState]  # and the states of rules (UserRule)


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


def flat_for(flat: bool, leaves: list) -> bool:
    """Whether a state over these leaves is kept flat: asked for, and saving arrays (a tree
    of one leaf keeps its slots like params, as optax, whose layout it then is)."""
    return flat and len(leaves) > 1


def _convert_states(state, params, convert):
    leaves, treedef = jax.tree.flatten(params)
    structs = [leaf_struct(x) for x in leaves]

    def one(node):
        if not isinstance(node, tuple(STATES)):
            return node
        owner = getattr(type(node), "converted_by", None)
        if owner is not None and len(structs) > 1:  # (one param: its slots are a tree)
            raise ValueError(f"{type(node).__name__} is the state of {owner}, whose slots are not "
                             f"shaped like the params: convert it with that optimizer's own "
                             f"tree_state(state, params) and flat_state(optax_state, params)")
        fields = getattr(type(node), "slot_fields", node._fields[1:])
        return node._replace(**{field: convert(structs, treedef, getattr(node, field), field)
                                for field in fields if getattr(node, field) is not None})

    return jax.tree.map(one, state, is_leaf=lambda node: isinstance(node, tuple(STATES)))


def _slot_as_tree(structs, treedef, slot, field):
    """A flat slot as a pytree like params (one that already is stays). Its buffers' dtypes
    are the params' or, for a slot of another dtype (mu_dtype), that one dtype."""
    if jax.tree.structure(slot) == treedef:
        return slot
    names = {s.dtype.name for s in structs}
    if isinstance(slot, dict) and len(slot) == 1 and set(slot) != names:
        structs = [jax.ShapeDtypeStruct(s.shape, next(iter(slot))) for s in structs]
    layout = FlatLayout(structs)
    return treedef.unflatten(layout.split(layout.buffers_of(slot, field)))


def _slot_as_flat(structs, treedef, slot, field):
    """A slot that is a pytree like params as flat buffers of its leaves' dtypes (a flat one
    stays). A slot of one leaf stays a tree: that is its flat layout (`flat_for`)."""
    if len(structs) == 1:
        return _slot_as_tree(structs, treedef, slot, field)
    if jax.tree.structure(slot) != treedef and isinstance(slot, dict) and set(slot) <= set(FLOATS):
        return slot
    leaves = treedef.flatten_up_to(slot)
    layout = FlatLayout([jax.ShapeDtypeStruct(s.shape, leaf_struct(x).dtype)
                          for s, x in zip(structs, leaves)])
    return dict(zip(layout.names, layout.join(leaves)))


class FlatLayout:
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

    def part(self, indices: list) -> FlatLayout:
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
        if is_traced(buffers):
            by_name = dict(zip(self.names, buffers))
            return [by_name[d.name][o: o + size_of(s)].reshape(s)
                    for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]
        device = device_of(buffers[0])
        by_name = {name: np.asarray(buffer) for name, buffer in zip(self.names, buffers)}
        return [jax.device_put(by_name[d.name][o: o + size_of(s)].reshape(s), device)
                for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]

    def join(self, leaves) -> list:
        """The buffers holding `leaves` (one per leaf, in order) at their offsets, zero
        between them (built on the host for concrete arrays: a device concatenation of
        thousands of operands compiles slowly)."""
        leaves = list(leaves)
        if is_traced(leaves):
            return self._join_traced(leaves)
        device = device_of(leaves[0]) if leaves else None
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


def initial_slot(value, params, layout, dtype=None):
    """A state slot's first value: a number (or a scalar array) everywhere, or ("params") a
    copy of the params; of `dtype` where given, else of each param's dtype."""
    if isinstance(value, str) and value == "params":
        if layout is None:
            return jax.tree.map(lambda p: jnp.array(p, dtype or leaf_struct(p).dtype), params)
        return dict(zip(layout.names, layout.join(jax.tree.leaves(params))))
    if layout is None:
        return jax.tree.map(lambda p: jnp.full(np.shape(p), value, dtype or leaf_struct(p).dtype),
                            params)
    return layout.full(value)


def leaf_struct(x) -> jax.ShapeDtypeStruct:
    """A leaf's shape and the dtype JAX gives it (Python numbers and NumPy float64 arrays
    become float32 unless jax_enable_x64 is on)."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(dtype))


FLOATS = ("float16", "bfloat16", "float32", "float64")  # what the kernels step


def size_of(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def is_traced(arrays) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in arrays)


def device_of(array):
    """The one device of a concrete array (its first, for arrays on several)."""
    devices = getattr(array, "devices", None)
    return next(iter(devices())) if devices is not None else None
