"""The rule language: a few lines of per-element assignments, parsed and checked once.

A rule's update is Python-like text, one assignment per line:

    c = beta1 * exp_avg + (1 - beta1) * grad
    param = param * (1 - lr * weight_decay) - lr * sign(c)
    exp_avg = beta2 * exp_avg + (1 - beta2) * grad

Names are the rule's slots (per-element values of its tensors), its hyperparameters and `step`
(per-launch numbers), its scalar state (numbers kept between steps for the whole list, such as
NAdam's running product of momentum factors: a name reads the value the previous step left, an
assignment sets the value the next step reads; uniform values only), and temporaries assigned on
earlier lines. Expressions use numbers,
+ - * / ** %, unary minus, comparisons, `where(cond, a, b)` and the functions in FUNCTIONS
(`a % b` as Python's: a - b * floor(a / b), the sign of b; `step % k == 0` picks every k-th step).
The text is parsed with Python's `ast` and only the node types named here are accepted: nothing
from it is ever executed. Each value is classed once: *uniform* (the same for every element of
a launch: numbers, hyperparameters, step, and what is computed from them alone) or *element*,
and boolean (a comparison) or numeric. Per-tensor sums (and finish lines computed from them)
are uniform too: the kernel's functor computes uniform values once per block of one tensor.
Both code generators walk the same checked `Program`.

Factored slots (`mtapply.rules._factored`) keep a matrix's row or column vector: a slot declared
`NAME:rw@row` holds one value per row of the param's last two dimensions, `@col` one per
column, and `@unfactored` one per element for params that are not factored. `row_mean(x)`
and `col_mean(x)` are the means of x over each row (the last axis) and each column (the
second-to-last); `A if factored else B` is A for factored params and B for the others, and
`numel` is the param's number of elements. Values are classed by the matrix axes they vary
along too (an element value along both, a row value along the rows), and by where they exist
(for factored params only, unfactored ones only, or both): a line that assigns a `@row` or
`@col` slot runs for factored params only, one that assigns an `@unfactored` slot for the
others.

Each hyperparameter is declared with its default (None: required) and optionally the range a
step accepts, as `(default, "RANGE")`: ">= 0", "> 0", "<= 1", "< 1", or an interval "[0, 1)",
"(0, 1]", "[0, 1]", "(0, 1)". Every value given to a step is a finite number within its range.
"""
from __future__ import annotations

import ast
import functools
import keyword
import math
from dataclasses import dataclass, field

from .._ranges import FINITE, Range
from .._ranges import parse as parse_range
from ._factored import AXES, COL, FACTORED_ONLY, FORMS, FULL, ROW, UNFACTORED, UNFACTORED_ONLY

FUNCTIONS = {"sqrt": 1, "rsqrt": 1, "abs": 1, "sign": 1, "exp": 1, "log": 1, "min": 2,
             "max": 2, "where": 3, "row_mean": 1, "col_mean": 1, "bfloat16": 1}
MEANS = {"row_mean": "c", "col_mean": "r"}  # the matrix axis each mean reduces
BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**", ast.Mod: "%"}
COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
           ast.NotEq: "!="}
STEP = "step"
NUMEL = "numel"  # the param's number of elements (a per-tensor number)
FACTORED = "factored"  # the test of `A if factored else B`
# step arguments that are not hyperparameters: stochastic rounding's seed and its kernel words
STEP_OPTIONS = frozenset({"seed", "seed_lo", "seed_hi", "sr_tensor_array"})


@dataclass(frozen=True)
class Slot:
    name: str
    written: bool
    initial: object = 0.0  # a state slot's first value: a number, or "param" (a copy of it)
    form: str = FULL  # row, col, unfactored: a factored slot (mtapply.rules._factored)


@dataclass(frozen=True)
class Line:
    """One checked assignment: `target` (a slot or a temporary) = `expr`."""

    number: int
    target: str
    expr: ast.expr
    text: str
    only: str | None = None  # runs for factored (or unfactored) params only


@dataclass(frozen=True)
class Kind:
    uniform: bool
    boolean: bool = False
    axes: frozenset = AXES[FULL]  # the matrix axes a non-uniform value varies along
    only: str | None = None  # exists for factored (or unfactored) params only


