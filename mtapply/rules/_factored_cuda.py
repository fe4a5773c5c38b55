"""The CUDA side of factored slots (mtapply.rules._factored): the reduction functors that run
before the walker's passes (kernels/factored.cuh) and what the walker's functors of a
factored rule add (their tensor's shape, and each element's row and column state).

Every functor of a factored rule reads its tensor's shape from `shape_array` (SHAPE_WORDS words
per tensor: numel, rows, cols (0 for a param that is not factored), where its per-matrix means,
then its factor pass's partial sums, start in `means_array`, the plan's workspace of doubles,
and the words of its Dividers by rows and by cols, made here once rather than in every thread).
"""
from __future__ import annotations

import ast

import numpy as np

from ._factored import COL, FULL, ROW, UNFACTORED, UNFACTORED_ONLY, is_factored, stacked
from ._factored_passes import numbered, passes
from ._language import names_read

SHAPE, MEANS = "shape_array", "means_array"  # the argument words (host and C++ names)
FIELDS = ("  const long long* shape_array;  // per tensor: numel, rows, cols (0: not factored), "
          "means offset, the Dividers' words",
          "  double* means_array;  // the per-matrix means (kernels/factored.cuh)")
FACTORS, COMBINE, MATRIX = "Factors", "Combine", "Matrix"  # the reduction functors' suffixes
TILE, MAX_TILE_COLS = 32768, 128  # the factor pass's tiles (kernels/factored.cuh, Tiles)
CHUNK = 65536  # elements a block of a factored rule's passes takes (RuleSpec.chunk_for)
SHAPE_WORDS = 10  # numel, rows, cols, means offset, then 3 words per Divider (by rows, by cols)
WORD = (1 << 64) - 1


