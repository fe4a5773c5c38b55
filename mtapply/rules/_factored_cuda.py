"""The CUDA side of factored slots (mtapply.rules._factored): the reduction functors that run
before the walker's passes (kernels/factored.cuh) and what the walker's functors of a
factored rule add (their tensor's shape, and each element's row and column state).

Every functor of a factored rule reads its tensor's shape from `shape_array` (SHAPE_WORDS words
per tensor: numel, rows, cols (0 for a param that is not factored), where its per-matrix means,
then its factor pass's partial sums, start in `means_array`, the plan's workspace of doubles,
the words of its Dividers by rows and by cols, made here once rather than in every thread, and
whether its factor pass takes whole rows).

A rule whose sums all have a product form (`_factored_sums`) takes them, for a param whose rows
fit a block (`rowwise`), from its factor pass and matrix pass: the factor pass cuts the
matrices into tiles of whole rows, adds each column's E R once it has a row's new state, and
the matrix pass finishes each sum over the columns and checks the form's conditions; the sums
pass then skips the param's elements wherever they hold (`products_hold`).
"""
from __future__ import annotations

import ast

import numpy as np

from ._factored import COL, FULL, ROW, UNFACTORED, UNFACTORED_ONLY, is_factored, stacked
from . import _factored_sums
from ._factored_passes import mean_calls, mean_key, numbered, passes
from ._factored_sums import COLS, ELEMENT, ROWS, checked, product_text
from ._factored_sums import MATRIX as PER_MATRIX
from ._language import names_read

SHAPE, MEANS = "shape_array", "means_array"  # the argument words (host and C++ names)
FIELDS = ("  const long long* shape_array;  // per tensor: numel, rows, cols (0: not factored), "
          "means offset, the Dividers' words",
          "  double* means_array;  // the per-matrix means (kernels/factored.cuh)")
FACTORS, COMBINE, MATRIX = "Factors", "Combine", "Matrix"  # the reduction functors' suffixes
TILE, MAX_TILE_COLS = 32768, 128  # the factor pass's tiles (kernels/factored.cuh, Tiles)
# whole-row tiles (kernels/factored.cuh, factor_rows): rows of a multiple of ROW_STEP columns,
# at most MAX_ROW_COLS (a thread's ROW_VECTORS vectors of 4 a row)
ROW_STEP, MAX_ROW_COLS, ROW_TILE, ROW_VECTORS = 128, 3072, 262144, 3
CHUNK = 65536  # elements a block of a factored rule's passes takes (RuleSpec.chunk_for)
SHAPE_WORDS = 11  # numel, rows, cols, means offset, 3 words per Divider (by rows, by cols), rowwise
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