@dataclass(frozen=True)
class Sum:
    """A reduction: the sum over a tensor's elements of `expr`, or (whole) over every element
    of the list."""

    name: str
    expr: ast.expr
    text: str
    whole: bool = False


@dataclass
class Program:
    """A checked rule: its slots, hyperparameters (name -> default, None for required), and
    update lines, with the kind of every expression node (`kinds`, by node id).

    With sums, a first pass runs the first `prefix` lines (those before the first line that
    uses a sum; nothing is stored) and adds up each sum's expression per tensor on the values
    they leave; the second pass runs every line, the finish lines among them (per-tensor
    values of the sums, placed after the prefix), with each sum a per-tensor number, and each
    whole-list sum (`totals`, after the per-tensor ones in `sums`) the list's."""

    slots: tuple
    hyper: dict
    lines: tuple
    kinds: dict = field(default_factory=dict)
    sums: tuple = ()
    prefix: int = 0
    ranges: dict = field(default_factory=dict)  # hyperparameter name -> its declared Range
    scalars: dict = field(default_factory=dict)  # scalar state name -> its value before step 1

    def kind(self, node) -> Kind:
        return self.kinds[id(node)]

    @property
    def factored(self) -> bool:
        """Whether the rule has factored slots (its params step as factored or not)."""
        return any(s.form != FULL for s in self.slots)

    @functools.cached_property
    def cpu_only(self) -> str:
        """Why the NumPy backend steps the rule tensor by tensor, in the param's mode ("" where
        it need not): factored slots, row and column means, `numel`. On a GPU, a factored
        rule runs through its reductions (`rules._factored_passes`); another rule that reads
        means or numel has no kernel (`rules._spec.cuda_refusal`)."""
        for s in self.slots:
            if s.form != FULL:
                return f"slot {s.name!r} is factored ({s.name}:rw@{s.form})"
        exprs = [line.expr for line in self.lines] + [s.expr for s in self.sums]
        for expr in exprs:
            for node in ast.walk(expr):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in MEANS:
                    return f"it reads {node.func.id}()"
                if isinstance(node, ast.Name) and node.id == NUMEL:
                    return f"it reads {NUMEL}"
        return ""

    @functools.cached_property
    def first_pass_slots(self) -> frozenset:
        """The slots a rule with sums reads in its first pass (the prefix lines and the sums'
        expressions): their values as they were before the step."""
        exprs = [line.expr for line in self.lines[:self.prefix]] + [s.expr for s in self.sums]
        names = {node.id for expr in exprs for node in ast.walk(expr) if isinstance(node, ast.Name)}
        return frozenset(s.name for s in self.slots if s.name in names)

    @functools.cached_property
    def stored_first(self) -> frozenset:
        """The state slots the first pass of a rule with sums may store, so that the update
        pass reads them rather than compute them again (LAMB's moments: the update pass then
        reads neither the grad nor the old moments). Those its prefix lines assign, each once,
        where every prefix line the update still needs reads them only after they are assigned;
        empty where that does not hold, or where the prefix assigns the param."""
        if not self.sums:
            return frozenset()
        slots = {s.name for s in self.slots}
        prefix, assigned = self.lines[:self.prefix], {}
        for k, line in enumerate(prefix):
            if line.target in slots:
                if line.target in assigned or line.target == self.slots[0].name:
                    return frozenset()
                assigned[line.target] = k
        for k in self.update_prefix_lines(frozenset(assigned)):
            if any(assigned.get(name, -1) >= k for name in names_read(prefix[k].expr)):
                return frozenset()  # it reads an old value, which the update pass no longer has
        return frozenset(assigned)

    def update_prefix_lines(self, stored: frozenset) -> list:
        """Indices of the prefix lines the update pass runs again where the first pass stores
        `stored`: those whose values the later lines need, and those of scalar state, which
        the update keeps (the stored slots' own lines not)."""
        needed = set(self.scalars).union(*(names_read(line.expr)
                                           for line in self.lines[self.prefix:]))
        kept = []
        for k in range(self.prefix - 1, -1, -1):
            line = self.lines[k]
            if line.target in needed and line.target not in stored:
                kept.append(k)
                needed |= names_read(line.expr)
        return kept[::-1]

    @property
    def totals(self) -> tuple:
        """The whole-list sums, in order."""
        return tuple(total for total in self.sums if total.whole)

    @functools.cached_property
    def uses_step(self) -> bool:
        """Whether a step needs the step count: the lines read it, or scalar state is kept
        (copies picked by the step's parity)."""
        return bool(self.scalars) or any(isinstance(n, ast.Name) and n.id == STEP
                                         for line in self.lines for n in ast.walk(line.expr))


