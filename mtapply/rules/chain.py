"""Gradient transformations as rules, and chains of them fused into one rule.

A link reads `grad` (the updates so far: the gradient for the first link) and writes `update`,
with state slots and hyperparameters of its own, as an optax GradientTransformation does; it
may read `param` and `step`. `chain(*links)` is one rule: each link's lines in order, each
reading the update of the link before, then `param = param + update` (optax's
apply_updates), so the generated kernel reads each tensor once and writes it once. A chain
that ends in a learning-rate scaling is an optimizer wherever a rule is one.

    adamw = mtapply.chain(library.scale_by_adam(), library.add_decayed_weights(1e-4),
                          library.scale_by_learning_rate())
    adamw.step(params, grads, mu, nu, lr=1e-3, step=1)

Names of slots and hyperparameters stay as the links declare them where they are unique in
the chain; a name two links declare gets the link's 1-based position as a suffix (`mu_2`).

A link may mask a hyperparameter (`masks`: name -> optax's mask, a pytree of bools like the
params or a callable of the params giving one): where the mask is False the hyperparameter is
0 (optax's `masked`, for links that are the identity there, as add_decayed_weights). The chain
keeps the masks (`rule.masks`, by the chain's names); `mtapply.optax` applies them, since pytrees
exist there; the torch and functional forms take such a hyperparameter per param group or per
tensor instead.

A link is also an optax GradientTransformation (`init`, `update`): in `optax.chain` beside
optax's own links it runs alone, as `mtapply.optax.transformation(chain(link))` with its
hyperparameters' values (made at its first use; jax and optax are imported only then). Links
chained with `chain` run as one kernel; each link in optax.chain is a kernel of its own.

A link may schedule a hyperparameter (`schedules`: name -> a function of the step count from 0,
as optax's schedules): `mtapply.optax` evaluates it at each update (traced, under jit too) and
passes the value to the kernel as a per-step scalar, as it passes the learning rate; the chain
keeps them as `rule.schedules`. The torch and functional forms take such a hyperparameter as
given at each step (a param group's value, which a scheduler may set).
"""
from __future__ import annotations

import ast
import textwrap

from . import Rule
from ._language import FUNCTIONS, STEP

INPUT, OUTPUT = "grad", "update"


class Link:
    """One gradient transformation: `slots` (its state, "NAME:rw" or "NAME:rw=FIRST"),
    `hyper` (as a rule's) and `update` lines that end by assigning `update` (kept as
    `update_text`); `sums`, `totals` and `finish` as a rule's (per-tensor norms, a global norm:
    a chain holds at most one link with sums or totals); `masks`: hyperparameter name -> optax's
    mask, `schedules`: hyperparameter name -> schedule (see the module docstring)."""

    def __init__(self, name: str, slots: str, hyper: dict, update: str, sums=None,
                 finish: str = "", totals=None, masks=None, schedules=None):
        self.name, self.slots_text, self.hyper = name, slots, dict(hyper)
        self.update_text, self.finish = textwrap.dedent(update), textwrap.dedent(finish)
        self.sums, self.totals = dict(sums or {}), dict(totals or {})
        self.masks = {key: mask for key, mask in (masks or {}).items() if mask is not None}
        if not any(line.partition("=")[0].strip() == OUTPUT
                   for line in _lines(self.update_text)):
            raise ValueError(f"link {name!r} never assigns {OUTPUT!r} (its output)")
        self.schedules = dict(schedules or {})
        for key, schedule in self.schedules.items():
            if not callable(schedule):
                raise TypeError(f"link {name!r}: the schedule of {key!r} must be a function of "
                                f"the step count, got {type(schedule).__name__}")
        for key in (*self.masks, *self.schedules):
            if key not in self.hyper:
                raise ValueError(f"link {name!r} {'masks' if key in self.masks else 'schedules'}"
                                 f" {key!r}, which is not one of its hyperparameters "
                                 f"({', '.join(self.hyper) or 'none'})")
        # checked as the rule it would be alone: names, ranges, reads and writes
        alone = Rule(name, f"param:rw grad:r {slots}", hyper,
                     f"{self.update_text}\nparam = param + {OUTPUT}", self.sums or None,
                     self.finish, totals=self.totals or None)
        self.state = alone.program.slots[2:]

    # -- optax: a link is a GradientTransformation of its own (init, update), which
    # optax.chain takes beside optax's links

    def init(self, params):
        """optax's GradientTransformation.init: the state of this link run alone, as
        `mtapply.optax.transformation(mtapply.chain(link))` (made at the first use: mtapply
        imports jax and optax only then)."""
        return self._transformation().init(params)

    def update(self, updates, state, params=None, **extra_args):
        """optax's GradientTransformation.update (optax's extra arguments are ignored): the
        link's kernel over the tree, its hyperparameters the link's values; params where
        the link reads them (add_decayed_weights, scale_by_trust_ratio)."""
        return self._transformation().update(updates, state, params, **extra_args)

    def _transformation(self):
        made = self.__dict__.get("_optax")
        if made is None:
            from .. import optax as mtx  # only here: the rules never need jax

            rule = chain(self)
            learning_rate = rule.hyper.get("lr")
            if "lr" in rule.hyper and learning_rate is None:
                raise TypeError(f"link {self.name!r} scales by a learning rate it was not given: "
                                f"in optax.chain it runs alone, so give it one "
                                f"(scale_by_learning_rate(1e-3)), or chain it with mtapply.chain "
                                f"and pass learning_rate to mtapply.optax.transformation")
            made = self._optax = mtx.transformation(rule, learning_rate)
        return made

    def __getstate__(self):  # (pickles and copies make their transformation again)
        return {key: value for key, value in self.__dict__.items() if key != "_optax"}

    def __repr__(self) -> str:
        return f"mtapply.rules.chain.Link({self.name!r}, slots={self.slots_text!r})"


