"""A rule's update on the CPU: the checked program evaluated with NumPy, tensor by tensor.

It follows the CUDA functor's arithmetic: every maximal uniform subexpression is computed in
float64 (as the functor's constructor does, once per launch) and rounded to the math type where
element values use it; element values are computed in the math type (float32, or float64 for
float64 params). x**2 is x*x and x**0.5 is sqrt(x) in both.

A factored rule's param is stepped as factored or not (`factored`, see `_factored`): its values
come as a stack of matrices with row and column slots beside them, and the lines run are that
mode's (`A if factored else B` picks its branch; row_mean and col_mean are NumPy means over
the last and the second-to-last axis, a fixed summation order).

Each program is translated once into Python functions of NumPy calls (`compiled`), so that a
step costs the NumPy operations themselves rather than a walk of the expression trees.
"""
from __future__ import annotations

import ast

import numpy as np

from ._factored import COL, FACTORED_ONLY, ROW, UNFACTORED, UNFACTORED_ONLY
from ._language import NUMEL, STEP, Program

_ELEMENT_FUNCTIONS = {"sqrt": np.sqrt, "abs": np.abs, "sign": np.sign, "exp": np.exp,
                      "log": np.log, "min": np.fmin, "max": np.fmax}


def evaluate(program: Program, arrays: dict, scalars: dict, dtype, state=None,
             totals=None, factored: bool | None = None) -> dict:
    """New values of the written slots of one tensor. `arrays`: slot name -> values in `dtype`;
    `scalars`: hyperparameter (and step) name -> float; `state`: the float32 array of the
    rule's scalar state (see `Rule.initial_scalars`), updated here; `totals`: the whole-list
    sums, in `program.totals` order (`whole_sums`); `factored`: for a factored rule, whether
    the param steps as factored (its slots then of the `_factored.canonical_shape`s), and
    only the slots it keeps are given back."""
    env = _environment(program, arrays, scalars, state)
    with np.errstate(all="ignore"):
        if program.sums:  # each tensor's sums, and the list's
            env.update(zip((s.name for s in program.sums),
                           tensor_sums(program, arrays, scalars, dtype, state, factored)))
            if program.totals:
                env.update(zip((t.name for t in program.totals), map(np.float64, totals)))
        compiled(program, factored).lines(env, dtype)
    n_state, parity = len(program.scalars), int(scalars.get(STEP, 0)) & 1
    for k, name in enumerate(program.scalars):
        state[parity * n_state + k] = state[2 * n_state + k] = np.float32(env[name])
    kept = {ROW: factored, COL: factored, UNFACTORED: not factored}
    return {s.name: _result(env[s.name], arrays, dtype, arrays[s.name].shape)
            for s in program.slots if s.written and kept.get(s.form, True)}


def _result(value, arrays: dict, dtype, shape) -> np.ndarray:
    """A written slot's values as a new array of `dtype`: an array the lines made is taken as
    it is, anything else (a uniform value, a slot's own array) copied."""
    if (isinstance(value, np.ndarray) and value.base is None and value.dtype == dtype
            and value.shape == shape and value.flags.writeable
            and not any(value is given for given in arrays.values())):
        return value
    return np.broadcast_to(np.asarray(value, dtype), shape).copy()


def _environment(program: Program, arrays: dict, scalars: dict, state) -> dict:
    """The names a tensor's lines read: hyperparameters, step, scalar state, slots."""
    env = {name: np.float64(value) for name, value in scalars.items()}
    n_state, parity = len(program.scalars), int(scalars.get(STEP, 0)) & 1
    env.update({name: np.float64(state[(1 - parity) * n_state + k])
                for k, name in enumerate(program.scalars)})
    env.update(arrays)
    env[NUMEL] = np.float64(arrays["param"].size)
    return env


