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
`in_place` runs the same operations into the tensors' own memory and scratch arrays given,
with each uniform value computed once a step: new arrays only where an operation makes its
own (a comparison, an elementwise where, %), and a product by a uniform 1 is its other factor.
"""
from __future__ import annotations

import ast

import numpy as np

from ._factored import COL, FACTORED_ONLY, ROW, UNFACTORED, UNFACTORED_ONLY
from ._language import NUMEL, STEP, Program

def round_bfloat16(x):
    """x rounded to the nearest bfloat16 (ties to even), as a float of x's width: a float32's
    upper 16 bits, rounded; NaN stays NaN and what overflows goes to infinity, as on a GPU."""
    x = np.asarray(x)
    single = x.astype(np.float32)
    bits = single.view(np.uint32)
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    with np.errstate(over="ignore"):
        rounded = ((bits + np.uint32(0x7FFF) + odd) & np.uint32(0xFFFF0000)).view(np.float32)
    out = np.where(np.isnan(single), single, rounded).astype(
        x.dtype if x.dtype.kind == "f" else np.float64)
    return out if out.ndim else out[()]


_ELEMENT_FUNCTIONS = {"sqrt": np.sqrt, "abs": np.abs, "sign": np.sign, "exp": np.exp,
                      "log": np.log, "min": np.fmin, "max": np.fmax, "bfloat16": round_bfloat16}


def evaluate(program: Program, arrays: dict, scalars: dict, dtype, state=None,
             totals=None, factored: bool | None = None, sum_dtype: str = "float32",
             sums=None) -> dict:
    """New values of the written slots of one tensor. `arrays`: slot name -> values in `dtype`;
    `scalars`: hyperparameter (and step) name -> float; `state`: the array (of `sum_dtype`) of
    the rule's scalar state (see `Rule.initial_scalars`), updated here; `totals`: the whole-list
    sums, in `program.totals` order (`whole_sums`); `factored`: for a factored rule, whether
    the param steps as factored (its slots then of the `_factored.canonical_shape`s), and
    only the slots it keeps are given back. `sums`: the tensor's sums, in `program.sums` order,
    where they were taken before (`tensor_sums`, then summed over the shards of a tensor)."""
    env = _environment(program, arrays, scalars, state)
    functions = compiled(program, factored)
    with np.errstate(all="ignore"):
        if program.sums:  # the prefix lines once, into env: each tensor's sums, the list's
            values = functions.sums(env, dtype)
            if sums is None:
                sums = _sums(program, values, arrays["param"].shape, dtype, sum_dtype)
            env.update(zip((s.name for s in program.sums), sums))
            if program.totals:
                env.update(zip((t.name for t in program.totals), map(np.float64, totals)))
            functions.rest(env, dtype)
        else:
            functions.lines(env, dtype)
    n_state, parity = len(program.scalars), int(scalars.get(STEP, 0)) & 1
    for k, name in enumerate(program.scalars):
        state[parity * n_state + k] = state[2 * n_state + k] = state.dtype.type(env[name])
    kept = {ROW: factored, COL: factored, UNFACTORED: not factored}
    return {s.name: _result(env[s.name], arrays, dtype, arrays[s.name].shape)
            for s in program.slots if s.written and kept.get(s.form, True)}


def in_place(program: Program, scalars: dict, dtype):
    """The update as `evaluate` computes it, written into the tensors' memory, for a program
    without sums or scalar state that has an `into` (else None): a function (arrays, dests,
    scratch) of one tensor, or a range of its elements, with `arrays`: each slot's read-only
    values in `dtype`, in slot order; `dests`: writable views of the written slots' memory, in
    slot order; `scratch`: `compiled(program).n_buffers` arrays of the values' shape and
    `dtype`. Runs under the caller's np.errstate."""
    if program.cpu_only:  # factored slots, means, numel: lines of the param's mode (`evaluate`)
        return None
    functions = compiled(program)
    if functions.into is None or program.sums or program.scalars:
        return None
    with np.errstate(all="ignore"):
        uniforms = functions.prepare(_environment(program, {}, scalars, None), dtype)
    into = functions.into
    slots = [s.name for s in program.slots]
    mine = [slots.index(s.name) for s in program.slots if s.written]  # each dest's own values

    def step(arrays: tuple, dests: tuple, scratch: list) -> None:
        values = into(arrays, uniforms, scratch, dests)
        left = [(dest, value) for dest, value, own in zip(dests, values, mine)
                if value is not dest and value is not arrays[own]]
        if left:
            _copy_results(left, [arrays[own] for own in mine])

    return step