class ChainRule(Rule):
    """The rule `chain` makes: a rule, with the links' masks (`masks`: the chain's
    hyperparameter name -> optax's mask) and schedules (`schedules`: name -> a function of the
    step count), which mtapply.optax applies."""

    def __init__(self, name: str, slots: str, hyper: dict, update: str, sums=None,
                 finish: str = "", totals=None, masks=None, schedules=None):
        super().__init__(name, slots, hyper, update, sums, finish, totals=totals)
        self.masks, self.schedules = dict(masks or {}), dict(schedules or {})

    def __reduce__(self):
        name, slots, hyper, update, sums, finish, _, totals = self._source
        return ChainRule, (name, slots, hyper, update, sums, finish, totals, self.masks,
                           self.schedules)


def chain(*links: Link, name: str | None = None) -> Rule:
    """One rule of `links` in order (see the module docstring)."""
    if not links or not all(isinstance(link, Link) for link in links):
        raise TypeError("chain takes one or more links (mtapply.rules.chain.Link)")
    if sum(bool(link.sums or link.totals) for link in links) > 1:
        raise ValueError("a chain holds at most one link with sums or totals (its first pass "
                         "sums the values the links before it leave)")
    taken = _taken(links)
    slots, hyper, lines, sums, finish = ["param:rw", "grad:r"], {}, [], {}, []
    totals: dict = {}
    masks: dict = {}
    schedules: dict = {}
    for k, link in enumerate(links, 1):
        names = {INPUT: INPUT if k == 1 else f"update_{k - 1}", OUTPUT: f"update_{k}"}
        for slot in link.state:
            names[slot.name] = _unique(slot.name, k, taken)
            first = "" if slot.initial == 0.0 else f"={slot.initial}"
            slots.append(f"{names[slot.name]}:{'rw' if slot.written else 'r'}{first}")
        for hyper_name, declared in link.hyper.items():
            names[hyper_name] = _unique(hyper_name, k, taken)
            hyper[names[hyper_name]] = declared
        masks.update((names[key], mask) for key, mask in link.masks.items())
        schedules.update((names[key], fn) for key, fn in link.schedules.items())
        for given, into in ((link.sums, sums), (link.totals, totals)):
            for total, text in given.items():
                names[total] = f"link{k}_{total}"
                into[names[total]] = _renamed(text, names, k)
        finish += [_renamed(line, names, k) for line in _lines(link.finish)]
        lines += [_renamed(line, names, k) for line in _lines(link.update_text)]
    lines.append(f"param = param + update_{len(links)}")
    return ChainRule(name or "+".join(link.name for link in links), " ".join(slots), hyper,
                     "\n".join(lines), sums or None, "\n".join(finish), totals or None, masks,
                     schedules)


def _taken(links) -> dict:
    """Name -> how many links declare it (a slot or a hyperparameter)."""
    counts: dict = {}
    for link in links:
        for declared in {s.name for s in link.state} | set(link.hyper):
            counts[declared] = counts.get(declared, 0) + 1
    return counts


def _unique(declared: str, k: int, taken: dict) -> str:
    return declared if taken[declared] == 1 else f"{declared}_{k}"


def _lines(text: str) -> list:
    return [line.split("#", 1)[0].strip() for line in text.splitlines()
            if line.split("#", 1)[0].strip()]


def _renamed(line: str, names: dict, k: int) -> str:
    """A link's line with its names as the chain knows them: slots, hyperparameters, input
    and output by `names`, temporaries prefixed by the link's position; `param`, `step` and
    the functions as they are."""
    keep = {"param", STEP} | set(FUNCTIONS)

    class Rename(ast.NodeTransformer):
        def visit_Call(self, node):
            node.args = [self.visit(arg) for arg in node.args]
            return node

        def visit_Name(self, node):
            if node.id not in keep:
                node.id = names.get(node.id, f"link{k}_{node.id}")
            return node

    return ast.unparse(Rename().visit(ast.parse(line)))


__all__ = ["ChainRule", "Link", "chain"]
