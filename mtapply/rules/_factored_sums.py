"""Per-tensor sums that a factored param can take from its factor pass, without a pass of
their own over its elements.

A sum whose expression, for a factored param, is a product of an element value computed
from full slots (E), a value of the new row state (R), one of the new column state (C) and a
per-matrix value (M: numbers, and means over the matrix) adds up, per matrix, as

    sum_ij E_ij R_i C_j M = M sum_j C_j S_j,  S_j = sum_i E_ij R_i:

a factor pass that holds whole rows adds E R into each column once it has the row's new
state, and the matrix pass finishes the sum over the columns (Adafactor's sum of u^2, with
u = g / sqrt(row_i col_j / mean(row)), and of p^2, an element value alone). The product is
found by inlining the temporaries the sum reads (taking `A if factored else B`'s A) and
splitting products, quotients, powers, roots and clamps (`where(x < k, k, x)`, `max(x, k)`,
a per-matrix bound k). The split form equals the sum where

- each value split from under a root or a clamp is positive and finite (sqrt(a b) =
  sqrt(a) sqrt(b) for a, b > 0), and
- each clamp leaves its value as it is: min over the matrix of x >= k, which for x = M R_i C_j
  of positive factors is M min_i R_i min_j C_j;

the matrix pass checks both per matrix (minima and maxima over its rows and columns), and a
tensor that fails them takes its sums as before (a torch clamp that bites, a NaN grad).
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from fractions import Fraction

from ._factored import FULL, UNFACTORED_ONLY
from ._factored_passes import mean_calls
from ._language import Program, _Checker, names_read

ELEMENT, ROWS, COLS, MATRIX = "element", "row", "col", "matrix"  # where a factor varies
_AXES = {frozenset("rc"): ELEMENT, frozenset("r"): ROWS, frozenset("c"): COLS,
         frozenset(): MATRIX}


class NotProduct(Exception):
    """Why a sum is not a product of element, row, column and matrix values."""


@dataclass(frozen=True)
class Factor:
    expr: ast.expr  # inlined: it reads slots, hyperparameters, step, numel and means only
    power: Fraction
    varies: str  # ELEMENT, ROWS, COLS or MATRIX

    def text(self) -> str:
        """The factor as rule text: expr ** power, by the cheapest function that gives it."""
        base = ast.unparse(self.expr)
        if self.power == 1:
            return f"({base})"
        return {Fraction(-1): f"(1 / ({base}))", Fraction(1, 2): f"sqrt({base})",
                Fraction(-1, 2): f"rsqrt({base})", Fraction(2): f"(({base}) * ({base}))"}.get(
            self.power, f"(({base}) ** {float(self.power)!r})")


@dataclass(frozen=True)
class Clamp:
    """A clamp the split form takes as inactive: the product of `factors` (row, column and
    matrix ones, each positive) is at least `bound` (a per-matrix value) everywhere."""

    factors: tuple
    bound: ast.expr


@dataclass(frozen=True)
class ProductSum:
    """A sum of a factored param as M sum_j C_j sum_i E_ij R_i (see the module's text)."""

    name: str
    factors: tuple  # Factors
    positive: tuple  # Factors (power 1) that must be positive and finite
    clamps: tuple  # Clamps

    def part(self, varies: str) -> str:
        """The rule text of the product of its factors that vary as `varies` ("1" if none)."""
        return product_text(self.factors, varies)


def product_text(factors, varies: str) -> str:
    """The rule text of the product of `factors` that vary as `varies` ("1" if none)."""
    return " * ".join(f.text() for f in factors if f.varies == varies) or "1"


@dataclass(frozen=True)
class ProductSums:
    """Every sum of a rule, each a ProductSum for factored params, or why not."""

    sums: tuple  # ProductSums, in the program's order
    why_not: str = ""


def product_sums(program: Program) -> ProductSums:
    """The product form of each of a factored rule's sums (made once, kept with the program);
    `why_not` names the first sum without one."""
    made = program.__dict__.get("_product_sums")
    if made is None:
        made = _product_sums(program)
        program.__dict__["_product_sums"] = made
    return made


def _product_sums(program: Program) -> ProductSums:
    if not program.sums:
        return ProductSums((), "the rule has no sums")
    values = _inlined_values(program)
    found = []
    for total in program.sums:
        try:
            found.append(_Splitter(program, total, values).split())
        except NotProduct as why:
            return ProductSums((), f"sum {total.name!r} ({total.text!r}): {why}")
    return ProductSums(tuple(found))


def _inlined_values(program: Program) -> dict:
    """name -> the expression (inlined, the factored form's) that each temporary and each full
    slot assigned before the first use of a sum holds there."""
    slots = {s.name: s for s in program.slots}
    values: dict = {}
    for line in program.lines[:program.prefix]:
        slot = slots.get(line.target)
        if line.only == UNFACTORED_ONLY or (slot is not None and slot.form != FULL):
            continue  # (a row or column slot stays a name: its new value)
        values[line.target] = _inline(line.expr, values)
    return values


def _inline(expr, values: dict):
    """A copy of `expr` with `A if factored else B` as A and each name in `values` replaced."""

    class Inline(ast.NodeTransformer):
        def visit_IfExp(self, node):
            return self.visit(node.body)

        def visit_Name(self, node):
            return copy.deepcopy(values[node.id]) if node.id in values else node

    return Inline().visit(copy.deepcopy(expr))


class _Splitter:
    """One sum's split into factors."""

    def __init__(self, program: Program, total, values: dict):
        self.program, self.total = program, total
        self.expr = _inline(total.expr, values)
        self.checker = _Checker(program)
        self.checker.where, self.checker.text = f"sum {total.name!r}", ast.unparse(self.expr)
        self.checker.expr(self.expr)  # (the kinds of the inlined nodes)
        self.factors: list = []
        self.positive: list = []
        self.clamps: list = []

    def split(self) -> ProductSum:
        self._split(self.expr, Fraction(1), self.factors, rooted=False)
        if not any(f.varies == ELEMENT for f in self.factors):
            raise NotProduct("it has no element value (sum over the elements of a value of "
                             "rows or columns only)")
        return ProductSum(self.total.name, tuple(self.factors), _once(self.positive),
                          _once(self.clamps))

    def _kind(self, node):
        return self.program.kind(node)

    def _leaf(self, node) -> str | None:
        """Where `node` varies, if it is one factor: an element value of full slots, a row
        (column) value of row (column) slots, or a per-matrix value; None where it must be
        split. Row and column values read no means (the factor pass has none)."""
        kind = self._kind(node)
        if kind.uniform:
            return MATRIX
        varies = _AXES[kind.axes]
        names = names_read(node)
        forms = {s.form for s in self.program.slots if s.name in names}
        means = bool(mean_calls(node))
        if varies == MATRIX or (varies == ELEMENT and forms <= {FULL} and not means):
            return varies
        if varies in (ROWS, COLS) and not means:
            return varies
        return None

    def _split(self, node, power: Fraction, out: list, rooted: bool) -> None:
        """Append node ** power's factors to `out`; `rooted`: split apart from under a root
        or a clamp, where each factor must be positive."""
        varies = self._leaf(node)
        if varies is not None:
            out.append(Factor(node, power, varies))
            if rooted and varies == ELEMENT:
                raise NotProduct(f"{ast.unparse(node)!r} is split from under a root or a "
                                 f"clamp, and an element value is not checked positive")
            if rooted:
                self.positive.append(Factor(node, Fraction(1), varies))
            return
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            right = power if isinstance(node.op, ast.Mult) else -power
            apart = rooted or power.denominator != 1
            self._split(node.left, power, out, apart)
            self._split(node.right, right, out, apart)
            return
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = node.right
            if isinstance(exponent, ast.Constant) and not isinstance(exponent.value, bool):
                by = Fraction(exponent.value).limit_denominator(1 << 16)
                if by == exponent.value:
                    self._split(node.left, power * by, out, rooted)
                    return
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("sqrt", "rsqrt"):
            by = Fraction(1, 2) if node.func.id == "sqrt" else Fraction(-1, 2)
            self._split(node.args[0], power * by, out, rooted)
            return
        for value, bound in _clamps(node):
            if self._leaf(bound) == MATRIX:
                inner: list = []
                self._split(value, Fraction(1), inner, True)
                self.clamps.append(Clamp(tuple(inner), bound))
                out.extend(Factor(f.expr, f.power * power, f.varies) for f in inner)
                return
        raise NotProduct(f"{ast.unparse(node)!r} varies along rows and columns and is not a "
                         f"product of element, row, column and per-matrix values")


def _once(items: list) -> tuple:
    """`items` without repeats (the same text twice: u * u splits u's checks twice)."""
    kept: dict = {}
    for item in items:
        kept.setdefault(ast.dump(ast.Tuple([f.expr for f in item.factors] + [item.bound]))
                        if isinstance(item, Clamp) else (ast.dump(item.expr), item.varies), item)
    return tuple(kept.values())


def _clamps(node) -> list:
    """Each (x, k) for which `node` is x clamped from below at k: where(x < k, k, x) (or <=),
    where(k > x, k, x) (or >=), max(x, k) and max(k, x) (either argument the bound)."""
    same = lambda a, b: ast.dump(a) == ast.dump(b)  # noqa: E731
    if not isinstance(node, ast.Call):
        return []
    name, args = getattr(node.func, "id", None), node.args
    if name == "max":
        return [(args[0], args[1]), (args[1], args[0])]
    if name != "where" or not isinstance(args[0], ast.Compare):
        return []
    left, op, right = args[0].left, type(args[0].ops[0]), args[0].comparators[0]
    if op in (ast.Lt, ast.LtE) and same(args[1], right) and same(args[2], left):
        return [(left, right)]
    if op in (ast.Gt, ast.GtE) and same(args[1], left) and same(args[2], right):
        return [(right, left)]
    return []


def checked(program: Program, text: str):
    """The expression node of rule text `text` (a part or a factor of a product sum), its kinds
    recorded in the program, made once per text and kept with the program (the kinds are held
    by node id)."""
    made = program.__dict__.setdefault("_product_nodes", {})
    if text not in made:
        node = ast.parse(text, mode="eval").body
        checker = _Checker(program)
        checker.where, checker.text = f"product part {text!r}", text
        checker.expr(node)
        made[text] = node
    return made[text]