def tensor_sums(program: Program, arrays: dict, scalars: dict, dtype, state=None,
                factored: bool | None = None) -> list:
    """The first pass over one tensor: its lines before the first use of a sum, on copies, then
    each sum of `program.sums` over the tensor's elements, as a float64 of a float32 (the
    kernel adds in float32 in a fixed order; here in float64, rounded once). A rule that runs
    on the CPU only keeps float64 sums of float64 params."""
    shape = arrays["param"].shape
    first = _environment(program, arrays, scalars, state)
    keep = program.cpu_only and dtype == np.float64
    with np.errstate(all="ignore"):
        sums = [np.sum(np.broadcast_to(np.asarray(value, np.float64), shape))
                for value in compiled(program, factored).sums(first, dtype)]
    return [np.float64(total if keep else np.float32(total)) for total in sums]


def whole_sums(program: Program, per_tensor: list) -> np.ndarray:
    """The whole-list sums (float32, in `program.totals` order) from each tensor's
    `tensor_sums`: the kernel adds the tensors' float32 sums in float32, here in float64."""
    whole = [k for k, total in enumerate(program.sums) if total.whole]
    totals = np.zeros(len(whole), np.float64)
    for sums in per_tensor:
        totals += [sums[k] for k in whole]
    return totals.astype(np.float32)