def _copy_results(left: list, before: list) -> None:
    """Each (dest, value) of written slots whose last line left their value elsewhere than in
    their memory (a name's value, a number, a scratch array) copied there; a value that is a
    written slot's values before the step is read before any copy."""
    left = [(dest, np.array(value) if any(value is old for old in before) else value)
            for dest, value in left]
    for dest, value in left:
        np.copyto(dest, value)


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
    if "param" in arrays:  # (`in_place` prepares the uniform lines without arrays)
        env[NUMEL] = np.float64(arrays["param"].size)
    return env


def tensor_sums(program: Program, arrays: dict, scalars: dict, dtype, state=None,
                factored: bool | None = None, sum_dtype: str = "float32") -> list:
    """The first pass over one tensor: its lines before the first use of a sum, on copies, then
    each sum of `program.sums` over the tensor's elements, as a float64 of a `sum_dtype` (the
    kernel adds in that type in a fixed order; here in float64, rounded once). A rule that runs
    on the CPU only keeps float64 sums of float64 params."""
    first = _environment(program, arrays, scalars, state)
    with np.errstate(all="ignore"):
        values = compiled(program, factored).sums(first, dtype)
        return _sums(program, values, arrays["param"].shape, dtype, sum_dtype)


def _sums(program: Program, values: list, shape: tuple, dtype, sum_dtype: str) -> list:
    """Each sum of the element `values` over a tensor of `shape` (see `tensor_sums`)."""
    keep = sum_dtype == "float64" or (program.cpu_only and dtype == np.float64)
    sums = [np.sum(_spread(np.asarray(value, np.float64), shape)) for value in values]
    return [np.float64(total if keep else np.float32(total)) for total in sums]


def _spread(values: np.ndarray, shape: tuple) -> np.ndarray:
    """`values` over a tensor of `shape`: as they are where they have it (most sums)."""
    return values if values.shape == shape else np.broadcast_to(values, shape)


def whole_sums(program: Program, per_tensor: list, sum_dtype: str = "float32") -> np.ndarray:
    """The whole-list sums (of `sum_dtype`, in `program.totals` order) from each tensor's
    `tensor_sums`: the kernel adds the tensors' sums in that type, here in float64."""
    whole = [k for k, total in enumerate(program.sums) if total.whole]
    totals = np.zeros(len(whole), np.float64)
    for sums in per_tensor:
        totals += [sums[k] for k in whole]
    return totals.astype(sum_dtype)


class Compiled:
    """A program as Python functions of (env, dtype): `lines` runs every line into env;
    `sums` runs the prefix lines into env and returns each sum's element values, and `rest`
    the lines after them (`sums` then `rest`: the lines once each, sums between). `prepare`
    and `into` run every line as `lines` does, into arrays given (see `_Into`; None for a
    program without them, and for a factored rule), `into` with `n_buffers` scratch arrays.
    `factored`: a factored rule's mode (the lines of the other mode left out)."""

    def __init__(self, program: Program, factored: bool | None = None):
        self._program, self._constants, self._factored = program, [], factored
        skipped = UNFACTORED_ONLY if factored else FACTORED_ONLY
        body = [f"    env[{line.target!r}] = {self._value(line.expr)}"
                if line.only != skipped else "    pass" for line in program.lines]
        prefix = body[:program.prefix]
        sums = ", ".join(self._element(total.expr) for total in program.sums)
        source = "\n".join(["def lines(env, dtype):", *body, "    return None",
                            "def sums(env, dtype):", *prefix, f"    return [{sums}]",
                            "def rest(env, dtype):", *body[program.prefix:], "    return None"])
        into = _Into(self, program)
        split = None if program.cpu_only else into.sources()  # (those run `lines` only)
        if split is not None:
            source = "\n".join([source, *split])
        self.n_buffers = into.n_buffers
        namespace = {"np": np, "C": self._constants, "F": _ELEMENT_FUNCTIONS, "CMP": _COMPARE,
                     "hoist": _hoist, "square": _square, "mod": _mod, "pick": _pick,
                     "BIN": _binary_into, "SQUARE": _square_into, "RSQRT": _rsqrt_into,
                     "TIMES_LEFT": _times_left, "TIMES_RIGHT": _times_right}
        exec(compile(source, f"<rule {id(program):x}>", "exec"), namespace)  # noqa: S102
        self.lines, self.sums, self.rest = namespace["lines"], namespace["sums"], namespace["rest"]
        self.prepare, self.into = namespace.get("prepare"), namespace.get("into")

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
                                    "row_mean", "col_mean", "bfloat16")
        return False


