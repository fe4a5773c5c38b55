"""A rule's update as a CUDA functor on the chunk walker.

The functor has the shape of the hand-written ones (kernels/adam.cuh): an Args struct of 8-byte
words (each hyperparameter and the step as a number and a device pointer, read by scalar_arg),
every name of the rule prefixed in C++ (hv_, hp_, h_, t_, s_, q_: a rule's names are Python
identifiers, which may be C++ keywords such as `int` or `default`),
a constructor that computes every uniform value once per launch in double, as torch does on the
host, and rounds it to acc_t, and an operator() over one element's slots in acc_t.
"""
from __future__ import annotations

import ast

from . import _factored_cuda, _factored_passes
from ._factored import COL, FACTORED_ONLY, ROW, UNFACTORED_ONLY
from ._language import STEP, Program, names_read

HELPERS = """
template <class T> __device__ __forceinline__ T rule_rsqrt(T x) { return T(1) / sqrt(x); }
// float: the hardware reciprocal square root (2 ulp, as torch.rsqrt on CUDA), not a division
template <> __device__ __forceinline__ float rule_rsqrt(float x) { return rsqrtf(x); }
// x rounded to the nearest bfloat16 (ties to even), as a value of x's type
template <class T> __device__ __forceinline__ T rule_bfloat16(T x) {
  return T(to_acc(from_acc<bf16>(static_cast<float>(x))));
}
template <class T> __device__ __forceinline__ T rule_mod(T a, T b) { return a - b * floor(a / b); }
template <class T> __device__ __forceinline__ T rule_sign(T x) {
  return x != x ? x : T((x > T(0)) - (x < T(0)));
}
"""
_FUNCTIONS = {"sqrt": "sqrt", "rsqrt": "rule_rsqrt", "abs": "fabs", "sign": "rule_sign",
              "exp": "exp", "log": "log", "min": "fmin", "max": "fmax",
              "bfloat16": "rule_bfloat16"}
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def functor_source(program: Program, struct: str, stochastic: bool = False,
                   arrays: tuple = (), store_first: bool = True) -> str:
    """C++ of the rule's functors (`functor_names`) and their Args, in namespace mta, for
    kernels that include walker.cuh first. `stochastic`: the update holds the random bits
    of stochastic rounding (`rounding`, kernels/rounding.cuh), keyed by the words
    `STOCHASTIC_WORDS` at the end of Args. `arrays`: the hyperparameters given per tensor by
    arrays fixed with the plan (`array_field`), each read as its tensor's value. `store_first`:
    for a rule with sums whose first pass can store `Program.stored_first`, a second pair of
    functors (`stored_functor_names`) that does, the update reading what it stored."""
    fields = [f"  {ctype} {field};" for name in (*program.hyper, STEP) if name not in arrays
              for ctype, field in zip(("double", "const float*"), c_fields(name))]
    fields += [f"  const float* {array_member(name)};" for name in arrays]
    if program.scalars:
        fields.append(f"  sum_t* {SCALARS};  // copies of the scalar state (Rule.initial_scalars)")
    if program.totals:
        fields.append(f"  sum_t* {TOTALS};  // the whole-list sums, which the first pass writes")
    if program.factored:
        fields += _factored_cuda.FIELDS
    if stochastic:
        fields += ["  double seed_lo, seed_hi;  // the 64-bit seed's words",
                   "  const int* sr_tensor_array;  // the caller's index of each tensor"]
    parts = ["namespace mta {", HELPERS, f"struct {struct}Args {{", *fields, "};", ""]
    if program.factored:  # the row and column means first (kernels/factored.cuh)
        parts += _factored_cuda.reduction_functors(
            lambda suffix: _Writer(program, f"{struct}{suffix}", f"{struct}Args", first_pass=True,
                                   arrays=arrays), program)
    pairs = [("", frozenset())]
    if store_first and program.stored_first and not program.factored:
        pairs.append((STORED, program.stored_first))
    for suffix, stored in pairs:
        if program.sums:
            parts.append(_Writer(program, f"{struct}{suffix}Sums", f"{struct}Args",
                                 first_pass=True, arrays=arrays, stored=stored).functor())
        parts.append(_Writer(program, f"{struct}{suffix}", f"{struct}Args", first_pass=False,
                             stochastic=stochastic, arrays=arrays, stored=stored).functor())
    return "\n".join(parts + ["}  // namespace mta"]) + "\n"


STOCHASTIC_WORDS = ("seed_lo", "seed_hi", "sr_tensor_array")  # (OpSpec._use_stochastic_rounding)


