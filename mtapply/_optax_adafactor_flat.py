"""The flat state of mtapply.optax.fused_adafactor: the rule's slots, each one buffer per
dtype (`FlatLayout`), and its conversions to and from optax.adafactor's state."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._adafactor_layout import _from_rule, _layout, _optax_vectors, _rule_slots, _to_rule
from ._optax_engine import Engine
from ._optax_ops import _mask_leaves
from ._optax_state import FlatLayout, flat_for, leaf_struct


class _FlatSteps:
    """The fused form's steps on the rule's flat state (`fused_adafactor`): init, run, and the
    conversions to and from optax's state. The params go to the engine with their two largest
    dimensions last (`_layout`), which the rule's slot shapes follow (`slot_structs`)."""

    def __init__(self, engine: Engine, rule, mask, optax_init):
        self.engine, self.rule, self.mask, self.optax_init = engine, rule, mask, optax_init

    def init(self, params):
        """Zero state (as optax's), each slot flat (one leaf: a tree, its flat layout)."""
        treedef, moved = self._moved_structs(params)
        if not flat_for(True, moved):
            slots = [treedef.unflatten([jnp.zeros(s.shape, s.dtype)
                                        for s in self.rule.slot_structs(field, moved)])
                     for field in self.rule.slots]
        else:
            slots = [self._layout(field, moved).full(0.0) for field in self.rule.slots]
        return self.rule.state_type(jnp.zeros([], jnp.int32), *slots)

    def run(self, params, grads, state, mode: str):
        if not isinstance(state, self.rule.state_type):
            raise ValueError(f"mtapply.optax.fused_adafactor (and adafactor with "
                             f"flat_state=True) steps its own flat state, not "
                             f"{type(state).__name__}: make it with init(params), or from "
                             f"optax.adafactor's state with fused_adafactor's "
                             f"flat_state(state, params)")
        leaves, treedef = jax.tree.flatten(params)
        flags = (None if self.mask is None else
                 _mask_leaves(self.mask, params, treedef, "weight_decay_mask"))
        layouts = self._layouts(leaves)
        moved = [treedef.unflatten([_to_rule(x, layout) for x, layout in zip(xs, layouts)])
                 for xs in (leaves, treedef.flatten_up_to(grads))]
        with self.rule.decay_flags(flags):
            new, state = self.engine.apply(moved[0], moved[1], state, mode=mode)
        return treedef.unflatten([_from_rule(x, layout) for x, layout in
                                  zip(treedef.flatten_up_to(new), layouts)]), state

    def tree_state(self, state, params) -> tuple:
        """optax.adafactor's state of the same values: every count of its chain the state's."""
        leaves, treedef = jax.tree.flatten(params)
        layouts = self._layouts(leaves)
        slots = self._per_leaf(state, params)
        template = jax.eval_shape(self.optax_init, params)
        new = []
        for link in template:
            if isinstance(link, optax.FactoredState):
                moments = _optax_moments(slots, leaves, layouts, link, treedef)
                link = optax.FactoredState(state.count, *map(treedef.unflatten, moments))
            elif isinstance(link, optax.EmaState):
                link = optax.EmaState(state.count, treedef.unflatten(
                    [_from_rule(x, layout) for x, layout in zip(slots["ema"], layouts)]))
            elif "count" in getattr(link, "_fields", ()):  # the learning rate schedule's
                link = link._replace(count=state.count)
            new.append(link)
        return tuple(new)

    def flat_state(self, optax_state: tuple, params):
        """The flat state of optax.adafactor's state `optax_state` (its FactoredState's count),
        which must be that of optax.adafactor with this optimizer's options for these params."""
        self._check_optax_state(optax_state, params)
        leaves, treedef = jax.tree.flatten(params)
        layouts = self._layouts(leaves)
        rms = next(link for link in optax_state if isinstance(link, optax.FactoredState))
        per_leaf = _rule_slots(layouts, *(treedef.flatten_up_to(t) for t in
                                          (rms.v_row, rms.v_col, rms.v)))
        ema = next((link for link in optax_state if isinstance(link, optax.EmaState)), None)
        if "ema" in self.rule.slots:
            per_leaf.append([_to_rule(x, layout) for x, layout in
                             zip(treedef.flatten_up_to(ema.ema), layouts)])
        _, moved = self._moved_structs(params)
        if not flat_for(True, moved):
            return self.rule.state_type(rms.count, *(treedef.unflatten(x) for x in per_leaf))
        layouts = [self._layout(field, moved) for field in self.rule.slots]
        return self.rule.state_type(rms.count, *(dict(zip(layout.names, layout.join(x)))
                                                 for layout, x in zip(layouts, per_leaf)))

    def _check_optax_state(self, optax_state, params) -> None:
        """`optax_state` laid out as optax.adafactor with these options keeps it (the links of
        its chain, each param's vectors or variance): else a ValueError saying where not."""
        template = jax.eval_shape(self.optax_init, params)
        if jax.tree.structure(optax_state) != jax.tree.structure(template):
            raise ValueError(f"mtapply.optax.fused_adafactor.flat_state: the state given is "
                             f"{jax.tree.structure(optax_state)}, but optax.adafactor with this "
                             f"optimizer's options keeps {jax.tree.structure(template)} for these "
                             f"params (momentum, weight_decay_rate and the schedule must match)")
        paths = jax.tree_util.tree_flatten_with_path(template)[0]
        for (path, want), got in zip(paths, jax.tree.leaves(optax_state)):
            if tuple(np.shape(got)) != tuple(want.shape):
                raise ValueError(f"mtapply.optax.fused_adafactor.flat_state: "
                                 f"state{jax.tree_util.keystr(path)} has shape {np.shape(got)}, "
                                 f"but optax.adafactor with this optimizer's options keeps "
                                 f"{want.shape} there (factored and min_dim_size_to_factor must "
                                 f"match)")

    def _per_leaf(self, state, params) -> dict:
        """Slot name -> each param's array of it, in the rule's layout."""
        treedef, moved = self._moved_structs(params)
        if not flat_for(True, moved):
            return {field: treedef.flatten_up_to(getattr(state, field)) for field in self.rule.slots}
        out = {}
        for field in self.rule.slots:
            layout = self._layout(field, moved)
            out[field] = layout.split(layout.buffers_of(getattr(state, field), field))
        return out

    def _layouts(self, leaves: list) -> list:
        factored, min_dim, _ = self.rule.factoring
        return [_layout(np.shape(x), factored, min_dim) for x in leaves]

    def _moved_structs(self, params) -> tuple:
        """(treedef, each param's struct with its two largest dimensions last)."""
        leaves, treedef = jax.tree.flatten(params)
        structs = [leaf_struct(x) for x in leaves]
        return treedef, [jax.ShapeDtypeStruct(tuple(s.shape[k] for k in layout.perm), s.dtype)
                         for s, layout in zip(structs, self._layouts(leaves))]

    def _layout(self, field: str, moved: list) -> FlatLayout:
        return FlatLayout(self.rule.slot_structs(field, moved))


def _optax_moments(slots: dict, leaves: list, layouts: list, shapes, treedef) -> tuple:
    """optax's (v_row, v_col, v) leaves, shaped as in `shapes` (its FactoredState's structs),
    from the rule's slots of each param (`_FlatSteps._per_leaf`): a factored param's vectors
    (its v a placeholder), any other's full variance (its vectors placeholders)."""
    v_row, v_col, v = [], [], []
    for i, (layout, row_shape, col_shape, v_shape) in enumerate(zip(
            layouts, *(treedef.flatten_up_to(t) for t in shapes[1:]))):
        dtype = leaf_struct(leaves[i]).dtype
        if layout.axes is None:
            row, col = jnp.zeros(row_shape.shape, dtype), jnp.zeros(col_shape.shape, dtype)
            full = slots["variance"][i].reshape(v_shape.shape)
        else:
            row, col = _optax_vectors(slots["row_var"][i], slots["col_var"][i], layout)
            row, col = row.reshape(row_shape.shape), col.reshape(col_shape.shape)
            full = jnp.zeros(v_shape.shape, dtype)
        v_row.append(row)
        v_col.append(col)
        v.append(full)
    return v_row, v_col, v