class _Into:
    """The source of `Compiled.prepare` and `Compiled.into`: the lines as `lines` computes
    them, the same operations in the same order and types, split in two. `prepare(env, dtype)`
    runs once a step: the uniform lines, and each uniform value the element lines use (a
    number hoisted to the math type, a uniform where's condition), in a list U. `into(A, U, B,
    D)` runs on the element values: A the slots' arrays (read-only), in slot order; every
    element operation a ufunc writing into an array given: a written slot's last line into its
    D (the slot's own memory, the written slots in slot order) where nothing read later needs
    the slot's values from before the step (`direct_lines`), any other into a scratch array
    B[k], taken when the operation is reached and given back once its value is used (a line
    whose value later lines may read keeps its array). It returns the written slots' values.
    A program that assigns a slot a uniform value has no `into` (`lines` keeps that value in
    float64)."""

    def __init__(self, compiled: Compiled, program: Program):
        self._compiled, self._program = compiled, program
        self._free: list = []
        self._uniforms: list = []  # code of each value of U
        self.n_buffers = 0

    def sources(self) -> tuple | None:
        """(source of prepare, source of into), or None where the program has no `into`."""
        program = self._program
        slots = [s.name for s in program.slots]
        written = [s.name for s in program.slots if s.written]
        if any(line.target in slots and program.kind(line.expr).uniform for line in program.lines):
            return None
        direct = direct_lines(program)
        prepare, into = ["def prepare(env, dtype):", "    U = []"], ["def into(A, U, B, D):"]
        into.append(f"    ({', '.join(map(_local, slots))},) = A")
        for k, line in enumerate(program.lines):
            if program.kind(line.expr).uniform:
                prepare.append(f"    env[{line.target!r}] = {self._compiled._uniform(line.expr)}")
                continue
            out = (f"D[{written.index(line.target)}]" if k in direct
                   else f"B[{self._take()}]" if self._computes(line.expr) else None)
            first = len(self._uniforms)
            value = self._element(line.expr, out)[0]
            prepare += [f"    U.append({code})" for code in self._uniforms[first:]]
            into.append(f"    {_local(line.target)} = {value}")
        prepare.append("    return U")
        into.append(f"    return ({', '.join(map(_local, written))},)")
        return "\n".join(prepare), "\n".join(into)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        self.n_buffers += 1
        return self.n_buffers - 1

    def _uniform(self, code: str) -> str:
        self._uniforms.append(code)
        return f"U[{len(self._uniforms) - 1}]"

    def _element(self, node, out):
        """(code, k): the node's element values, computed into `out` (code of an array) where
        given, else into B[k], which the caller gives back once it has used the value (k None:
        no scratch array held)."""
        if self._program.kind(node).uniform:
            return self._uniform(f"hoist({self._compiled._uniform(node)}, dtype)"), None
        if isinstance(node, ast.Name):
            return _local(node.id), None
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return self._ufunc("np.negative", [node.operand], out)
            return self._element(node.operand, out)
        if isinstance(node, ast.BinOp):
            return self._binary(node, out)
        if isinstance(node, ast.Compare):
            return self._allocating(f"CMP[{type(node.ops[0]).__name__!r}]",
                                    [node.left, node.comparators[0]])
        name = node.func.id
        if name == "where" and self._program.kind(node.args[0]).uniform:
            return self._pick(node, out)
        if name == "where":
            return self._allocating("np.where", node.args)
        if name == "rsqrt":
            return self._ufunc("RSQRT", node.args, out)
        if name == "bfloat16":
            return self._allocating("F['bfloat16']", node.args)
        return self._ufunc(f"np.{_ELEMENT_FUNCTIONS[name].__name__}", node.args, out)

    def _binary(self, node: ast.BinOp, out):
        if isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant):
            if node.right.value == 2:
                return self._ufunc("SQUARE", [node.left], out)
            if node.right.value == 0.5:
                return self._ufunc("np.sqrt", [node.left], out)
        if isinstance(node.op, ast.Mod):
            return self._allocating("mod", [node.left, node.right])
        if isinstance(node.op, ast.Mult) and out is None:
            uniform = [self._program.kind(side).uniform for side in (node.left, node.right)]
            if any(uniform):  # a product by a uniform 1 is the other factor, bit for bit
                return self._ufunc(f"TIMES_{'LEFT' if uniform[0] else 'RIGHT'}",
                                   [node.left, node.right], out)
        ufunc = _UFUNCS.get({ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
                             ast.Div: "/"}.get(type(node.op)), "np.power")
        return self._ufunc(ufunc, [node.left, node.right], out)

    def _ufunc(self, function: str, operands: list, out):
        """function(operands..., out=...): into `out`, else into the first operand's scratch
        array (an elementwise operation may write over its own operand), else a new one."""
        parts = [self._element(operand, None) for operand in operands]
        held = [k for _, k in parts if k is not None]
        kept = None
        if out is None:
            kept = held[0] if held else self._take()
            out = f"B[{kept}]"
        self._free += [k for k in held if k != kept]
        return f"{function}({', '.join(code for code, _ in parts)}, out={out})", kept

    def _allocating(self, function: str, operands: list):
        """An operation that makes its own array (a comparison, an elementwise where, mod)."""
        parts = [self._element(operand, None) for operand in operands]
        self._free += [k for _, k in parts if k is not None]
        return f"{function}({', '.join(code for code, _ in parts)})", None

    def _pick(self, node: ast.Call, out):
        """A uniform where: one branch runs, written into the same array as the other."""
        kept = None
        if out is None and self._computes(node):
            kept = self._take()
            out = f"B[{kept}]"
        condition = self._uniform(self._compiled._uniform(node.args[0]))
        (if_true, _), (if_false, _) = (self._element(arg, out) for arg in node.args[1:])
        return f"({if_true} if {condition} else {if_false})", kept

    def _computes(self, node) -> bool:
        """Whether the node's value may be computed into the array given for it (else it is a
        name's value, a number, or an array an operation made)."""
        if self._program.kind(node).uniform or isinstance(node, (ast.Name, ast.Compare)):
            return False
        if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.USub):
            return self._computes(node.operand)
        if isinstance(node, ast.BinOp):
            return not isinstance(node.op, ast.Mod)
        if isinstance(node, ast.Call) and node.func.id == "where":
            return (self._program.kind(node.args[0]).uniform
                    and any(self._computes(arg) for arg in node.args[1:]))
        return True