def parse_slots(text: str) -> tuple:
    """"param:rw grad:r exp_avg:rw nu:rw=1e-6 z:rw=param v_row:rw@row" -> Slots. param comes
    first (rw, or r for a rule that only keeps state, such as an average of the params), grad
    (read) is among them; a state slot may declare its form (@row, @col, @unfactored: see
    `mtapply.rules._factored`) and its first value (a number, or `param`: a copy of the
    param, for slots of one value per element), 0 where it does not."""
    if not isinstance(text, str):
        raise TypeError(f"slots must be a string like \"param:rw grad:r exp_avg:rw\", got "
                        f"{type(text).__name__}")
    slots = []
    for word in text.split():
        name, _, mode = word.partition(":")
        mode, equals, start = mode.partition("=")
        mode, at, form = mode.partition("@")
        if not name.isidentifier() or keyword.iskeyword(name) or mode not in ("r", "rw"):
            raise ValueError(f"slots: {word!r} is not NAME:r or NAME:rw")
        initial = _initial(word, start) if equals else 0.0
        if (equals or at) and name in ("param", "grad"):
            raise ValueError(f"slots: {word!r}: only state slots declare a first value or "
                             f"a form")
        form = _form(word, form) if at else FULL
        if initial == "param" and form in (ROW, COL):
            raise ValueError(f"slots: {word!r}: a row or column slot starts at a number, not "
                             f"at a copy of the param")
        if name in FUNCTIONS or name in (STEP, NUMEL, FACTORED):
            raise ValueError(f"slots: {name!r} is a reserved name")
        if any(s.name == name for s in slots):
            raise ValueError(f"slots: {name!r} is declared twice")
        slots.append(Slot(name, mode == "rw", initial, form))
    if not slots or slots[0].name != "param":
        raise ValueError("slots must begin with param:rw (the tensors the rule updates), or "
                         "param:r for a rule that only keeps state")
    if not any(s.written for s in slots):
        raise ValueError("slots: a rule writes at least one slot (declare it NAME:rw)")
    if Slot("grad", False) not in slots:
        raise ValueError("slots must include grad:r (the gradients, unscaled by AMP's "
                         "grad_scale)")
    return tuple(slots)


def _form(word: str, text: str) -> str:
    if text not in FORMS:
        raise ValueError(f"slots: {word!r}: a slot's form is @row, @col or @unfactored (one "
                         f"value per row or column of a factored param, or per element of an "
                         f"unfactored one)")
    return text


def _initial(word: str, text: str):
    """A state slot's declared first value: a finite number, or "param"."""
    if text == "param":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"slots: {word!r}: a first value is a finite number or param")
    return value


def check_hyper(hyper: dict, slots: tuple) -> tuple:
    """(name -> default (a number, or None for a required hyperparameter), name -> Range).
    Each value of `hyper` is a default, or a (default, range text) pair."""
    if not isinstance(hyper, dict):
        raise TypeError(f"hyper must be a dict of name -> default, got {type(hyper).__name__}")
    taken = {s.name for s in slots}
    defaults, ranges = {}, {}
    for name, declared in hyper.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"hyper: {name!r} is not a valid name")
        if (name in taken or name in FUNCTIONS or name in (STEP, NUMEL, FACTORED)
                or name in STEP_OPTIONS):
            raise ValueError(f"hyper: {name!r} is already a slot or a reserved name")
        default, ranges[name] = declared, FINITE
        if isinstance(declared, tuple):
            if len(declared) != 2:
                raise TypeError(f"hyper: {name!r} is declared as {declared!r}: give a default, "
                                f"or a (default, range) pair such as (0.9, \"[0, 1)\")")
            default, ranges[name] = declared[0], parse_range(name, declared[1])
        if default is not None and (isinstance(default, bool)
                                    or not isinstance(default, (int, float))):
            raise TypeError(f"hyper: the default of {name!r} must be a number or None "
                            f"(required), got {default!r}")
        defaults[name] = None if default is None else float(default)
        if default is not None:
            _check_default(name, defaults[name], ranges[name])
    return defaults, ranges


