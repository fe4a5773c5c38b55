"""A rule's update as a CUDA functor on the chunk walker.

The functor has the shape of the hand-written ones (kernels/sgd.cuh): an Args struct of 8-byte
words (each hyperparameter and the step as a number and a device pointer, read by scalar_arg),
every name of the rule prefixed in C++ (hv_, hp_, h_, t_, s_, q_: a rule's names are Python
identifiers, which may be C++ keywords such as `int` or `default`),
a constructor that computes every uniform value once per launch in double, as torch does on the
host, and rounds it to acc_t, and an operator() over one element's slots in acc_t.
"""
from __future__ import annotations

import ast

from ._language import STEP, Program

HELPERS = """
template <class T> __device__ __forceinline__ T rule_rsqrt(T x) { return T(1) / sqrt(x); }
template <class T> __device__ __forceinline__ T rule_mod(T a, T b) { return a - b * floor(a / b); }
template <class T> __device__ __forceinline__ T rule_sign(T x) {
  return x != x ? x : T((x > T(0)) - (x < T(0)));
}
"""
_FUNCTIONS = {"sqrt": "sqrt", "rsqrt": "rule_rsqrt", "abs": "fabs", "sign": "rule_sign",
              "exp": "exp", "log": "log", "min": "fmin", "max": "fmax"}
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def functor_source(program: Program, struct: str) -> str:
    """C++ of the rule's functors (`functor_names`) and their Args, in namespace mta, for
    kernels that include walker.cuh first."""
    fields = [f"  {ctype} {field};" for name in (*program.hyper, STEP)
              for ctype, field in zip(("double", "const float*"), c_fields(name))]
    if program.scalars:
        fields.append(f"  float* {SCALARS};  // copies of the scalar state (Rule.initial_scalars)")
    parts = ["namespace mta {", HELPERS, f"struct {struct}Args {{", *fields, "};", ""]
    if program.sums:
        parts.append(_Writer(program, f"{struct}Sums", f"{struct}Args", first_pass=True).functor())
    parts.append(_Writer(program, struct, f"{struct}Args", first_pass=False).functor())
    return "\n".join(parts + ["}  // namespace mta"]) + "\n"


def functor_names(program: Program, struct: str) -> tuple:
    """The C++ functor of each pass: with sums, the summing pass and then the update."""
    return ((f"mta::{struct}Sums",) if program.sums else ()) + (f"mta::{struct}",)


def arg_fields(program: Program) -> tuple:
    """The Args words in order, as the host names them: each hyperparameter and the step (by
    `field_name`), then its device pointer (the same, plus "_ptr"); then, with scalar state,
    the address of its array."""
    return tuple(f for name in (*program.hyper, STEP)
                 for f in (field_name(name), f"{field_name(name)}_ptr")) + _scalar_words(program)


def arg_members(program: Program) -> tuple:
    """The C++ names of the Args words, in the order of `arg_fields`."""
    return tuple(c for name in (*program.hyper, STEP) for c in c_fields(name)) + _scalar_words(
        program)


SCALARS = "scalars_out"  # the argument (and Args member) of a rule's scalar state array


def _scalar_words(program: Program) -> tuple:
    return (SCALARS,) if program.scalars else ()


# The host names a kernel argument word by a suffix where it carries an address (`_ptr`,
# `_array`, `_out`: mtapply._launch): a hyperparameter whose name ends so gets a mark that no
# identifier has, so that its number is not taken for an address.
_ADDRESS_SUFFIXES = ("_ptr", "_array", "_out")


def field_name(name: str) -> str:
    """The host's name of the argument word of hyperparameter `name`."""
    return f"{name}#" if name.endswith(_ADDRESS_SUFFIXES) else name


def c_fields(name: str) -> tuple:
    """The C++ names of the Args fields of hyperparameter `name`, its number and its device
    pointer: prefixed, so that no name is a C++ keyword and none clashes with another (`x`'s
    pointer and `x_ptr`'s number). The step keeps the names the walker reads."""
    return (STEP, f"{STEP}_ptr") if name == STEP else (f"hv_{name}", f"hp_{name}")