def _local(name: str) -> str:
    return f"v_{name}"


def direct_lines(program: Program) -> dict:
    """Line index -> slot, for each written slot's last assignment whose value may be written
    straight into the slot's memory: no line after it, nor any other slot's result, reads a
    name that may still hold the slot's values from before the step (`g = momentum_buffer`
    read after momentum_buffer is assigned). The slot's own name, from its last line on,
    reads its memory as it then is: its new values, or the old ones where the line left them
    (a uniform where's branch `momentum_buffer`)."""
    written = {s.name for s in program.slots if s.written}
    last = {line.target: k for k, line in enumerate(program.lines) if line.target in written}
    holds = {s.name: frozenset([s.name]) for s in program.slots}  # name -> slots it may alias
    reads = []  # (line index, name read, the slots it may alias there)
    for k, line in enumerate(program.lines):
        reads += [(k, name, holds.get(name, frozenset())) for name in _names(line.expr)]
        holds[line.target] = _aliased(program, line.expr, holds)
        if last.get(line.target) == k:
            holds[line.target] -= {line.target}
    reads += [(len(program.lines), name, holds[name]) for name in written]
    return {k: slot for slot, k in last.items()
            if not any(i > k and name != slot and slot in held for i, name, held in reads)}


def _names(expr) -> set:
    return {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}


def _aliased(program: Program, node, holds: dict) -> frozenset:
    """The slots whose values before the step `node`'s value may be (a name's, or a uniform
    where's branch), as `lines` evaluates it."""
    if program.kind(node).uniform:
        return frozenset()
    if isinstance(node, ast.Name):
        return holds.get(node.id, frozenset())
    if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.USub):
        return _aliased(program, node.operand, holds)
    if (isinstance(node, ast.Call) and node.func.id == "where"
            and program.kind(node.args[0]).uniform):
        return _aliased(program, node.args[1], holds) | _aliased(program, node.args[2], holds)
    return frozenset()


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


def _square_into(x, out):
    return np.multiply(x, x, out=out)


def _times_left(uniform, x, out):
    return x if uniform == 1 else np.multiply(uniform, x, out=out)


def _times_right(x, uniform, out):
    return x if uniform == 1 else np.multiply(x, uniform, out=out)


def _rsqrt_into(x, out):
    """1 / sqrt(x), as `lines` computes it, in `out`."""
    return np.divide(out.dtype.type(1), np.sqrt(x, out=out), out=out)


def _mod(a, b):
    return a - b * np.floor(a / b)


def _pick(condition, if_true, if_false):
    """A uniform where: every argument evaluated, as the kernel's constructor does."""
    return if_true if condition else if_false


_COMPARE = {"Lt": np.less, "LtE": np.less_equal, "Gt": np.greater, "GtE": np.greater_equal,
            "Eq": np.equal, "NotEq": np.not_equal}