def _check_default(name: str, value: float, accepted: Range) -> None:
    if not accepted.holds(value):
        raise ValueError(f"hyper: the default {value!r} of {name!r} is outside its range "
                         f"({accepted.describe()})")


def parse(slots: tuple, hyper: dict, update: str, sums=None, finish: str = "",
          ranges: dict | None = None, scalars=None, totals=None) -> Program:
    """The checked program of an update text (with its sums and finish lines, see Program);
    ValueError or TypeError naming the line. `ranges`: name -> Range (FINITE where absent);
    `scalars`: scalar state name -> its value before the first step; `totals`: name ->
    expression of the whole-list sums."""
    if not isinstance(update, str) or not isinstance(finish or "", str):
        raise TypeError("update and finish must be strings of assignments")
    per_tensor = _check_sums(sums, slots, hyper, "sums")
    whole = _check_sums(totals, slots, hyper, "totals")
    both = sorted(set(per_tensor) & set(whole))
    if both:
        raise ValueError(f"totals: {both[0]!r} is a per-tensor sum already")
    sums = {**per_tensor, **whole}
    program = Program(slots, hyper, (), ranges={name: (ranges or {}).get(name, FINITE)
                                                 for name in hyper},
                      scalars=_check_scalars(scalars, slots, hyper, per_tensor, whole))
    checker = _Checker(program, set(sums))
    texts = _texts(update, "update")
    if not texts:
        raise ValueError("update has no assignments")
    finish_texts = _texts(finish or "", "finish")
    prefix = _prefix(texts, set(sums) | {_target(t) for _, t, _ in finish_texts})
    if finish_texts and not sums:
        raise ValueError("finish lines compute per-tensor values of sums: give sums or totals "
                         "too")
    lines = [checker.line(number, text, where) for number, text, where in texts[:prefix]]
    program.sums = tuple(checker.sum(name, text, name in whole) for name, text in sums.items())
    checker.defined_sums = True
    lines += [checker.line(number, text, where, per_tensor=True)
              for number, text, where in finish_texts]
    lines += [checker.line(number, text, where) for number, text, where in texts[prefix:]]
    program.prefix = prefix if sums else 0
    never = [s.name for s in slots if s.written and s.name not in checker.assigned]
    if never:
        raise ValueError(f"slot {never[0]!r} is declared rw but no line assigns it: declare it "
                         f"{never[0]}:r, or assign it")
    program.lines = tuple(lines)
    return program


def _check_sums(sums, slots: tuple, hyper: dict, what: str) -> dict:
    """name -> expression text of each sum (`what`: sums or totals)."""
    if sums is None:
        return {}
    if not isinstance(sums, dict):
        raise TypeError(f"{what} must be a dict of name -> expression, got {type(sums).__name__}")
    taken = {s.name for s in slots} | set(hyper) | set(FUNCTIONS) | {STEP, NUMEL, FACTORED}
    for name, text in sums.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{what}: {name!r} is not a valid name")
        if name in taken:
            raise ValueError(f"{what}: {name!r} is already a slot, a hyperparameter or reserved")
        if not isinstance(text, str):
            raise TypeError(f"{what}: the expression of {name!r} must be a string")
    return dict(sums)