def functor_names(program: Program, struct: str) -> tuple:
    """The C++ functor of each pass: with factored slots, their reductions; with sums, the
    summing pass; then the update."""
    reductions = (tuple(f"mta::{struct}{suffix}" for suffix in
                        _factored_cuda.reduction_names(program)) if program.factored else ())
    return reductions + ((f"mta::{struct}Sums",) if program.sums else ()) + (f"mta::{struct}",)


STORED = "Stored"  # the suffix of the functors whose first pass stores (functor_source)


def stored_functor_names(program: Program, struct: str) -> tuple:
    """The functors of the passes whose first stores `Program.stored_first` (none where it is
    empty): for slots kept in the math type, so that the update reads the values it would
    compute again."""
    if program.factored:
        return ()
    return functor_names(program, f"{struct}{STORED}") if program.stored_first else ()


def arg_fields(program: Program, arrays: tuple = ()) -> tuple:
    """The Args words in order, as the host names them: each hyperparameter and the step (by
    `field_name`), then its device pointer (the same, plus "_ptr"); the address of each
    per-tensor array (`array_field`); then, with scalar state, the address of its array."""
    return (tuple(f for name in (*program.hyper, STEP) if name not in arrays
                  for f in (field_name(name), f"{field_name(name)}_ptr"))
            + tuple(array_field(name) for name in arrays) + _scalar_words(program)
            + _factored_words(program))


def arg_members(program: Program, arrays: tuple = ()) -> tuple:
    """The C++ names of the Args words, in the order of `arg_fields`."""
    return (tuple(c for name in (*program.hyper, STEP) if name not in arrays
                  for c in c_fields(name))
            + tuple(array_member(name) for name in arrays) + _scalar_words(program)
            + _factored_words(program))


def _factored_words(program: Program) -> tuple:
    """A factored rule's shape words (`_factored_cuda.SHAPE`, `MEANS`)."""
    return (_factored_cuda.SHAPE, _factored_cuda.MEANS) if program.factored else ()


def array_field(name: str) -> str:
    """The host's name of the word holding the address of hyperparameter `name`'s per-tensor
    array (an `*_array` argument: the engine cuts it to each launch's tensors)."""
    return f"{name}_array"


def array_member(name: str) -> str:
    return f"ha_{name}"


SCALARS = "scalars_out"  # the argument (and Args member) of a rule's scalar state array
TOTALS = "totals_array"  # the address of the plan's whole-list sums (mtapply._launcher)