class Compiled:
    """A program as two Python functions of (env, dtype): `lines` runs every line into env;
    `sums` runs the prefix lines into env and returns each sum's element values. `factored`:
    a factored rule's mode (the lines of the other mode left out)."""

    def __init__(self, program: Program, factored: bool | None = None):
        self._program, self._constants, self._factored = program, [], factored
        skipped = UNFACTORED_ONLY if factored else FACTORED_ONLY
        body = [f"    env[{line.target!r}] = {self._value(line.expr)}"
                if line.only != skipped else "    pass" for line in program.lines]
        prefix = body[:program.prefix]
        sums = ", ".join(self._element(total.expr) for total in program.sums)
        source = "\n".join(["def lines(env, dtype):", *body, "    return None",
                            "def sums(env, dtype):", *prefix, f"    return [{sums}]"])
        namespace = {"np": np, "C": self._constants, "F": _ELEMENT_FUNCTIONS, "CMP": _COMPARE,
                     "hoist": _hoist, "square": _square, "mod": _mod, "pick": _pick,
                     "BIN": _binary_into}
        exec(compile(source, f"<rule {id(program):x}>", "exec"), namespace)  # noqa: S102
        self.lines, self.sums = namespace["lines"], namespace["sums"]

    def _value(self, node) -> str:
        """A float64 scalar when uniform, else an array in the math type."""
        return self._uniform(node) if self._program.kind(node).uniform else self._element(node)

    def _element(self, node) -> str:
        if isinstance(node, ast.IfExp):  # `A if factored else B`: the mode's branch
            return self._element(node.body if self._factored else node.orelse)
        if self._program.kind(node).uniform:  # hoisted: computed in float64, then rounded
            return f"hoist({self._uniform(node)}, dtype)"
        if isinstance(node, ast.Name):  # a slot, or a temporary of element values
            return f"env[{node.id!r}]"
        return self._apply(node, self._element, "dtype(1)")

    def _uniform(self, node) -> str:
        if isinstance(node, ast.IfExp):
            return self._uniform(node.body if self._factored else node.orelse)
        if isinstance(node, ast.Constant):
            self._constants.append(np.float64(node.value))
            return f"C[{len(self._constants) - 1}]"
        if isinstance(node, ast.Name):
            return f"np.float64(env[{node.id!r}])" if node.id == STEP else f"env[{node.id!r}]"
        return self._apply(node, self._uniform, "np.float64(1)")

    def _apply(self, node, sub, one: str) -> str:
        if isinstance(node, ast.UnaryOp):
            operand = sub(node.operand)
            return f"(-{operand})" if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp):
            return self._binary(node, sub)
        if isinstance(node, ast.Compare):
            return (f"CMP[{type(node.ops[0]).__name__!r}]({sub(node.left)}, "
                    f"{sub(node.comparators[0])})")
        name, args = node.func.id, [sub(arg) for arg in node.args]
        if name == "where" and sub == self._element and self._program.kind(node.args[0]).uniform:
            # the same for every element: the branch it picks, the other never computed
            return f"({args[1]} if {self._uniform(node.args[0])} else {args[2]})"
        if name == "where":
            return f"{'np.where' if sub == self._element else 'pick'}({', '.join(args)})"
        if name == "rsqrt":
            return f"({one} / np.sqrt({args[0]}))"
        if name in _MEAN_AXES:  # over each row (the last axis) or column, of the stack
            return f"np.mean({args[0]}, axis={_MEAN_AXES[name]}, keepdims=True)"
        return f"F[{name!r}]({', '.join(args)})"

    @staticmethod
    def _binary(node: ast.BinOp, sub) -> str:
        left = sub(node.left)
        if isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant):
            if node.right.value == 2:
                return f"square({left})"
            if node.right.value == 0.5:
                return f"np.sqrt({left})"
        right = sub(node.right)
        if isinstance(node.op, ast.Mod):  # as the kernel computes it (Python's sign convention)
            return f"mod({left}, {right})"
        operator = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}.get(type(node.op))
        if operator and sub.__name__ == "_element":  # an array made here may take the result
            fresh = (sub.__self__._fresh(node.left), sub.__self__._fresh(node.right))
            if any(fresh):
                return f"BIN({_UFUNCS[operator]}, {left}, {right}, {fresh[0]}, {fresh[1]})"
        return f"({left} {operator} {right})" if operator else f"np.power({left}, {right})"

    def _fresh(self, node) -> bool:
        """Whether `_element(node)` is always a new float array that nothing else holds: the
        result of an arithmetic operation or function on element values (not a slot, a
        temporary, a uniform value, a comparison or a uniform choice between two values)."""
        if self._program.kind(node).uniform:
            return False
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant):
                return node.right.value in (2, 0.5)
            return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div))
        if isinstance(node, ast.UnaryOp):
            return isinstance(node.op, ast.USub) or self._fresh(node.operand)
        if isinstance(node, ast.IfExp):
            return self._fresh(node.body if self._factored else node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "where":
                return not self._program.kind(node.args[0]).uniform
            return node.func.id in ("sqrt", "abs", "sign", "exp", "log", "min", "max", "rsqrt",
                                    "row_mean", "col_mean")
        return False


def compiled(program: Program, factored: bool | None = None) -> Compiled:
    """The program's NumPy functions (those of a factored rule's mode), made on first use and
    kept with the program."""
    made = program.__dict__.setdefault("_numpy", {})
    functions = made.get(factored)
    if functions is None:
        functions = made[factored] = Compiled(program, factored)
    return functions


_MEAN_AXES = {"row_mean": -1, "col_mean": -2}


def _hoist(value, dtype):
    return value if isinstance(value, (bool, np.bool_)) else dtype(value)


_UFUNCS = {"+": "np.add", "-": "np.subtract", "*": "np.multiply", "/": "np.divide"}


def _binary_into(ufunc, a, b, a_fresh: bool, b_fresh: bool):
    """ufunc(a, b), written into `a` or `b` where that operand is a new array of this line
    (`Compiled._fresh`) of the result's type and shape: the same values, one array fewer."""
    if a_fresh and _fits(a, b):
        return ufunc(a, b, out=a)
    if b_fresh and _fits(b, a):
        return ufunc(a, b, out=b)
    return ufunc(a, b)


def _fits(made, other) -> bool:
    return (type(made) is np.ndarray and made.dtype.kind == "f"
            and isinstance(other, (np.ndarray, np.generic)) and other.dtype == made.dtype
            and (other.shape == made.shape or other.ndim == 0))


def _square(x):
    return x * x


def _mod(a, b):
    return a - b * np.floor(a / b)


def _pick(condition, if_true, if_false):
    """A uniform where: every argument evaluated, as the kernel's constructor does."""
    return if_true if condition else if_false


_COMPARE = {"Lt": np.less, "LtE": np.less_equal, "Gt": np.greater, "GtE": np.greater_equal,
            "Eq": np.equal, "NotEq": np.not_equal}