def _check_scalars(scalars, slots: tuple, hyper: dict, sums: dict, totals: dict) -> dict:
    """name -> initial value (a float) of each scalar state (which may be computed from
    whole-list sums, not from per-tensor ones)."""
    if scalars is None:
        return {}
    if not isinstance(scalars, dict):
        raise TypeError(f"scalars must be a dict of name -> initial value, got "
                        f"{type(scalars).__name__}")
    if scalars and sums:
        raise ValueError("scalars cannot be combined with per-tensor sums: a scalar holds one "
                         "value for the whole list (sums over the whole list, `totals`, may "
                         "feed it)")
    taken = {s.name for s in slots} | set(hyper) | set(FUNCTIONS) | {STEP, NUMEL, FACTORED} | set(
        totals)
    checked = {}
    for name, value in scalars.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"scalars: {name!r} is not a valid name")
        if name in taken:
            raise ValueError(f"scalars: {name!r} is already a slot, a hyperparameter or reserved")
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)):
            raise TypeError(f"scalars: the initial value of {name!r} must be a finite number, "
                            f"got {value!r}")
        checked[name] = float(value)
    return checked


def _texts(text: str, what: str) -> list:
    """(number, line, where) of each non-empty line, comments dropped."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append((number, line, what))
    return out


def _target(text: str) -> str:
    return text.split("=", 1)[0].strip()


def _prefix(texts: list, per_tensor: set) -> int:
    """How many lines come before the first that reads a sum or a finish value (only lines
    from there on can depend on one)."""
    for k, (_, text, _) in enumerate(texts):
        try:
            statement = ast.parse(text).body[0]
        except (SyntaxError, IndexError):
            return k  # the checker reports it
        value = getattr(statement, "value", statement)
        if any(isinstance(n, ast.Name) and n.id in per_tensor for n in ast.walk(value)):
            return k
    return len(texts)


class _Checker:
    def __init__(self, program: Program, sum_names: set = frozenset()):
        self.program = program
        self.slots = {s.name: s for s in program.slots}
        self.temporaries: dict = {}  # name -> Kind of its latest value
        self.assigned: set = set()
        self.sum_names, self.defined_sums, self.per_tensor = set(sum_names), False, False

    def sum(self, name: str, text: str, whole: bool = False) -> Sum:
        self.where, self.text = f"sum {name!r} ({text!r})", text
        try:
            expr = ast.parse(text, mode="eval").body
        except SyntaxError as error:
            raise ValueError(f"{self.where}: {error.msg}") from None
        kind = self.expr(expr)
        if kind.boolean:
            raise TypeError(f"{self.where}: a sum adds numbers, not a comparison")
        if kind.only:
            raise ValueError(f"{self.where}: a sum adds over the elements of every param, but "
                             f"this exists for {kind.only} params only: give the others a "
                             f"value with `A if factored else B`")
        return Sum(name, expr, text, whole)

    def line(self, number: int, text: str, what: str = "update", per_tensor=False) -> Line:
        self.where, self.text = f"{what} line {number} ({text!r})", text
        self.per_tensor = per_tensor
        try:
            tree = ast.parse(text, mode="exec")
        except SyntaxError as error:
            raise ValueError(f"{self.where}: {error.msg}") from None
        statement = tree.body[0] if len(tree.body) == 1 else None
        if (not isinstance(statement, ast.Assign) or len(statement.targets) != 1
                or not isinstance(statement.targets[0], ast.Name)):
            raise ValueError(f"{self.where}: each line is one assignment NAME = expression")
        target, expr = statement.targets[0].id, statement.value
        kind = self.expr(expr)
        if kind.boolean:
            raise TypeError(f"{self.where}: a comparison is only a where() condition, not a "
                            f"value to assign")
        if self.per_tensor and (not kind.uniform or target in self.slots):
            raise ValueError(f"{self.where}: finish lines compute per-tensor values from sums, "
                             f"hyperparameters and step: no slots")
        if target in self.program.scalars and not kind.uniform:
            raise ValueError(f"{self.where}: scalar state {target!r} holds one value for the "
                             f"whole list: assign it from numbers, hyperparameters, step and "
                             f"scalars, not from slots")
        only = kind.only
        if target in self.slots:
            if not self.slots[target].written:
                raise ValueError(f"{self.where}: slot {target!r} is read-only (declared "
                                 f"{target}:r)")
            only = self._slot_line(self.slots[target], kind)
            self.assigned.add(target)
        elif (target in self.program.hyper or target in (STEP, NUMEL, FACTORED)
              or target in FUNCTIONS or target in self.sum_names):
            raise ValueError(f"{self.where}: {target!r} is a hyperparameter or reserved name "
                             f"and cannot be assigned")
        else:
            self.temporaries[target] = kind
        return Line(number, target, expr, text, only)

    def _slot_line(self, slot: Slot, kind: Kind) -> str | None:
        """Which params a line assigning `slot` runs for (None: all), checking that its
        value exists for them and varies only along the slot's axes."""
        if slot.form == FULL:
            if kind.only:
                raise ValueError(f"{self.where}: slot {slot.name!r} is kept for every param, "
                                 f"but this value exists for {kind.only} params only: give "
                                 f"the others one with `A if factored else B`")
            return None
        if slot.form == UNFACTORED:
            if kind.only == FACTORED_ONLY:
                raise ValueError(f"{self.where}: slot {slot.name!r} is @unfactored, but this "
                                 f"value exists for factored params only")
            return UNFACTORED_ONLY
        if kind.only == UNFACTORED_ONLY:
            raise ValueError(f"{self.where}: slot {slot.name!r} is @{slot.form}, but this "
                             f"value exists for unfactored params only")
        if not kind.uniform and not kind.axes <= AXES[slot.form]:
            other = "columns" if slot.form == ROW else "rows"
            mean = "row_mean" if slot.form == ROW else "col_mean"
            raise ValueError(f"{self.where}: slot {slot.name!r} holds one value per "
                             f"{slot.form}, but this value varies along the {other}: take "
                             f"its {mean}()")
        return FACTORED_ONLY

    def expr(self, node) -> Kind:
        kind = self._kind(node)
        self.program.kinds[id(node)] = kind
        return kind

    def _join(self, kinds, boolean: bool = False) -> Kind:
        """The kind of a value computed from values of `kinds`."""
        onlys = {k.only for k in kinds} - {None}
        if len(onlys) > 1:
            raise ValueError(f"{self.where}: mixes values of factored params (@row and @col "
                             f"slots, row_mean, col_mean) with values of unfactored ones: "
                             f"choose between them with `A if factored else B`")
        uniform = all(k.uniform for k in kinds)
        axes = frozenset().union(*(k.axes for k in kinds if not k.uniform))
        return Kind(uniform=uniform, boolean=boolean, axes=axes,
                    only=onlys.pop() if onlys else None)

    def _kind(self, node) -> Kind:
        if isinstance(node, ast.IfExp):
            return self._if_factored(node)
        if isinstance(node, ast.Constant):
            if (isinstance(node.value, bool) or not isinstance(node.value, (int, float))
                    or not math.isfinite(node.value)):
                raise ValueError(f"{self.where}: {node.value!r} is not a finite number")
            return Kind(uniform=True)
        if isinstance(node, ast.Name):
            return self._name(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return self._numeric(node.operand, "unary minus")
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left = self._numeric(node.left, BINARY[type(node.op)])
            right = self._numeric(node.right, BINARY[type(node.op)])
            if isinstance(node.op, (ast.Div, ast.Mod)) and _is_zero(node.right):
                raise ValueError(f"{self.where}: division by the literal 0")
            return self._join((left, right))
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in COMPARE:
                raise ValueError(f"{self.where}: one comparison (< <= > >= == !=) at a time")
            left = self._numeric(node.left, "a comparison")
            right = self._numeric(node.comparators[0], "a comparison")
            return self._join((left, right), boolean=True)
        if isinstance(node, ast.Call):
            return self._call(node)
        token = ast.get_source_segment(self.text, node) or type(node).__name__
        raise ValueError(f"{self.where}: {type(node).__name__} ({token}) is not part of the rule "
                         f"language (numbers, names, + - * / ** %, comparisons, where(), "
                         f"`A if factored else B` and "
                         f"{', '.join(f for f in FUNCTIONS if f != 'where')})")

    def _if_factored(self, node: ast.IfExp) -> Kind:
        """`A if factored else B`: A for factored params, B for the others."""
        if not (isinstance(node.test, ast.Name) and node.test.id == FACTORED):
            token = ast.get_source_segment(self.text, node) or "IfExp"
            raise ValueError(f"{self.where}: IfExp ({token}) is `A if factored else B` only "
                             f"(per element choices: where(cond, a, b))")
        body = self._numeric(node.body, "`A if factored else B`")
        orelse = self._numeric(node.orelse, "`A if factored else B`")
        if body.only == UNFACTORED_ONLY or orelse.only == FACTORED_ONLY:
            raise ValueError(f"{self.where}: in `A if factored else B`, A is for factored "
                             f"params and B for unfactored ones")
        return Kind(uniform=body.uniform and orelse.uniform,
                    axes=frozenset().union(*(k.axes for k in (body, orelse) if not k.uniform)))

    def _name(self, name: str) -> Kind:
        if name in self.sum_names:
            if not self.defined_sums:
                raise ValueError(f"{self.where}: sum {name!r} is not known yet (a sum reads "
                                 f"the values before the first line that uses a sum)")
            return Kind(uniform=True)
        if name in self.slots:
            form = self.slots[name].form
            only = (FACTORED_ONLY if form in (ROW, COL) else
                    UNFACTORED_ONLY if form == UNFACTORED else None)
            return Kind(uniform=False, axes=AXES[form], only=only)
        if (name in self.program.hyper or name in (STEP, NUMEL)
                or name in self.program.scalars):
            return Kind(uniform=True)
        if name == FACTORED:
            raise ValueError(f"{self.where}: {FACTORED!r} is only the test of `A if factored "
                             f"else B`")
        if name in self.temporaries:
            return self.temporaries[name]
        raise ValueError(f"{self.where}: unknown name {name!r} (slots: "
                         f"{', '.join(self.slots)}; hyperparameters: "
                         f"{', '.join(self.program.hyper) or 'none'}; step; scalars: "
                         f"{', '.join(self.program.scalars) or 'none'}; or a name assigned on an "
                         f"earlier line)")

    def _numeric(self, node, what: str) -> Kind:
        kind = self.expr(node)
        if kind.boolean:
            raise TypeError(f"{self.where}: a comparison cannot be an operand of {what}; use "
                            f"where(cond, a, b)")
        return kind

    def _call(self, node: ast.Call) -> Kind:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS:
            shown = name or ast.get_source_segment(self.text, node.func)
            raise ValueError(f"{self.where}: {shown}() is not a rule function (allowed: "
                             f"{', '.join(FUNCTIONS)})")
        if node.keywords or len(node.args) != FUNCTIONS[name]:
            raise TypeError(f"{self.where}: {name}() takes {FUNCTIONS[name]} positional "
                            f"argument(s)")
        if name == "where":
            cond = self.expr(node.args[0])
            if not cond.boolean:
                raise TypeError(f"{self.where}: where()'s first argument must be a comparison")
            a, b = (self._numeric(arg, "where()") for arg in node.args[1:])
            return self._join((cond, a, b))
        kinds = [self._numeric(arg, f"{name}()") for arg in node.args]
        if name in MEANS:
            return self._mean(name, kinds[0])
        return self._join(kinds)

    def _mean(self, name: str, kind: Kind) -> Kind:
        """row_mean and col_mean: means over a factored param's rows or columns."""
        if kind.uniform:
            raise ValueError(f"{self.where}: {name}() of a value that is the same for every "
                             f"element is that value")
        if kind.only == UNFACTORED_ONLY:
            raise ValueError(f"{self.where}: {name}() is a mean over a factored param's "
                             f"{'rows' if name == 'row_mean' else 'columns'}, of a value of "
                             f"unfactored params")
        return Kind(uniform=False, axes=kind.axes - {MEANS[name]}, only=FACTORED_ONLY)


def _is_zero(node) -> bool:
    return (isinstance(node, ast.Constant) and not isinstance(node.value, bool)
            and isinstance(node.value, (int, float)) and node.value == 0)


def names_read(expr) -> set:
    """The names an expression reads."""
    return {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}
