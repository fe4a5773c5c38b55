"""A rule's update as a CUDA functor on the chunk walker.

The functor has the shape of the hand-written ones (kernels/sgd.cuh): an Args struct of 8-byte
words (each hyperparameter and the step as a number and a device pointer, read by scalar_arg),
a constructor that computes every uniform value once per launch in double, as torch does on the
host, and rounds it to acc_t, and an operator() over one element's slots in acc_t.
"""
from __future__ import annotations

import ast

from ._language import STEP, Program

HELPERS = """
template <class T> __device__ __forceinline__ T rule_rsqrt(T x) { return T(1) / sqrt(x); }
template <class T> __device__ __forceinline__ T rule_sign(T x) {
  return x != x ? x : T((x > T(0)) - (x < T(0)));
}
"""
_FUNCTIONS = {"sqrt": "sqrt", "rsqrt": "rule_rsqrt", "abs": "fabs", "sign": "rule_sign",
              "exp": "exp", "log": "log", "min": "fmin", "max": "fmax"}
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def functor_source(program: Program, struct: str) -> str:
    """C++ of `struct` (and `structArgs`), in namespace mta, for kernels that include
    walker.cuh first."""
    return _Writer(program, struct).source()


def arg_fields(program: Program) -> tuple:
    """The Args words in order: each hyperparameter and the step, then its device pointer."""
    return tuple(f for name in (*program.hyper, STEP) for f in (name, f"{name}_ptr"))


class _Writer:
    def __init__(self, program: Program, struct: str):
        self.program, self.struct = program, struct
        self.slot_index = {s.name: k for k, s in enumerate(program.slots)}
        self.members: list = []  # (C type, name)
        self.setup: list = []  # constructor statements
        self.body: list = []  # operator() statements
        self.names: dict = {}  # temporary -> its latest C name
        self.versions: dict = {}

    def source(self) -> str:
        for line in self.program.lines:
            self._line(line)
        slots, s = self.program.slots, self.struct
        enum = ", ".join(self._slot(slot.name) for slot in slots)
        written = " | ".join(f"(1u << {self._slot(slot.name)})" for slot in slots if slot.written)
        fields = [f"  {'const float*' if f.endswith('_ptr') else 'double'} {f};"
                  for f in arg_fields(self.program)]
        reads = [f"    const double h_{name} = scalar_arg(a.{name}_ptr, a.{name});"
                 for name in (*self.program.hyper, STEP)]
        lines = ["namespace mta {", HELPERS, f"struct {s}Args {{", *fields, "};", "",
                 f"struct {s} {{", f"  enum Slot {{ {enum} }};",
                 f"  static constexpr int N_SLOTS = {len(slots)}, N_SUMS = 0;",
                 f"  static constexpr unsigned WRITTEN = {written};",
                 f"  using Args = {s}Args;",
                 *(f"  {ctype} {name};" for ctype, name in self.members), "",
                 f"  __device__ {s}(const Args& a, int /*tensor*/, const float* /*sums*/) {{",
                 *reads, *(f"    {line}" for line in self.setup), "  }", "",
                 "  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {",
                 *(f"    {line}" for line in self.body), "  }", "};", "", "}  // namespace mta"]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _slot(name: str) -> str:
        """The enumerator of a slot: PARAM and GRAD (which the walker reads), s_NAME else."""
        return name.upper() if name in ("param", "grad") else f"s_{name}"

    def _line(self, line) -> None:
        kind = self.program.kind(line.expr)
        if line.target in self.slot_index:
            self.body.append(f"x[{self._slot(line.target)}] = {self.element(line.expr)};  "
                             f"// {line.text}")
            return
        version = self.versions.get(line.target, -1) + 1
        self.versions[line.target] = version
        name = f"t_{line.target}_{version}"
        if kind.uniform:
            self.setup.append(f"const double {name} = {self.uniform(line.expr)};  // {line.text}")
        else:
            self.body.append(f"const acc_t {name} = {self.element(line.expr)};  // {line.text}")
        self.names[line.target] = name

    def element(self, node) -> str:
        """acc_t code of a node; uniform subexpressions become members set by the constructor."""
        kind = self.program.kind(node)
        if kind.uniform:
            if isinstance(node, ast.Constant):
                return f"acc_t({_literal(node.value)})"
            member = f"k{len(self.members)}"
            self.members.append(("bool" if kind.boolean else "acc_t", member))
            value = self.uniform(node)
            self.setup.append(f"{member} = {value if kind.boolean else f'acc_t({value})'};")
            return member
        if isinstance(node, ast.Name):
            if node.id in self.slot_index:
                return f"x[{self._slot(node.id)}]"
            return self.names[node.id]
        return self._apply(node, self.element, "acc_t")

    def uniform(self, node) -> str:
        """double code of a uniform node, valid in the constructor."""
        if isinstance(node, ast.Constant):
            return _literal(node.value)
        if isinstance(node, ast.Name):
            return self.names.get(node.id) if node.id in self.names else f"h_{node.id}"
        return self._apply(node, self.uniform, "double")

    def _apply(self, node, sub, ctype: str) -> str:
        if isinstance(node, ast.UnaryOp):
            return f"({'-' if isinstance(node.op, ast.USub) else '+'}{sub(node.operand)})"
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow):
                return self._power(node, sub)
            return f"({sub(node.left)} {_BINARY[type(node.op)]} {sub(node.right)})"
        if isinstance(node, ast.Compare):
            return f"({sub(node.left)} {_COMPARE[type(node.ops[0])]} {sub(node.comparators[0])})"
        name, args = node.func.id, [sub(arg) for arg in node.args]
        if name == "where":
            return f"({args[0]} ? {args[1]} : {args[2]})"
        return f"{_FUNCTIONS[name]}({', '.join(args)})"

    def _power(self, node, sub) -> str:
        base = sub(node.left)
        if isinstance(node.right, ast.Constant) and node.right.value == 2:
            return f"({base} * {base})"
        if isinstance(node.right, ast.Constant) and node.right.value == 0.5:
            return f"sqrt({base})"
        return f"pow({base}, {sub(node.right)})"


def _literal(value) -> str:
    return repr(float(value))  # finite: the language refuses others