class _Writer:
    """One functor: the update, or (first_pass) the lines before the first use of a sum and
    the sums themselves, with nothing stored."""

    def __init__(self, program: Program, struct: str, args: str, first_pass: bool):
        self.program, self.struct, self.args, self.first_pass = program, struct, args, first_pass
        self.slot_index = {s.name: k for k, s in enumerate(program.slots)}
        self.members: list = []  # (C type, name)
        self.setup: list = []  # constructor statements
        self.body: list = []  # operator() statements
        self.names: dict = {}  # temporary -> its latest C name; sums -> theirs
        self.versions: dict = {}

    def functor(self) -> str:
        program, n_sums = self.program, len(self.program.sums)
        reads = [f"    const double h_{name} = scalar_arg(a.{c_fields(name)[1]}, a.{c_fields(name)[0]});"
                 for name in (*program.hyper, STEP)]
        n_scalars = len(program.scalars)
        if n_scalars:  # the copy of the step before (odd steps read copy 0), see Rule
            reads.append(f"    const long long z_parity = static_cast<long long>(h_{STEP}) & 1;")
            reads += [f"    const double h_{name} = static_cast<double>("
                      f"a.{SCALARS}[(1 - z_parity) * {n_scalars} + {k}]);"
                      for k, name in enumerate(program.scalars)]
        if self.first_pass:
            for line in program.lines[:program.prefix]:
                self._line(line)
            self.body += [f"sums[{k}] += static_cast<float>({self.element(total.expr)});  "
                          f"// {total.name} = sum({total.text})"
                          for k, total in enumerate(program.sums)]
            call = "operator()(acc_t (&x)[N_SLOTS], float (&sums)[N_SUMS]) const {"
            written, counted = "0u", n_sums
        else:
            for k, total in enumerate(program.sums):
                self.names[total.name] = f"q_{total.name}"
                reads.append(f"    const double q_{total.name} = "
                             f"static_cast<double>(sums[{n_sums} * tensor + {k}]);")
            for line in program.lines:
                self._line(line)
            call = "operator()(acc_t (&x)[N_SLOTS]) const {"
            written = " | ".join(f"(1u << {self._slot(slot.name)})"
                                 for slot in program.slots if slot.written)
            counted = 0
            # every block computes the same values; one thread stores them in the copy that no
            # block of this step reads, and as the latest values (read between steps)
            for k, name in enumerate(program.scalars):
                value = f"static_cast<float>({self.uniform_name(name)})"
                self.setup.append(f"if (blockIdx.x == 0 && threadIdx.x == 0) {{ "
                                  f"a.{SCALARS}[z_parity * {n_scalars} + {k}] = {value}; "
                                  f"a.{SCALARS}[{2 * n_scalars + k}] = {value}; }}")
        enum = ", ".join(self._slot(slot.name) for slot in program.slots)
        s = self.struct
        lines = [f"struct {s} {{", f"  enum Slot {{ {enum} }};",
                 f"  static constexpr int N_SLOTS = {len(program.slots)}, N_SUMS = {counted};",
                 f"  static constexpr unsigned WRITTEN = {written};",
                 f"  using Args = {self.args};",
                 *(f"  {ctype} {name};" for ctype, name in self.members), "",
                 f"  __device__ {s}(const Args& a, int tensor, const float* sums) {{",
                 "    (void)tensor; (void)sums;", *reads, *(f"    {line}" for line in self.setup),
                 "  }", "", f"  __device__ __forceinline__ void {call}",
                 *(f"    {line}" for line in self.body), "  }", "};", ""]
        return "\n".join(lines)

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

    def uniform_name(self, name: str) -> str:
        """The C name of a uniform value's latest version (a scalar never assigned: its read)."""
        return self.names.get(name, f"h_{name}")

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
            if isinstance(node.op, ast.Mod):  # Python's: the sign of the divisor
                return f"rule_mod({sub(node.left)}, {sub(node.right)})"
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
