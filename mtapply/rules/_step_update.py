"""A rule's step as the update optax returns: the program whose param line writes the step
itself, rather than the new param from which the update is then taken as new - old.

A param line `param = param - x` (or `+ x`) becomes `param = -(x)` (or `x`). The update is
then x as the rule computes it, where new - old in the param's precision loses the digits of x
below the param's last one (a param of 1000 and a step of 1e-5 give an update of 0 in
float32). Other forms of the line (`param * (1 - lr * wd) - x`) keep new - old.
"""
from __future__ import annotations

import ast

from ._language import Program, parse

_SOURCE = "_parse_args"  # the program's parse arguments, kept by `keep_source`
_MADE = "_step_program"


def keep_source(program: Program, args: tuple) -> None:
    """Keeps the arguments `parse` made the program from, to parse its step variant later."""
    program.__dict__[_SOURCE] = args


def step_program(program: Program) -> Program | None:
    """The program whose param line gives the step itself (module docstring), made once; None
    where its one param line is not `param - x` or `param + x`, a later line reads param, or
    its source was not kept."""
    if _MADE not in program.__dict__:
        program.__dict__[_MADE] = _made(program)
    return program.__dict__[_MADE]


def _made(program: Program) -> Program | None:
    args = program.__dict__.get(_SOURCE)
    where = [k for k, line in enumerate(program.lines) if line.target == "param"]
    if args is None or len(where) != 1:
        return None
    line = program.lines[where[0]]
    expr = line.expr
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub))
            and isinstance(expr.left, ast.Name) and expr.left.id == "param"):
        return None
    if any(isinstance(node, ast.Name) and node.id == "param"
           for later in program.lines[where[0] + 1:] for node in ast.walk(later.expr)):
        return None
    slots, hyper, update, *rest = args
    texts = update.splitlines()
    if line.number > len(texts) or line.text not in texts[line.number - 1]:
        return None  # a finish line, not the update's
    step = ast.unparse(expr.right)
    texts[line.number - 1] = (f"param = -({step})" if isinstance(expr.op, ast.Sub)
                              else f"param = {step}")
    return parse(slots, hyper, "\n".join(texts), *rest)
