"""How a rule with factored slots runs on a GPU: which of its means the reduction passes take
before the chunk walker's passes (kernels/factored.cuh), or why it cannot.

- A line that assigns a `@row` (`@col`) slot runs once per row (column) in the combine pass: it
  reads numbers, hyperparameters, values computed from them, slots of its own form, and
  row_mean (col_mean) of element values, which the factor pass sums over the row (column).
- col_mean of row values (row_mean of column values), read by element lines, are means over
  each matrix's rows (columns) of the new row (column) state: the matrix pass takes them.
- The walker's passes read each element's row and column state after the combine pass wrote
  it: a line that reads a `@row` or `@col` slot comes after the line assigning it (if any).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from ._factored import COL, ROW
from ._language import MEANS, Program, names_read

_FORM_MEAN = {ROW: "row_mean", COL: "col_mean"}


@dataclass(frozen=True)
class Passes:
    row_means: tuple  # row_mean calls summed over each row (in the lines of @row slots)
    col_means: tuple
    matrix_means: tuple  # (call, form of the vector it reduces) per matrix
    vector_lines: dict  # line index -> ROW or COL, for the lines assigning factored slots
    limit: int  # lines before this one come before any use of a sum

    def form_of(self, call) -> str:
        return next(form for c, form in self.matrix_means if c is call)


class Unsupported(Exception):
    """Why a factored rule has no CUDA kernel."""


def mean_calls(expr) -> list:
    """The row_mean and col_mean calls in `expr`."""
    return [n for n in ast.walk(expr)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) in MEANS]


def mean_key(call) -> tuple:
    """What makes two mean calls one mean: the function and its argument's text."""
    return call.func.id, ast.dump(call.args[0])


def _outside_means(expr):
    """The nodes of `expr` outside its mean calls' arguments."""
    todo = [expr]
    while todo:
        node = todo.pop()
        yield node
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in MEANS):
            todo.extend(ast.iter_child_nodes(node))


def _result(program: Program) -> tuple:
    """(Passes or None, why not), made once and kept with the program."""
    made = program.__dict__.get("_factored_passes")
    if made is None:
        try:
            made = (_analyse(program), "")
        except Unsupported as why:
            made = (None, str(why))
        program.__dict__["_factored_passes"] = made
    return made


def passes(program: Program) -> Passes | None:
    """The passes of a factored rule (None where it has none on a GPU: `refusal`)."""
    return _result(program)[0]


def refusal(program: Program) -> str:
    """Why a factored rule has no CUDA kernel ("" where it has one)."""
    return _result(program)[1]


def _analyse(program: Program) -> Passes:
    slots = {s.name: s for s in program.slots}
    limit = program.prefix if program.sums else len(program.lines)
    assigned: dict = {}
    row_means, col_means, matrix_means, vector_lines = [], [], [], {}
    for k, line in enumerate(program.lines):
        where = f"line {line.number} ({line.text!r})"
        form = slots[line.target].form if line.target in slots else None
        if form in (ROW, COL):
            if line.target in assigned or k >= limit:
                raise Unsupported(f"{where}: a @{form} slot is assigned once, before the first "
                                  f"use of a sum")
            means = _vector_line(program, line, form, slots, where)
            (row_means if form == ROW else col_means).extend(means)
            vector_lines[k] = form
        else:
            for call in mean_calls(line.expr):
                matrix_means.append((call, _matrix_mean(program, call, slots, assigned, limit,
                                                        where)))
            _check_reads(line.expr, slots, assigned, where)
        if form in (ROW, COL):
            assigned[line.target] = k
    for total in program.sums:
        _check_reads(total.expr, slots, assigned, f"sum {total.name!r}")
    return Passes(tuple(row_means), tuple(col_means), tuple(matrix_means), vector_lines, limit)


def _check_reads(expr, slots: dict, assigned: dict, where: str) -> None:
    """An element line reads a @row or @col slot's new value: after the line assigning it."""
    written = {name for name, s in slots.items() if s.form in (ROW, COL) and s.written}
    early = sorted((names_read(expr) & written) - set(assigned))
    if early:
        raise Unsupported(f"{where} reads {early[0]!r} before the line assigning it (the GPU "
                          f"passes read its new value)")


def _vector_line(program: Program, line, form: str, slots: dict, where: str) -> list:
    """The means a line assigning a slot of `form` sums, checking what it reads."""
    for node in _outside_means(line.expr):
        if not isinstance(node, ast.Name) or _uniform(program, node):
            continue
        if node.id not in slots or slots[node.id].form != form:
            raise Unsupported(f"{where}: a @{form} line reads numbers, @{form} slots and "
                              f"{_FORM_MEAN[form]}() of element values on a GPU, not "
                              f"{node.id!r}")
    means = mean_calls(line.expr)
    for call in means:
        arg = call.args[0]
        if call.func.id != _FORM_MEAN[form] or program.kind(arg).axes != frozenset("rc"):
            raise Unsupported(f"{where}: a @{form} line takes {_FORM_MEAN[form]}() of element "
                              f"values on a GPU")
        if mean_calls(arg):
            raise Unsupported(f"{where}: a mean of a mean")
        for node in ast.walk(arg):
            if isinstance(node, ast.Name) and node.id in slots and slots[node.id].form != "full":
                raise Unsupported(f"{where}: {_FORM_MEAN[form]}() of full slots and values "
                                  f"computed from them on a GPU, not of {node.id!r}")
    return means


def _matrix_mean(program: Program, call, slots: dict, assigned: dict, limit: int,
                 where: str) -> str:
    """The form of the vector (ROW: col_mean of row values) a per-matrix mean reduces."""
    arg = call.args[0]
    form = {("col_mean", frozenset("r")): ROW,
            ("row_mean", frozenset("c")): COL}.get((call.func.id, program.kind(arg).axes))
    if form is None or program.kind(arg).uniform:
        raise Unsupported(f"{where}: on a GPU, element lines take col_mean() of row values and "
                          f"row_mean() of column values only ({_FORM_MEAN.get(ROW)}() of element "
                          f"values goes in the lines of @row slots)")
    for node in ast.walk(arg):
        if not isinstance(node, ast.Name) or (_uniform(program, node)
                                              and node.id not in names_after(program, limit)):
            continue
        if node.id not in slots or slots[node.id].form != form:
            raise Unsupported(f"{where}: {call.func.id}() reads @{form} slots and numbers "
                              f"before any sum on a GPU, not {node.id!r}")
    return form


def _uniform(program: Program, name: ast.Name) -> bool:
    """Whether a name read is a number for the whole tensor (a called function's name, or
    the test `factored`, has no kind: not a value)."""
    kind = program.kinds.get(id(name))
    return kind is None or kind.uniform


def names_after(program: Program, limit: int) -> set:
    """The names that lines from `limit` on (those after a sum's use) assign."""
    return {line.target for line in program.lines[limit:]} | {s.name for s in program.sums}


def numbered(calls) -> tuple:
    """(id of each call -> the number of its argument, one call of each argument): calls of
    one mean of the same text share a sum."""
    numbers, firsts = {}, {}
    for call in calls:
        key = mean_key(call)
        if key not in firsts:
            firsts[key] = call
        numbers[id(call)] = list(firsts).index(key)
    return numbers, tuple(firsts.values())