def rowwise(cols: int, n_products: int) -> bool:
    """Whether a factored param of `cols` columns takes its factor pass in whole rows: its rule's
    sums have product forms (`n_products` of them) and its rows fit a block: whole warps of
    threads taking at most ROW_VECTORS vectors of 4 each (kernels/factored.cuh, row_share)."""
    if n_products == 0 or cols % ROW_STEP or not 0 < cols <= MAX_ROW_COLS:
        return False
    vectors, threads = cols // 4, MAX_ROW_COLS // 4 // ROW_VECTORS
    return any(vectors % q == 0 and (vectors // q) % 32 == 0
               for q in range(-(-vectors // threads), ROW_VECTORS + 1))


def tile_groups(rows: int, cols: int, whole_rows: bool = False) -> tuple:
    """(row groups, column groups) of the factor pass's tiles of a matrix (kernels/factored.cuh,
    tiles_of)."""
    if whole_rows:
        return -(-rows // -(-ROW_TILE // cols)), 1
    tile_cols = min(-(-cols // 32) * 32, MAX_TILE_COLS)
    return -(-rows // (TILE // tile_cols)), -(-cols // tile_cols)


def factor_partials(batch: int, rows: int, cols: int, n_row: int, n_col: int,
                    n_products: int = 0) -> int:
    """The partial sums the factor pass stores for a stack of matrices (kernels/factored.cuh,
    tiles_of): n_row per row and column group, n_col per column and row group, and with whole
    rows n_products per column and row group."""
    whole_rows = rowwise(cols, n_products)
    row_groups, col_groups = tile_groups(rows, cols, whole_rows)
    n_cols = n_col + (n_products if whole_rows else 0)
    return batch * (n_row * rows * col_groups + n_cols * cols * row_groups)


def matrix_words(n_matrix: int, n_products: int) -> int:
    """The doubles each matrix keeps in the workspace: its means, then with product sums each
    one's value and whether the product forms hold (1) or not (0)."""
    return n_matrix + (n_products + 1 if n_products else 0)


def shape_words(shapes: list, n_matrix: int, n_row: int = 0, n_col: int = 0,
                n_products: int = 0) -> tuple:
    """(the (n, SHAPE_WORDS) int64 words of `shape_array` for params of these shapes, the
    doubles `means_array` takes: per factored param its `matrix_words` per matrix, then its
    factor pass's partial sums: `n_row` per row, `n_col` per column, and `n_products`)."""
    words = np.zeros((len(shapes), SHAPE_WORDS), np.int64)
    offset = 0
    for i, shape in enumerate(shapes):
        words[i, 0] = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        if is_factored(shape) and words[i, 0]:
            batch, rows, cols = stacked(shape)
            words[i, 1:4] = (rows, cols, offset)
            words[i, 10] = rowwise(cols, n_products)
            offset += (batch * matrix_words(n_matrix, n_products)
                       + factor_partials(batch, rows, cols, n_row, n_col, n_products))
        words[i, 4:10] = divider_words(int(words[i, 1])) + divider_words(int(words[i, 2]))
    return words, offset




def vector_blocks(words: np.ndarray, n_row: int, n_col: int, n_matrix: int, chunk: int,
                  threads: int, n_products: int = 0) -> np.ndarray:
    """Per tensor (its `shape_words` row), how many of its first blocks (of `chunk` elements
    and `threads` threads) the combine and matrix passes give work (kernels/factored.cuh:
    busy_blocks, matrix_walk): those passes launch over these blocks only. 0 for a tensor
    that is not factored."""
    warps = threads // 32
    busy = np.zeros(len(words), np.int64)
    for i in np.flatnonzero(words[:, 1] > 0):
        numel, rows, cols = (int(n) for n in words[i, :3])
        batch, chunks = numel // (rows * cols), -(-numel // chunk)
        row_groups, col_groups = tile_groups(rows, cols, bool(words[i, 10]))
        counts = [_busy(batch * rows, col_groups, warps, chunks) if n_row else 0,
                  _busy(batch * cols, row_groups, warps, chunks) if n_col else 0,
                  (batch if batch <= chunks else -(-batch // warps))
                  if n_matrix or n_products else 0]
        busy[i] = min(chunks, max(counts))
    return busy


def _busy(n: int, groups: int, warps: int, blocks: int) -> int:
    """kernels/factored.cuh's busy_blocks, before its cap at the tensor's `blocks`."""
    by_warps = groups >= 32 and (groups >= 64 or n <= warps * blocks)
    return -(-n // (warps if by_warps else 32 * warps))


def counts(program) -> tuple:
    """(per-matrix means, row means, column means) of a factored rule's passes."""
    made = passes(program)
    return tuple(len(numbered(calls)[1]) for calls in
                 ((c for c, _ in made.matrix_means), made.row_means, made.col_means))


def product_sums(program) -> tuple:
    """The ProductSums (`_factored_sums`) a factored rule takes from its factor and matrix
    passes: every sum's, or none (a sum without a product form, a mean the matrix pass does not
    take, no row mean to give the factor pass each row's new state)."""
    made = passes(program)
    found = _factored_sums.product_sums(program).sums
    if made is None or not found or not made.row_means:
        return ()
    taken = {mean_key(c) for c, _ in made.matrix_means}
    for total in found:
        for f in total.factors + total.positive:
            if any(mean_key(n) not in taken for n in mean_calls(f.expr)):
                return ()
        for clamp in total.clamps:
            if any(mean_key(n) not in taken for n in mean_calls(clamp.bound)):
                return ()
    return found


def _vector_slots(program) -> list:
    return [s for s in program.slots if s.form in (ROW, COL)]


def members(writer, sums_only: bool = False, blocks: str = "") -> list:
    """The members every functor of a factored rule has (kernels/walker.cuh, INDEXED).

    A pass that only sums (`sums_only`) in float32 math caps its registers at 64 for four
    blocks an SM: its spills are few and its loads more (Adafactor's sums pass on an H200,
    gpt2-124M 308 -> 281 us, t5-base 527 -> 479 us, gpt2 in bfloat16 297 -> 270 us). The
    other passes keep 80, where 64 spills more of their loop (the update 397 -> 401 us, the
    factor pass 157 -> 170 us; 48 for the sums: 308 -> 469 us), as does float64 math (64
    spills some 1 KB a thread)."""
    blocks = blocks or ("sizeof(acc_t) == 4 ? 4 : 3" if sums_only else "3")
    return (["  static constexpr bool INDEXED = true;",
             "  static constexpr int IN_FLIGHT = 2;  // strides loaded before the first store",
             f"  static constexpr int MIN_BLOCKS = {blocks};  // per SM: registers capped at 64 "
             f"(4), 80 (3)",
             f"  static constexpr int N_MATRIX = {_n_matrix(writer)};",
             f"  static constexpr int N_PRODUCTS = {len(product_sums(writer.program))};",
             "  static constexpr int MATRIX_WORDS = N_MATRIX + (N_PRODUCTS ? N_PRODUCTS + 1 : 0);",
             f"  static constexpr unsigned FACTORED_ABSENT = {_unfactored_mask(writer)};",
             "  bool factored;  // the param is a stack of matrices (batch, rows, cols)",
             "  long long rows, cols;", "  double* means;  // its per-matrix means",
             "  Divider by_rows, by_cols;  // exact quotients of indices by rows and by cols",
             "  bool narrow;  // every index fits 32 bits (the walker's Index: unsigned)",
             "  bool whole_rows;  // the walker's vectors each lie in one row (cols % MTA_VEC == 0)",
             "  bool rowwise;  // the factor pass takes whole rows (product sums, rows that fit)",
             "  long long numel;",
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
             "    rowwise = z_factored && z_shape[10] != 0;", "    numel = z_shape[0];",
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
                     f"acc_t(means[static_cast<long long>(f_matrix) * MATRIX_WORDS + {k}]);  "
                     f"// {ast.unparse(call)}")
    return lines


def reduction_functors(writer_of, program) -> list:
    """The C++ of the factor functor and (with per-matrix means) the matrix functor, each
    from a fresh writer (`writer_of(suffix)`)."""
    made = passes(program)
    factors = _Factors(writer_of(FACTORS), program, made)
    parts = [factors.source(), _combine(factors.w.struct)]
    if made.matrix_means or product_sums(program):
        parts.append(_Matrix(writer_of(MATRIX), program, made).source())
    return parts


def reduction_names(program) -> tuple:
    made = passes(program)
    if made is None:  # (no CUDA kernel: see _factored_passes.refusal)
        return ()
    return (FACTORS, COMBINE) + ((MATRIX,) if made.matrix_means or product_sums(program) else ())


def products_hold(writer) -> list:
    """The sums pass's test of a tensor whose sums its factor and matrix passes took (every
    matrix's product forms hold, kernels/walker.cuh walk_chunk): then the tensor's first
    block's thread 0 takes them, added over its matrices in order, and no block walks its
    elements."""
    if not product_sums(writer.program):
        return []
    return ["  static constexpr bool PRODUCT_SUMS = true;",
            "  __device__ __forceinline__ bool products_hold(long long chunk, "
            "sum_t (&acc)[N_SUMS]) const {",
            "    if (!rowwise) return false;",
            "    const long long batch = numel / (rows * cols);",
            "    for (long long b = 0; b < batch; ++b)",
            "      if (means[b * MATRIX_WORDS + N_MATRIX + N_PRODUCTS] == 0.0) return false;",
            "    if (chunk == 0 && threadIdx.x == 0)",
            "      for (long long b = 0; b < batch; ++b)",
            "        for (int k = 0; k < N_SUMS; ++k)",
            "          acc[k] += static_cast<sum_t>(means[b * MATRIX_WORDS + N_MATRIX + k]);",
            "    return true;", "  }"]


def _combine(factors: str) -> str:
    """The combine functor: the factor functor, walked by combine_walk."""
    struct = factors.removesuffix(FACTORS) + COMBINE
    return "\n".join([f"struct {struct} : {factors} {{", f"  using {factors}::{factors};",
                      f"  __device__ static void walk(const Launch<Args>& launch) {{ "
                      f"combine_walk<{struct}>(launch); }}", "};", ""])


class _Reduction:
    """A reduction functor: the writer's constructor and members, methods written here."""

    min_blocks = ""  # (members' default)


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
                 "  static constexpr bool OWN_WALK = true;", *statics,
                 *members(w, blocks=self.min_blocks),
                 f"  using Args = {w.args};", *(f"  {c} {n};" for c, n in w.members), "",
                 *w.constructor(w.reads()), "", *methods,
                 f"  __device__ static void walk(const Launch<Args>& launch) {{ {walk}<{w.struct}>(launch); }}",
                 "};", ""]
        return "\n".join(lines)


class _Factors(_Reduction):
    """terms (each element's values of the row and column means), finish_row, finish_col; with
    product sums, what the whole-row tiles take (row_load, row_factors, product_elements,
    finish_col_factors).

    With product sums the factor pass runs at two blocks an SM (128 registers): its whole-row
    tiles keep a thread's columns' sums and the next row's loads in registers, which at 80
    spill (gpt2-124M in float32 on an H200, factor pass 628 -> 341 us)."""

    def source(self) -> str:
        p, w = self.passes, self.w
        self.products = product_sums(self.program)
        if self.products:
            self.min_blocks = "2"
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
        if self.products:
            methods += self._method("void row_load(long long j, acc_t (&x)[N_SLOTS])",
                                    self._body(lambda: self._loads(ROW)))
            methods += self._method(
                f"void row_factors(acc_t (&x)[N_SLOTS], const acc_t (&mean)[{max(n_row, 1)}], "
                f"acc_t (&factor)[N_PRODUCTS])", self._body(self._row_factors))
            methods += self._method(
                "void product_elements(const acc_t (&x)[N_SLOTS], acc_t (&out)[N_PRODUCTS])",
                self._body(self._product_elements))
            methods += self._method(
                f"void finish_col_factors(long long j, const acc_t (&mean)[{max(n_col, 1)}], "
                f"acc_t (&factor)[N_PRODUCTS])", ["(void)mean;", *self._body(self._col_factors)])
        masks = {varies: " | ".join(f"(1u << {k})" for k, t in enumerate(self.products)
                                    if t.part(varies) != "1") or "0u" for varies in (ROWS, COLS)}
        terms_read = w._mask(self._element_reads()) or "0u"
        read = w._mask(self._element_reads() | self._product_reads()) or "0u"
        return self.struct([f"  static constexpr int N_ROW = {n_row}, N_COL = {n_col};",
                            f"  static constexpr unsigned READ = {read};",
                            f"  static constexpr unsigned TERMS_READ = {terms_read};",
                            "  // the products with row (column) factors",
                            f"  static constexpr unsigned PRODUCT_ROWS = {masks[ROWS]}, "
                            f"PRODUCT_COLUMNS = {masks[COLS]};"],
                           methods, "factor_walk")

    def _product_reads(self) -> set:
        """The full slots the products' element values read (whole-row tiles only)."""
        names = set().union(*(names_read(checked(self.program, t.part(ELEMENT)))
                              for t in product_sums(self.program)))
        return {s.name for s in self.program.slots if s.name in names and s.form == FULL}

    def _row_factors(self) -> None:
        """A row's new state from its state before the step (row_load's x) and its means (the
        row's lines, as finish_row has them: the combine pass stores it), and each product
        sum's row value."""
        self._lines(ROW, self.rows[0])
        self._factors(ROWS)

    def _col_factors(self) -> None:
        """finish_col's work (column j's new state, stored), then each product sum's column
        value of that state."""
        self._finish(COL, self.cols[0])
        self._factors(COLS)

    def _factors(self, varies: str) -> None:
        """factor[k]: product sum k's row (column) value, of the state in x."""
        for k, total in enumerate(self.products):
            value = self.w.element(checked(self.program, total.part(varies)))
            self.w.body.append(f"factor[{k}] = {value};  // {total.name}")

    def _product_elements(self) -> None:
        """Each product sum's element value."""
        for k, total in enumerate(self.products):
            e = self.w.element(checked(self.program, total.part(ELEMENT)))
            self.w.body.append(f"out[{k}] = {e};  // {total.name}")

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
        """The lines of the slots of `form`, on the values of row (column) j, stored."""
        w = self.w
        w.body.append("acc_t x[N_SLOTS] = {};")
        self._loads(form)
        self._lines(form, numbers)
        for s in self.program.slots:
            if s.form == form and s.written:
                w.body.append(f"store_at<{w._slot(s.name)}>(p_{s.name}, j, "
                              f"x[{w._slot(s.name)}]);")

    def _loads(self, form: str) -> None:
        """x's slots of `form`, row (column) j's."""
        w = self.w
        w.body += [f"x[{w._slot(s.name)}] = load_at<{w._slot(s.name)}>(p_{s.name}, j);"
                   for s in self.program.slots if s.form == form]

    def _lines(self, form: str, numbers: dict) -> None:
        """The lines of the slots of `form`, on x and the row's (column's) means."""
        w = self.w
        for k, line in enumerate(self.program.lines):
            if self.passes.vector_lines.get(k) == form:
                for call in _calls(line.expr):
                    if id(call) in numbers:
                        w.mean_names[id(call)] = f"mean[{numbers[id(call)]}]"
                w._line(line)


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
    """matrix_sums(b, first, stride, t, sums, mins): each per-matrix mean's sum over rows
    (columns) first, first + stride, ... of matrix b, and with product sums each one's sum of
    C_j S_j / rows over those columns (the combine pass's, in `t`), the count of the values its
    form needs positive that are not, and each clamp's minima over the rows and the columns;
    matrix_store(b, sums, mins) stores the means of the sums added over every row (column),
    each product sum's M sum_j C_j S_j and whether every form holds."""

    def source(self) -> str:
        self.products = product_sums(self.program)
        self.clamps = [c for total in self.products for c in total.clamps]
        n_means = len(self._firsts())
        n_reduced = n_means + (len(self.products) + 1 if self.products else 0)
        self.n_means = n_means
        statics = [f"  static constexpr int N_REDUCED = {n_reduced}, "
                   f"N_MINS = {max(2 * len(self.clamps), 1)};",
                   "  static constexpr int N_ROW = {}, N_COL = {};".format(
                       *counts(self.program)[1:])]
        methods = self._method("void matrix_sums(long long b, long long first, long long stride, "
                               "const Tiles& t, acc_t (&sums)[N_REDUCED], acc_t (&mins)[N_MINS])",
                               ["(void)t;", *self._body(self._sums)])
        methods += self._method("void matrix_store(long long b, const acc_t (&sums)[N_REDUCED], "
                                "const acc_t (&mins)[N_MINS])",
                                ["(void)mins;", *self._body(self._store)])
        return self.struct(statics, methods, "matrix_walk")

    def _firsts(self) -> list:
        """(call, the form of the vector it reduces, the matrix's count of them) per mean."""
        firsts = numbered(c for c, _ in self.passes.matrix_means)[1]
        forms = [self.passes.form_of(call) for call in firsts]
        return [(call, form, "rows" if form == ROW else "cols") for call, form in zip(firsts, forms)]

    def _loads(self, form: str, names: set, count: str, at: str) -> list:
        """x's slots of `form` that `names` holds, at `at` of matrix b's `count` of them."""
        w = self.w
        return [f"    x[{w._slot(s.name)}] = load_at<{w._slot(s.name)}>(p_{s.name}, "
                f"b * {count} + {at});"
                for s in self.program.slots if s.form == form and s.name in names]

    def _sums(self) -> None:
        w = self.w
        w.body.append("for (int k = 0; k < N_MINS; ++k) mins[k] = infinity();")
        for k, (call, form, count) in enumerate(self._firsts()):
            w.body += [f"{{  // {ast.unparse(call)}, over the matrix's {count}",
                       "  acc_t sum = acc_t(0);",
                       f"  for (long long r = first; r < {count}; r += stride) {{",
                       "    acc_t x[N_SLOTS] = {};",
                       *self._loads(form, names_read(call.args[0]), count, "r"),
                       f"    sum += {w.element(call.args[0])};", "  }", f"  sums[{k}] = sum;", "}"]
        if self.products:
            self._product_sums(ROW, "rows")
            self._product_sums(COL, "cols")

    def _product_sums(self, form: str, count: str) -> None:
        """The product sums' terms over the matrix's rows (or columns): the form's positive
        values counted where they are not, each clamp's minimum of its row (column) value, and
        over the columns each C_j S_j."""
        w, varies = self.w, ROWS if form == ROW else COLS
        n = self.n_means
        fails = f"sums[{n + len(self.products)}]"
        positive = [f.expr for total in self.products for f in total.positive
                    if f.varies == varies]
        clamps = [checked(self.program, product_text(c.factors, varies)) for c in self.clamps]
        nodes = positive + clamps
        names = set().union(*(names_read(node) for node in nodes)) if nodes else set()
        lines = [f"{{  // the product sums over the matrix's {count}"]
        if form == ROW:
            lines += [f"  {fails} = acc_t(0);"]
        else:
            lines += [f"  for (int k = {n}; k < {n + len(self.products)}; ++k) sums[k] = acc_t(0);"]
        lines += [f"  for (long long r = first; r < {count}; r += stride) {{",
                  "    acc_t x[N_SLOTS] = {};", *self._loads(form, names, count, "r")]
        for node in positive:
            lines.append(f"    {{ const acc_t v = {w.element(node)};  // {ast.unparse(node)} > 0")
            lines.append(f"      {fails} += (isfinite(v) && v > acc_t(0)) ? acc_t(0) : "
                         f"acc_t(1); }}")
        side = 0 if form == ROW else 1
        for i, node in enumerate(clamps):
            at = 2 * i + side
            lines.append(f"    mins[{at}] = fmin(mins[{at}], {w.element(node)});")
        for k, total in enumerate(self.products if form == COL else ()):
            lines.append(f"    sums[{n + k}] += t.prod_parts[{k} * t.row_groups * t.batch * t.cols"
                         f" + b * t.cols + r];  // {total.name}: C_j S_j / rows")
        w.body += lines + ["  }", "}"]

    def _store(self) -> None:
        w = self.w
        firsts = self._firsts()
        for k, (call, _, count) in enumerate(firsts):
            w.body += [f"const acc_t f_m{k} = sums[{k}] / acc_t({count});  // {ast.unparse(call)}",
                       f"means[b * MATRIX_WORDS + {k}] = static_cast<double>(f_m{k});"]
        if not self.products:
            return
        keys = {mean_key(call): f"f_m{k}" for k, (call, _, _) in enumerate(firsts)}
        n, n_products = len(firsts), len(self.products)
        holds = [f"sums[{n + n_products}] == acc_t(0)"]
        for k, total in enumerate(self.products):
            m = self._with_means(checked(self.program, total.part(PER_MATRIX)), keys)
            w.body.append(f"means[b * MATRIX_WORDS + {n + k}] = static_cast<double>("
                          f"{m} * sums[{n + k}]) * static_cast<double>(rows);  // {total.name}")
            for f in total.positive:
                if f.varies == PER_MATRIX:
                    v = self._with_means(f.expr, keys)
                    holds.append(f"(isfinite({v}) && {v} > acc_t(0))")
        for i, clamp in enumerate(self.clamps):
            part = checked(self.program, product_text(clamp.factors, PER_MATRIX))
            m = self._with_means(part, keys)
            bound = self._with_means(clamp.bound, keys)
            holds.append(f"{m} * mins[{2 * i}] * mins[{2 * i + 1}] >= {bound}")
        w.body.append(f"means[b * MATRIX_WORDS + {n + n_products}] = "
                      f"({' && '.join(holds)}) ? 1.0 : 0.0;")

    def _with_means(self, node, keys: dict) -> str:
        """acc_t code of a per-matrix value, its means the ones just computed."""
        for call in mean_calls(node):
            self.w.mean_names[id(call)] = keys[mean_key(call)]
        return self.w.element(node)


def _calls(expr) -> list:
    return [n for n in ast.walk(expr) if isinstance(n, ast.Call)]