def divider_words(d: int) -> tuple:
    """The three int64 words of kernels/factored.cuh's Divider for divisor d (1 where a param
    is not factored): its 64-bit magic, its 32-bit magic and shift, and its 64-bit shifts, each
    pair as low and high halves of a word. The magic numbers of the round-up method: with
    l = ceil(log2 d), floor(2^N (2^l - d) / d) + 1 for N-bit words (0 with shift 32: a divisor
    of 2^32 or more, whose 32-bit quotients are all 0)."""
    d = max(d, 1)
    shift = (d - 1).bit_length()
    high = (1 << shift) - d
    wide_magic = ((high << 64) // d) + 1
    magic, narrow_shift = (((high << 32) // d) + 1, shift) if d < (1 << 32) else (0, 32)
    words = (wide_magic, magic | narrow_shift << 32, min(shift, 1) | max(shift - 1, 0) << 32)
    return tuple(w - (1 << 64) if w >= (1 << 63) else w for w in words)  # as int64 bits


def tile_groups(rows: int, cols: int) -> tuple:
    """(row groups, column groups) of the factor pass's tiles of a matrix (kernels/factored.cuh,
    tiles_of)."""
    tile_cols = min(-(-cols // 32) * 32, MAX_TILE_COLS)
    return -(-rows // (TILE // tile_cols)), -(-cols // tile_cols)


def factor_partials(batch: int, rows: int, cols: int, n_row: int, n_col: int) -> int:
    """The partial sums the factor pass stores for a stack of matrices (kernels/factored.cuh,
    tiles_of): n_row per row and column group, n_col per column and row group."""
    row_groups, col_groups = tile_groups(rows, cols)
    return batch * (n_row * rows * col_groups + n_col * cols * row_groups)


def shape_words(shapes: list, n_matrix: int, n_row: int = 0, n_col: int = 0) -> tuple:
    """(the (n, SHAPE_WORDS) int64 words of `shape_array` for params of these shapes, the
    doubles `means_array` takes: per factored param its per-matrix means, then its factor
    pass's `n_row` row and `n_col` column partial sums)."""
    words = np.zeros((len(shapes), SHAPE_WORDS), np.int64)
    offset = 0
    for i, shape in enumerate(shapes):
        words[i, 0] = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        if is_factored(shape) and words[i, 0]:
            batch, rows, cols = stacked(shape)
            words[i, 1:4] = (rows, cols, offset)
            offset += batch * n_matrix + factor_partials(batch, rows, cols, n_row, n_col)
        words[i, 4:] = divider_words(int(words[i, 1])) + divider_words(int(words[i, 2]))
    return words, offset




def vector_blocks(words: np.ndarray, n_row: int, n_col: int, n_matrix: int, chunk: int,
                  threads: int) -> np.ndarray:
    """Per tensor (its `shape_words` row), how many of its first blocks (of `chunk` elements
    and `threads` threads) the combine and matrix passes give work (kernels/factored.cuh:
    busy_blocks, matrix_walk): those passes launch over these blocks only. 0 for a tensor
    that is not factored."""
    warps = threads // 32
    busy = np.zeros(len(words), np.int64)
    for i in np.flatnonzero(words[:, 1] > 0):
        numel, rows, cols = (int(n) for n in words[i, :3])
        batch, chunks = numel // (rows * cols), -(-numel // chunk)
        row_groups, col_groups = tile_groups(rows, cols)
        counts = [_busy(batch * rows, col_groups, warps) if n_row else 0,
                  _busy(batch * cols, row_groups, warps) if n_col else 0,
                  (batch if batch <= chunks else -(-batch // warps)) if n_matrix else 0]
        busy[i] = min(chunks, max(counts))
    return busy


def _busy(n: int, groups: int, warps: int) -> int:
    """kernels/factored.cuh's busy_blocks, before its cap at the tensor's chunks."""
    return -(-n // (warps if groups >= 32 else 32 * warps))


def counts(program) -> tuple:
    """(per-matrix means, row means, column means) of a factored rule's passes."""
    made = passes(program)
    return tuple(len(numbered(calls)[1]) for calls in
                 ((c for c, _ in made.matrix_means), made.row_means, made.col_means))


def _vector_slots(program) -> list:
    return [s for s in program.slots if s.form in (ROW, COL)]


def members(writer, sums_only: bool = False) -> list:
    """The members every functor of a factored rule has (kernels/walker.cuh, INDEXED).

    A pass that only sums (`sums_only`) in float32 math caps its registers at 64 for four
    blocks an SM: its spills are few and its loads more (Adafactor's sums pass on an H200,
    gpt2-124M 308 -> 281 us, t5-base 527 -> 479 us, gpt2 in bfloat16 297 -> 270 us). The
    other passes keep 80, where 64 spills more of their loop (the update 397 -> 401 us, the
    factor pass 157 -> 170 us; 48 for the sums: 308 -> 469 us), as does float64 math (64
    spills some 1 KB a thread)."""
    blocks = "sizeof(acc_t) == 4 ? 4 : 3" if sums_only else "3"
    return (["  static constexpr bool INDEXED = true;",
             "  static constexpr int IN_FLIGHT = 2;  // strides loaded before the first store",
             f"  static constexpr int MIN_BLOCKS = {blocks};  // per SM: registers capped at 64 "
             f"(4), 80 (3)",
             f"  static constexpr int N_MATRIX = {_n_matrix(writer)};",
             f"  static constexpr unsigned FACTORED_ABSENT = {_unfactored_mask(writer)};",
             "  bool factored;  // the param is a stack of matrices (batch, rows, cols)",
             "  long long rows, cols;", "  double* means;  // its per-matrix means",
             "  Divider by_rows, by_cols;  // exact quotients of indices by rows and by cols",
             "  bool narrow;  // every index fits 32 bits (the walker's Index: unsigned)",
             "  bool whole_rows;  // the walker's vectors each lie in one row (cols % MTA_VEC == 0)",
             "  unsigned absent;  // slots the walker neither loads nor stores"]
            + [f"  char* p_{s.name};" for s in _vector_slots(writer.program)])


def either_form(call: str, values: str) -> list:
    """operator(): the functor's element<FACTORED> (`call`, taking `values` and then the
    element's index and row) for its tensor's form, chosen at each element (the 8-bit walk's
    call; the chunk walker chooses once a chunk, walk_indexed)."""
    head = call.replace("element(", "operator()(")
    args = f"{values}, index, row_of"
    return ["  template <class Index>", f"  __device__ __forceinline__ void {head}",
            f"    if (factored) element<true>({args});", f"    else element<false>({args});", "  }"]


def _n_matrix(writer) -> int:
    return len(numbered(c for c, _ in writer.passes.matrix_means)[1])


def _unfactored_mask(writer) -> str:
    """The slots a factored param does not hold per element (its @unfactored ones)."""
    return writer._mask(s.name for s in writer.program.slots if s.form == UNFACTORED) or "0u"


def factored_reads(writer) -> list:
    """The constructor's reads of the tensor's shape."""
    program = writer.program
    return ([f"    const long long* z_shape = a.{SHAPE} + {SHAPE_WORDS} * static_cast<long long>(tensor);",
             "    const bool z_factored = z_shape[1] > 0;",
             "    const double h_numel = static_cast<double>(z_shape[0]);  (void)h_numel;",
             "    factored = z_factored;", "    rows = z_shape[1];", "    cols = z_shape[2];",
             "    by_rows = Divider::of(z_shape + 4);", "    by_cols = Divider::of(z_shape + 7);",
             "    narrow = Divider::narrow(z_shape[0]);",
             "    whole_rows = z_factored && z_shape[2] % MTA_VEC == 0;",
             f"    means = a.{MEANS} + z_shape[3];", "    absent = z_factored ? FACTORED_ABSENT : 0u;"]
            + [f"    p_{s.name} = reinterpret_cast<char*>(job.addresses[{writer._slot(s.name)}]);"
               for s in _vector_slots(program)])


def element_prologue(writer) -> list:
    """The first statements of a walker functor's branch for factored params: the element's
    row and column state, and its matrix's means."""
    # (no shortcut for a single matrix: a branch between a vector's elements kept the compiler
    # from sharing their row's quotient, matrix and means, which whole rows make equal)
    lines = ["const Index f_row = by_cols.quotient(row_of);  // the element's row in the stack",
             "const Index f_matrix = by_rows.quotient(f_row);  // its matrix",
             "const Index f_col = f_matrix * static_cast<Index>(cols) + "
             "(index - f_row * static_cast<Index>(cols));  // its column"]
    for s in _vector_slots(writer.program):
        at = "f_row" if s.form == ROW else "f_col"
        slot = writer._slot(s.name)
        lines.append(f"x[{slot}] = load_at<{slot}>(p_{s.name}, {at});")
    numbers, firsts = numbered(c for c, _ in writer.passes.matrix_means)
    for call in writer.passes.matrix_means:
        writer.mean_names[id(call[0])] = f"f_m{numbers[id(call[0])]}"
    for k, call in enumerate(firsts):
        lines.append(f"const acc_t f_m{k} = "
                     f"acc_t(means[static_cast<long long>(f_matrix) * N_MATRIX + {k}]);  "
                     f"// {ast.unparse(call)}")
    return lines


def reduction_functors(writer_of, program) -> list:
    """The C++ of the factor functor and (with per-matrix means) the matrix functor, each
    from a fresh writer (`writer_of(suffix)`)."""
    made = passes(program)
    factors = _Factors(writer_of(FACTORS), program, made)
    parts = [factors.source(), _combine(factors.w.struct)]
    if made.matrix_means:
        parts.append(_Matrix(writer_of(MATRIX), program, made).source())
    return parts


def reduction_names(program) -> tuple:
    made = passes(program)
    if made is None:  # (no CUDA kernel: see _factored_passes.refusal)
        return ()
    return (FACTORS, COMBINE) + ((MATRIX,) if made.matrix_means else ())


def _combine(factors: str) -> str:
    """The combine functor: the factor functor, walked by combine_walk."""
    struct = factors.removesuffix(FACTORS) + COMBINE
    return "\n".join([f"struct {struct} : {factors} {{", f"  using {factors}::{factors};",
                      f"  __device__ static void walk(const Launch<Args>& launch) {{ "
                      f"combine_walk<{struct}>(launch); }}", "};", ""])


class _Reduction:
    """A reduction functor: the writer's constructor and members, methods written here."""

    def __init__(self, writer, program, passes):
        self.w, self.program, self.passes = writer, program, passes
        for k, line in enumerate(program.lines[:passes.limit]):  # numbers before any sum
            if line.target not in writer.slot_index and program.kind(line.expr).uniform:
                writer._line(line)

    def _method(self, head: str, body: list) -> list:
        return [f"  __device__ __forceinline__ {head} const {{", *(f"    {b}" for b in body), "  }"]

    def _body(self, write) -> list:
        """The statements `write()` emits through the writer."""
        saved, self.w.body = self.w.body, []
        write()
        body, self.w.body = self.w.body, saved
        return body

    def struct(self, statics: list, methods: list, walk: str) -> str:
        w = self.w
        enum = ", ".join(w._slot(s.name) for s in self.program.slots)
        lines = [f"struct {w.struct} {{", f"  enum Slot {{ {enum} }};",
                 f"  static constexpr int N_SLOTS = {len(self.program.slots)}, N_SUMS = 0;",
                 "  static constexpr unsigned WRITTEN = 0u;  // (it stores rows and columns)",
                 "  static constexpr bool OWN_WALK = true;", *statics, *members(w),
                 f"  using Args = {w.args};", *(f"  {c} {n};" for c, n in w.members), "",
                 *w.constructor(w.reads()), "", *methods,
                 f"  __device__ static void walk(const Launch<Args>& launch) {{ {walk}<{w.struct}>(launch); }}",
                 "};", ""]
        return "\n".join(lines)


class _Factors(_Reduction):
    """terms (each element's values of the row and column means), finish_row, finish_col."""

    def source(self) -> str:
        p, w = self.passes, self.w
        self.rows = numbered(p.row_means)
        self.cols = numbered(p.col_means)
        n_row, n_col = len(self.rows[1]), len(self.cols[1])
        terms = self._body(self._terms)
        methods = self._method(f"void terms(acc_t (&x)[N_SLOTS], acc_t (&row)[{max(n_row, 1)}], "
                               f"acc_t (&col)[{max(n_col, 1)}])", ["(void)row; (void)col;", *terms])
        for form, (numbers, firsts), name in ((ROW, self.rows, "row"), (COL, self.cols, "col")):
            if firsts:
                methods += self._method(
                    f"void finish_{name}(long long j, const acc_t (&mean)[{len(firsts)}])",
                    self._body(lambda form=form, numbers=numbers: self._finish(form, numbers)))
        read = w._mask(self._element_reads()) or "0u"
        return self.struct([f"  static constexpr int N_ROW = {n_row}, N_COL = {n_col};",
                            f"  static constexpr unsigned READ = {read};"],
                           methods, "factor_walk")

    def _element_reads(self) -> set:
        return factor_reads(self.program)

    def _terms(self) -> None:
        w, program = self.w, self.program
        kept, done = _element_lines(program, self.passes), set()
        for k, line in enumerate(program.lines[:self.passes.limit]):
            if k in kept:
                w._line(line)
            form = self.passes.vector_lines.get(k)
            if form is None:
                continue
            numbers = (self.rows if form == ROW else self.cols)[0]
            out = "row" if form == ROW else "col"
            for call in _calls(line.expr):
                number = numbers.get(id(call))
                if number is None or (out, number) in done:
                    continue
                done.add((out, number))
                w.body.append(f"{out}[{number}] = {w.element(call.args[0])};  "
                              f"// {ast.unparse(call)}")

    def _finish(self, form: str, numbers: dict) -> None:
        """The lines of the slots of `form`, on the values of row (column) j."""
        w, program = self.w, self.program
        slots = [s for s in program.slots if s.form == form]
        w.body.append("acc_t x[N_SLOTS] = {};")
        for s in slots:
            w.body.append(f"x[{w._slot(s.name)}] = load_at<{w._slot(s.name)}>(p_{s.name}, j);")
        for k, line in enumerate(program.lines):
            if self.passes.vector_lines.get(k) == form:
                for call in _calls(line.expr):
                    if id(call) in numbers:
                        w.mean_names[id(call)] = f"mean[{numbers[id(call)]}]"
                w._line(line)
        for s in slots:
            if s.written:
                w.body.append(f"store_at<{w._slot(s.name)}>(p_{s.name}, j, "
                              f"x[{w._slot(s.name)}]);")


def _mean_calls(made) -> tuple:
    """One row_mean or col_mean call of each argument that the factor pass sums."""
    return numbered(made.row_means)[1] + numbered(made.col_means)[1]


def _element_lines(program, made) -> set:
    """Indices of the element lines the means' arguments need, for factored params (none where
    no line assigns row or column state: nothing is summed)."""
    if not made.vector_lines:
        return set()
    needed = set().union(*(names_read(c.args[0]) for c in _mean_calls(made)))
    kept = set()
    last = max(made.vector_lines)
    for k in range(last - 1, -1, -1):
        line = program.lines[k]
        if (line.target in needed and not program.kind(line.expr).uniform
                and k not in made.vector_lines and line.only != UNFACTORED_ONLY):
            kept.add(k)
            needed |= names_read(line.expr)
    return kept


def factor_reads(program) -> set:
    """The full slots the factor pass reads at each element (the terms of the row and column
    means): it reads them as stored, so none of them may be kept in 8 bits."""
    made = passes(program)
    kept = _element_lines(program, made)
    names = set().union(*(names_read(c.args[0]) for c in _mean_calls(made)),
                        *(names_read(program.lines[k].expr) for k in kept))
    return {s.name for s in program.slots if s.name in names and s.form == FULL}


class _Matrix(_Reduction):
    """matrix_sums(b, first, stride, sums): each per-matrix mean's sum over rows (columns)
    first, first + stride, ... of matrix b; matrix_store(b, sums) stores the means of the
    sums added over every row (column)."""

    def source(self) -> str:
        methods = self._method("void matrix_sums(long long b, long long first, long long stride, "
                               "acc_t (&sums)[N_MATRIX])", self._body(self._sums))
        methods += self._method("void matrix_store(long long b, const acc_t (&sums)[N_MATRIX])",
                                self._body(self._store))
        return self.struct([], methods, "matrix_walk")

    def _firsts(self) -> list:
        """(call, the form of the vector it reduces, the matrix's count of them) per mean."""
        firsts = numbered(c for c, _ in self.passes.matrix_means)[1]
        forms = [self.passes.form_of(call) for call in firsts]
        return [(call, form, "rows" if form == ROW else "cols") for call, form in zip(firsts, forms)]

    def _sums(self) -> None:
        w = self.w
        for k, (call, form, count) in enumerate(self._firsts()):
            w.body += [f"{{  // {ast.unparse(call)}, over the matrix's {count}",
                       "  acc_t sum = acc_t(0);",
                       f"  for (long long r = first; r < {count}; r += stride) {{",
                       "    acc_t x[N_SLOTS] = {};"]
            for s in self.program.slots:
                if s.form == form and s.name in names_read(call.args[0]):
                    slot = w._slot(s.name)
                    w.body.append(f"    x[{slot}] = load_at<{slot}>(p_{s.name}, b * {count} + r);")
            w.body += [f"    sum += {w.element(call.args[0])};", "  }", f"  sums[{k}] = sum;", "}"]

    def _store(self) -> None:
        self.w.body += [f"means[b * N_MATRIX + {k}] = static_cast<double>(sums[{k}] / "
                        f"acc_t({count}));" for k, (_, _, count) in enumerate(self._firsts())]


def _calls(expr) -> list:
    return [n for n in ast.walk(expr) if isinstance(n, ast.Call)]