def _scalar_words(program: Program) -> tuple:
    return ((SCALARS,) if program.scalars else ()) + ((TOTALS,) if program.totals else ())


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

    def __init__(self, program: Program, struct: str, args: str, first_pass: bool,
                 stochastic: bool = False, arrays: tuple = (), stored: frozenset = frozenset()):
        self.program, self.struct, self.args, self.first_pass = program, struct, args, first_pass
        self.stochastic, self.arrays, self.stored = stochastic, arrays, stored
        self.slot_index = {s.name: k for k, s in enumerate(program.slots)}
        self.members: list = []  # (C type, name)
        self.setup: list = []  # constructor statements
        self.body: list = []  # operator() statements
        self.names: dict = {}  # temporary -> its latest C name; sums -> theirs
        self.versions: dict = {}
        # a factored rule's passes (mtapply.rules._factored_passes), the params' mode that the
        # body being written is for, and the C names of the means it reads (by node)
        self.passes = _factored_passes.passes(program) if program.factored else None
        self.factored_mode = True
        self.mean_names: dict = {}
        self._hoisted: dict = {}  # uniform node -> its member, written once for both modes

    def reads(self) -> list:
        """The constructor's first statements: each hyperparameter, the step, the scalar state,
        and for a factored rule its tensor's shape (`_factored_cuda.factored_reads`)."""
        program = self.program
        reads = [f"    const double h_{name} = scalar_arg(a.{c_fields(name)[1]}, a.{c_fields(name)[0]});"
                 if name not in self.arrays else
                 f"    const double h_{name} = static_cast<double>(a.{array_member(name)}[tensor]);"
                 for name in (*program.hyper, STEP)]
        n_scalars = len(program.scalars)
        if n_scalars:  # the copy of the step before (odd steps read copy 0), see Rule
            reads.append(f"    const long long z_parity = static_cast<long long>(h_{STEP}) & 1;")
            reads += [f"    const double h_{name} = static_cast<double>("
                      f"a.{SCALARS}[(1 - z_parity) * {n_scalars} + {k}]);"
                      for k, name in enumerate(program.scalars)]
        if self.passes is not None:
            reads += _factored_cuda.factored_reads(self)
        return reads

    def functor(self) -> str:
        program, n_sums = self.program, len(self.program.sums)
        reads = self.reads()
        n_scalars = len(program.scalars)
        if self.first_pass:
            self._run_lines(program.lines[:program.prefix], lambda: [
                f"sums[{k}] += static_cast<sum_t>({self.element(total.expr)});  "
                f"// {total.name} = sum({total.text})" for k, total in enumerate(program.sums)])
            call = "operator()(acc_t (&x)[N_SLOTS], sum_t (&sums)[N_SUMS]) const {"
            written, counted = self._mask(self.stored) or "0u", n_sums
        else:
            whole = 0
            for k, total in enumerate(program.sums):
                self.names[total.name] = f"q_{total.name}"
                where = (f"a.{TOTALS}[{whole}]" if total.whole
                         else f"__ldcg(&sums[{n_sums} * tensor + {k}])")  # (L2: walk_fused)
                whole += total.whole
                reads.append(f"    const double q_{total.name} = static_cast<double>({where});")
            lines = self._update_lines()
            self._run_lines(lines)
            call = "operator()(acc_t (&x)[N_SLOTS]) const {"
            # slots the first pass stored are written again only where later lines assign them
            again = {line.target for line in program.lines[program.prefix:]}
            written = self._mask(slot.name for slot in program.slots
                                 if slot.written and (slot.name not in self.stored
                                                      or slot.name in again)
                                 and slot.form not in (ROW, COL))
            counted = 0
            # every block computes the same values; one thread stores them in the copy that no
            # block of this step reads, and as the latest values (read between steps)
            if self.stochastic:
                self.members.append(("StochasticRounding", "rounding"))
                self.setup.append(f"rounding.init(a.seed_lo, a.seed_hi, h_{STEP}, "
                                  f"a.sr_tensor_array, tensor);")
            for k, name in enumerate(program.scalars):
                value = f"static_cast<sum_t>({self.uniform_name(name)})"
                self.setup.append(f"if (blockIdx.x == 0 && threadIdx.x == 0) {{ "
                                  f"a.{SCALARS}[z_parity * {n_scalars} + {k}] = {value}; "
                                  f"a.{SCALARS}[{2 * n_scalars + k}] = {value}; }}")
        enum = ", ".join(self._slot(slot.name) for slot in program.slots)
        s = self.struct
        # the first pass loads only the slots it reads (8-bit codes of the others stay unread);
        # an update after stores of the first pass, only those its lines read (and the param)
        read = None
        if self.first_pass:
            read = self._mask(program.first_pass_slots) or "0u"
        elif self.stored:
            names = set().union(*(names_read(line.expr) for line in lines))
            read = self._mask(slot.name for k, slot in enumerate(program.slots)
                              if k == 0 or slot.name in names)
        if self.passes is not None:  # row and column state: read by index, not per element
            read = self._mask(slot.name for slot in program.slots
                              if slot.form not in (ROW, COL) and (
                                  read is None or slot.name in program.first_pass_slots))
            call = call.replace("operator()(", "element(").replace(
                ") const {", ", Index index, Index row_of) const {")
        lines = [f"struct {s} {{", f"  enum Slot {{ {enum} }};",
                 f"  static constexpr int N_SLOTS = {len(program.slots)}, N_SUMS = {counted};",
                 f"  static constexpr unsigned WRITTEN = {written};",
                 # A pass that only sums (the norms before LARS's update) does little per element:
                 # 4 strides of loads in flight keep the memory busy (LARS resnet50 1.6% faster).
                 *(("  static constexpr int IN_FLIGHT = 4;",)
                   if self.first_pass and written == "0u" and self.passes is None else ()),
                 # and the update after it starts on what the sums read last (still in L2)
                 *(("  static constexpr bool LAST_FIRST = true;",)
                   if not self.first_pass and program.sums and self.passes is None else ()),
                 *((f"  static constexpr unsigned READ = {read or '0u'};",)
                   if read is not None else ()),
                 *(_factored_cuda.members(self, sums_only=self.first_pass and written == "0u")
                   if self.passes is not None else ()),
                 *(_factored_cuda.products_hold(self)
                   if self.first_pass and self.passes is not None else ()),
                 f"  using Args = {self.args};",
                 *(self._finish_totals() if self.first_pass and program.totals else ()),
                 *(f"  {ctype} {name};" for ctype, name in self.members), "",
                 *self.constructor(reads), "",
                 *(("  template <bool FACTORED, class Index>  // (kernels/factored.cuh, Divider)",)
                   if self.passes is not None else ()),
                 f"  __device__ __forceinline__ void {call}",
                 *(f"    {line}" for line in self.body), "  }",
                 *(_factored_cuda.either_form(call, "x, sums" if self.first_pass else "x")
                   if self.passes is not None else ()),
                 "};", ""]
        return "\n".join(lines)

    def constructor(self, reads: list) -> list:
        """The functor's constructor: an indexed one (a factored rule's) takes the chunk."""
        s = self.struct
        if self.passes is None:
            head = [f"  __device__ {s}(const Args& a, int tensor, const sum_t* sums) {{"]
        else:
            head = [f"  __device__ {s}(const Args& a, const Chunk& job, const sum_t* sums) {{",
                    "    const int tensor = job.tensor;"]
        return [*head, "    (void)tensor; (void)sums;", *reads,
                *(f"    {line}" for line in self.setup), "  }"]

    def _run_lines(self, lines, after=None) -> None:
        """The body of these lines (then `after()`'s statements): for a factored rule, one
        branch for factored params and one for the others (`if constexpr (FACTORED)`: the
        walker makes its loop for each form, kernels/walker.cuh walk_indexed), each running its
        mode's lines, the uniform ones once, in the constructor."""
        if self.passes is None:
            for line in lines:
                self._line(line)
            self.body += after() if after else []
            return
        uniform = {}
        for line in lines:
            if line.target not in self.slot_index and self.program.kind(line.expr).uniform:
                self._line(line)
                uniform[id(line)] = self.names[line.target]
        for mode in (True, False):
            self.factored_mode = mode
            self.body.append("if constexpr (FACTORED) {" if mode else "} else {")
            start = len(self.body)
            if mode:
                self.body += _factored_cuda.element_prologue(self)
            skipped = UNFACTORED_ONLY if mode else FACTORED_ONLY
            for line in lines:
                if id(line) in uniform:
                    self.names[line.target] = uniform[id(line)]
                elif line.only != skipped and line.target not in self.vector_slots:
                    self._line(line)
            self.body += after() if after else []
            self.body[start:] = [f"  {line}" for line in self.body[start:]]
        self.body.append("}")

    @property
    def vector_slots(self) -> set:
        """The row and column slots (whose lines the combine pass runs)."""
        return {s.name for s in self.program.slots if s.form in (ROW, COL)}

    def _update_lines(self) -> list:
        """The lines the update runs: all, or, after stores of the first pass, the prefix lines
        still needed and every line after the prefix."""
        program = self.program
        if not self.stored:
            return list(program.lines)
        kept = program.update_prefix_lines(self.stored)
        return [program.lines[k] for k in kept] + list(program.lines[program.prefix:])

    def _mask(self, names) -> str:
        """The bit mask of these slots, as C++ (empty where none)."""
        wanted = set(names)
        return " | ".join(f"(1u << {self._slot(slot.name)})" for slot in self.program.slots
                          if slot.name in wanted)

    def _finish_totals(self) -> list:
        """The first pass's global finish (kernels/walker.cuh): each whole-list sum, the sum
        of every tensor's (in the plan's order, so deterministically), into the totals."""
        lines = ["  static constexpr bool GLOBAL = true;",
                 "  __device__ static void finish(const Args& a, const sum_t* all_sums, "
                 "const int* positions, long long n) {"]
        whole = 0
        for k, total in enumerate(self.program.sums):
            if not total.whole:
                continue
            lines += ["    {", "      sum_t part = 0;",
                      "      for (long long i = threadIdx.x; i < n; i += MTA_BLOCK)",
                      f"        part += __ldcg(&all_sums[positions[i] + {k}]);  // {total.name}",
                      "      const sum_t total = block_sum(part);",
                      f"      if (threadIdx.x == 0) a.{TOTALS}[{whole}] = total;", "    }"]
            whole += 1
        return lines + ["  }"]

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
            if id(node) in self._hoisted:  # (written already, for the other mode)
                return self._hoisted[id(node)]
            member = f"k{len(self.members)}"
            self.members.append(("bool" if kind.boolean else "acc_t", member))
            value = self.uniform(node)
            self.setup.append(f"{member} = {value if kind.boolean else f'acc_t({value})'};")
            self._hoisted[id(node)] = member
            return member
        if isinstance(node, ast.IfExp):  # `A if factored else B`: the mode's branch
            return self.element(node.body if self.factored_mode else node.orelse)
        if id(node) in self.mean_names:
            return self.mean_names[id(node)]
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
        if isinstance(node, ast.IfExp):  # the tensor's mode, known in the constructor
            return (f"(z_factored ? {self.uniform(node.body)} : "
                    f"{self.uniform(node.orelse)})")
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
