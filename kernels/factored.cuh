// Factored state (mtapply/rules/_factored.py): a param of two or more dimensions, seen as a
// stack of matrices (batch, rows, cols) over its last two dimensions, keeps some state as one
// value per row or per column of each matrix. Its row and column means are reductions, which
// run before the chunk walker's passes, on the same blocks:
//   factor_walk   each tile of each matrix (some rows by up to 128 columns: Tiles) read once,
//                 coalesced, by a whole block: the tile's partial sums of the op's element
//                 terms per row and per column, stored in the workspace;
//   combine_walk  each row's and each column's partial sums added in a fixed order (no float
//                 atomics: the same bits every run), then the op's finish of that row or
//                 column (its new row or column state, stored);
//   matrix_walk   per matrix, the means over its rows (or columns) of those new values, into
//                 the plan's workspace, which the later passes read.
// A row of the stack is j = element / cols (batch * rows rows), a column c = (j / rows) * cols
// + element % cols (batch * cols columns).
//
// The op (a generated rule functor, OWN_WALK) is made as an indexed op, Op(args, chunk, sums),
// with members `factored`, `rows`, `cols`, `means`; factor_walk calls its terms(x, row_terms,
// col_terms) (N_ROW, N_COL values each), combine_walk its finish_row(j, means) and
// finish_col(c, means), matrix_walk its matrix_sums(b, first, stride, sums) and
// matrix_store(b, sums) for matrix b.
#pragma once
#include "walker.cuh"

namespace mta {

constexpr int WARPS = MTA_BLOCK / 32;
constexpr int SHAPE_WORDS = 11;  // per tensor in shape_array (mtapply/rules/_factored_cuda.py)

// Exact quotients n / d of a tensor's element indices by its rows or columns, without a 64-bit
// division (some 70 instructions an element), by Granlund and Montgomery's round-up method for
// N-bit words: with l = ceil(log2 d), magic = floor(2^N (2^l - d) / d) + 1 (below 2^N) and
// t = mulhi(magic, n), n / d = (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0) for every n < 2^N,
// that is (t + n) >> l with the sum taken in 2N bits. The walker gives an indexed op each index
// as an unsigned 32-bit word where every index of its tensor fits one (`narrow`): the cheaper
// quotient; else as 64 bits. The magic numbers are made once on the host (divider_words in
// mtapply/rules/_factored_cuda.py), not by a long division in every thread of every block;
// tests/test_factored_division.py checks the arithmetic.
struct Divider {
  unsigned long long wide_magic;
  unsigned magic, shift;       // 32-bit words (magic 0: d >= 2^32, every quotient is 0)
  unsigned wide_first, wide_second;  // the 64-bit quotient's shifts

  // Whether every index of a tensor of `numel` elements fits 32 bits (the quotients it takes).
  __device__ static bool narrow(long long numel) { return numel <= (1ll << 32); }

  // From its three words in the tensor's shape_array (each pair as low and high halves).
  __device__ static Divider of(const long long* words) {
    Divider v;
    v.wide_magic = static_cast<unsigned long long>(words[0]);
    v.magic = static_cast<unsigned>(words[1]);
    v.shift = static_cast<unsigned>(static_cast<unsigned long long>(words[1]) >> 32);
    v.wide_first = static_cast<unsigned>(words[2]);
    v.wide_second = static_cast<unsigned>(static_cast<unsigned long long>(words[2]) >> 32);
    return v;
  }

  __device__ __forceinline__ unsigned quotient(unsigned n) const {
    const unsigned long long t = __umulhi(n, magic);
    return static_cast<unsigned>((t + n) >> shift);
  }

  __device__ __forceinline__ long long quotient(long long n) const {
    const unsigned long long x = static_cast<unsigned long long>(n);
    const unsigned long long t = __umul64hi(wide_magic, x);
    return static_cast<long long>((t + ((x - t) >> wide_first)) >> wide_second);
  }
};

// Slot S's value at index j of its own (row or column) vector, and its store.
template <int S>
__device__ __forceinline__ acc_t load_at(const char* base, long long j) {
  return to_acc(reinterpret_cast<const typename SlotType<S>::type*>(base)[j]);
}

template <int S>
__device__ __forceinline__ void store_at(char* base, long long j, acc_t value) {
  using T = typename SlotType<S>::type;
  reinterpret_cast<T*>(base)[j] = from_acc<T>(value);
}

template <int GROUP>
__device__ __forceinline__ acc_t group_sum(acc_t value) {
  return group_reduce<GROUP>(value, Plus{});
}

__device__ __forceinline__ acc_t warp_sum(acc_t value) { return group_sum<32>(value); }

// [first, last): the part of n items that block `index` of `blocks` takes.
__device__ __forceinline__ void share(long long n, long long blocks, long long index,
                                      long long& first, long long& last) {
  const long long each = (n + blocks - 1) / blocks;
  first = min(index * each, n);
  last = min(first + each, n);
}

// The slots the factor pass's terms read (the row and column means' element values): those its
// whole-row tiles' products read too are loaded there only.
template <class Op>
__device__ constexpr unsigned terms_read() { return Op::TERMS_READ & loaded_slots<Op>(); }

// The values of the slots of MASK at element i, as the walker loads them (the grad unscaled by
// AMP's scale).
template <class Op, unsigned MASK>
__device__ __forceinline__ void load_element(char* const (&ptr)[Op::N_SLOTS], long long i,
                                             acc_t grad_scale, acc_t (&x)[Op::N_SLOTS]) {
  constexpr int N = Op::N_SLOTS;
  acc_t v[N][1];
  load_slots<0, N, MASK, 1>(ptr, i, v);
#pragma unroll
  for (int s = 0; s < N; ++s) x[s] = v[s][0];
  if (grad_scale != acc_t(1)) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
}

// The W elements from i of each slot of MASK, as stored: loaded as whole words (i a multiple
// of W, the bases 16-byte aligned) and converted (the grad unscaled by AMP's scale) only when
// summed, so that the loads a lane has in flight hold 16-bit data in half the registers.
template <class Op, int W, int WIDEST, unsigned MASK>
struct Stored {
  static constexpr int N = Op::N_SLOTS;
  static constexpr int WORDS = W * WIDEST > 16 ? (W * WIDEST + 15) / 16 : 1;  // each slot's
  uint4 words[N][WORDS];

  template <int S = 0>
  __device__ __forceinline__ void load(char* const (&ptr)[N], long long i) {
    if constexpr (S < N) {
      using T = typename SlotType<S>::type;
      if constexpr ((MASK >> S) & 1u) {
        static_assert(W * sizeof(T) % 8 == 0, "vector must be whole 8-byte words");
        const T* at = reinterpret_cast<const T*>(ptr[S]) + i;
        if constexpr (W * sizeof(T) == 8) {
          const uint2 half = *reinterpret_cast<const uint2*>(at);
          words[S][0] = make_uint4(half.x, half.y, 0u, 0u);
        } else {
#pragma unroll
          for (int w = 0; w < int(W * sizeof(T) / 16); ++w) words[S][w] = reinterpret_cast<const uint4*>(at)[w];
        }
      }
      load<S + 1>(ptr, i);
    }
  }

  template <int S = 0>
  __device__ __forceinline__ void unpack(acc_t grad_scale, acc_t (&x)[W][N]) const {
    if constexpr (S < N) {
      using T = typename SlotType<S>::type;
      if constexpr ((MASK >> S) & 1u) {
        union { uint4 w[WORDS]; T vals[W]; } u;
#pragma unroll
        for (int w = 0; w < WORDS; ++w) u.w[w] = words[S][w];
#pragma unroll
        for (int k = 0; k < W; ++k) x[k][S] = to_acc(u.vals[k]);
      } else {
#pragma unroll
        for (int k = 0; k < W; ++k) x[k][S] = acc_t(0);
      }
      unpack<S + 1>(grad_scale, x);
    } else if (grad_scale != acc_t(1)) {
#pragma unroll
      for (int k = 0; k < W; ++k) x[k][Op::GRAD] = x[k][Op::GRAD] / grad_scale;
    }
  }
};

// The factor pass's tiles: each matrix is cut into tiles of TILE_ROWS x TILE_COLS elements (a
// tile at most TILE elements; TILE_COLS a multiple of 32 up to MAX_TILE_COLS, so that a warp
// reads whole rows of a tile: 512 bytes of float32, or two rows of 256 bytes of 16-bit data,
// where cols is a multiple of 128), taken in
// order (matrix, row group, column group) by the tensor's blocks in turn. A tile's partial sums
// lie after the tensor's per-matrix means in the workspace, as acc_t: per row and column group,
// and per column and row group (group-major, so that the combine pass's threads read
// consecutive rows or columns).
// mtapply/rules/_factored_cuda.py (factor_partials) reserves the same room.
//
// With product sums (mtapply/rules/_factored_sums.py), a tensor whose rows fit a block
// (`rowwise`: cols a multiple of 128, at most 4 * MTA_BLOCK * ROW_VECTORS) is cut into tiles of
// whole rows instead, ceil(ROW_TILE / cols) of them (factor_rows), and its tiles' partial sums of
// each product's E R per column follow the column sums (`prod_parts`, laid out as col_parts).
constexpr int TILE = 32768, MAX_TILE_COLS = 128;
constexpr int ROW_TILE = 262144, ROW_VECTORS = 3;

struct Tiles {
  long long batch, rows, cols;      // the stack of matrices
  int tile_rows, tile_cols;
  long long row_groups, col_groups;  // of each matrix
  acc_t* row_parts;  // [(k * col_groups + g) * batch * rows + j]: sum k of stack row j in group g
  acc_t* col_parts;  // [(k * row_groups + g) * batch * cols + c]: sum k of stack column c
  acc_t* prod_parts;  // [(k * row_groups + g) * batch * cols + c]: product k's E R, whole rows

  __device__ long long count() const { return batch * row_groups * col_groups; }
};

template <class Op>
__device__ Tiles tiles_of(long long rows, long long cols, long long numel, double* means,
                          bool rowwise) {
  Tiles t;
  t.rows = rows;
  t.cols = cols;
  t.batch = numel / (rows * cols);
  if (rowwise) {
    t.tile_cols = static_cast<int>(cols);
    t.tile_rows = (ROW_TILE + t.tile_cols - 1) / t.tile_cols;
  } else {
    t.tile_cols = static_cast<int>(min((cols + 31) / 32 * 32, static_cast<long long>(MAX_TILE_COLS)));
    t.tile_rows = TILE / t.tile_cols;
  }
  t.row_groups = (t.rows + t.tile_rows - 1) / t.tile_rows;
  t.col_groups = (t.cols + t.tile_cols - 1) / t.tile_cols;
  t.row_parts = reinterpret_cast<acc_t*>(means + t.batch * Op::MATRIX_WORDS);
  t.col_parts = t.row_parts + Op::N_ROW * t.col_groups * t.batch * t.rows;
  t.prod_parts = t.col_parts + Op::N_COL * t.row_groups * t.batch * t.cols;
  return t;
}

// How a warp reads a tile, by LANE: the elements each lane loads as one vector (4 or 8), or 1
// for single elements.
//   LANE 4: lane l takes columns 4l to 4l + 3 of one row (16 bytes of float32, 32 of float64,
//           8 of 16-bit data where cols is not a multiple of 8: cols a multiple of 4, the
//           bases 16-byte aligned);
//   LANE 8: lanes 0-15 take columns 8l to 8l + 7 of one row and lanes 16-31 the same of the
//           next (16 bytes of 16-bit data a lane, as float32 has: cols a multiple of 8);
//   LANE 1: lane l takes columns l, l + 32, l + 64, l + 96 one by one.
// Warp w takes its row sets w, w + WARPS, ... (a set: the rows a warp reads at once), IN_FLIGHT
// sets at a time, their loads all issued before any sum. Each row's terms are summed by its
// lanes (then group_sum), each column's by its lane over the warp's rows and then over the warps
// in warp order: fixed orders, the same bits every run.
constexpr int IN_FLIGHT = 4;  // (10% faster than 2 on an H200, a few bytes spilled notwithstanding)

template <int LANE>
struct TileLanes {
  static constexpr int ELEMENTS = LANE == 8 ? 8 : 4;               // each lane's columns a row
  static constexpr int ROWS = LANE == 8 ? 2 : 1;                   // a warp's rows at once
  static constexpr int PER_ROW = 32 / ROWS;                        // lanes a row
  __device__ static int row(int lane) { return lane / PER_ROW; }   // within the warp's set
  __device__ static int column(int lane, int q) {                  // the tile column of value q
    return LANE == 1 ? lane + 32 * q : ELEMENTS * (lane % PER_ROW) + q;
  }
};

// The widest element the op loads, in bytes: 16-bit data takes LANE 8, other data LANE 4.
template <class Op, unsigned MASK, int S = 0>
__device__ constexpr int widest_loaded() {
  if constexpr (S >= Op::N_SLOTS) {
    return 0;
  } else {
    constexpr int here =
        ((MASK >> S) & 1u) ? static_cast<int>(sizeof(typename SlotType<S>::type)) : 0;
    constexpr int rest = widest_loaded<Op, MASK, S + 1>();
    return here > rest ? here : rest;
  }
}

// The warps' column sums of a tile (shared memory), before they are summed in warp order.
template <class Op>
using ColumnParts = acc_t[WARPS][MAX_TILE_COLS][Op::N_COL > 0 ? Op::N_COL : 1];

template <class Op, int LANE>
__device__ void factor_tile(const Op& op, const Tiles& t, long long tile,
                            char* const (&ptr)[Op::N_SLOTS], acc_t grad_scale,
                            ColumnParts<Op>& parts) {
  using L = TileLanes<LANE>;
  constexpr int N_COL = Op::N_COL > 0 ? Op::N_COL : 1, N_ROW = Op::N_ROW > 0 ? Op::N_ROW : 1;
  constexpr int SET = L::ROWS * WARPS;  // rows between a warp's sets
  const long long group = tile % t.col_groups, band = tile / t.col_groups;
  const long long matrix = band / t.row_groups, row_group = band % t.row_groups;
  const long long row0 = matrix * t.rows + row_group * t.tile_rows;  // its first stack row
  const long long col0 = group * t.tile_cols;                        // its first column
  const int n_rows = static_cast<int>(min(static_cast<long long>(t.tile_rows),
                                          t.rows - row_group * t.tile_rows));
  const int n_cols = static_cast<int>(min(static_cast<long long>(t.tile_cols), t.cols - col0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // the lane's row's first element, and its row sums' place, each a set further each trip
  long long at = (row0 + warp * L::ROWS + L::row(lane)) * t.cols + col0;
  acc_t* row_out = t.row_parts + group * t.batch * t.rows + row0;
  const long long set_elements = SET * t.cols, row_parts_apart = t.col_groups * t.batch * t.rows;
  acc_t col_sums[L::ELEMENTS][N_COL] = {};
  // r0: the warp's set; the same trips in every lane
  for (int r0 = warp * L::ROWS; r0 < n_rows; r0 += IN_FLIGHT * SET, at += IN_FLIGHT * set_elements) {
    // the sets' loads: vectors held as stored (LANE > 1), or single elements' values (LANE 1);
    // the form not taken is never written and takes no registers
    constexpr unsigned MASK = terms_read<Op>();
    Stored<Op, LANE, widest_loaded<Op, MASK>(), MASK> stored[IN_FLIGHT];
    acc_t single[IN_FLIGHT][L::ELEMENTS][Op::N_SLOTS];
#pragma unroll
    for (int f = 0; f < IN_FLIGHT; ++f) {
      const int r = r0 + f * SET + L::row(lane);
      if (r >= n_rows) continue;
      if constexpr (LANE > 1) {
        const int c = L::column(lane, 0);
        if (c < n_cols) stored[f].load(ptr, at + f * set_elements + c);
      } else {
#pragma unroll
        for (int q = 0; q < L::ELEMENTS; ++q) {
          const int c = L::column(lane, q);
          acc_t one[Op::N_SLOTS];  // (copied whole: the registers the compiler lays out best)
          if (c < n_cols) load_element<Op, MASK>(ptr, at + f * set_elements + c, grad_scale, one);
#pragma unroll
          for (int s = 0; s < Op::N_SLOTS; ++s) single[f][q][s] = one[s];
        }
      }
    }
#pragma unroll
    for (int f = 0; f < IN_FLIGHT; ++f) {
      if (r0 + f * SET >= n_rows) continue;  // (the whole warp: its set's first row)
      const int r = r0 + f * SET + L::row(lane);
      acc_t row_sums[N_ROW] = {};
      acc_t x[L::ELEMENTS][Op::N_SLOTS];
      if constexpr (LANE > 1) {
        stored[f].unpack(grad_scale, x);
      } else {
#pragma unroll
        for (int q = 0; q < L::ELEMENTS; ++q)
#pragma unroll
          for (int s = 0; s < Op::N_SLOTS; ++s) x[q][s] = single[f][q][s];
      }
#pragma unroll
      for (int q = 0; q < L::ELEMENTS; ++q) {
        if (r >= n_rows || L::column(lane, q) >= n_cols) continue;
        acc_t row[N_ROW], col[N_COL];
        op.terms(x[q], row, col);
#pragma unroll
        for (int k = 0; k < Op::N_ROW; ++k) row_sums[k] += row[k];
#pragma unroll
        for (int k = 0; k < Op::N_COL; ++k) col_sums[q][k] += col[k];
      }
#pragma unroll
      for (int k = 0; k < Op::N_ROW; ++k) {
        const acc_t total = group_sum<L::PER_ROW>(row_sums[k]);
        if (lane % L::PER_ROW == 0 && r < n_rows)
          row_out[k * row_parts_apart + r] = total;
      }
    }
  }
  if constexpr (Op::N_COL > 0) {
#pragma unroll
    for (int q = 0; q < L::ELEMENTS; ++q)
#pragma unroll
      for (int k = 0; k < N_COL; ++k) {
        acc_t sum = col_sums[q][k];
        // the warp's two rows of a column are 16 lanes apart: sum them (a + b == b + a)
        if constexpr (L::ROWS == 2) sum += __shfl_xor_sync(0xffffffffu, sum, 16);
        if (L::row(lane) == 0) parts[warp][L::column(lane, q)][k] = sum;
      }
    __syncthreads();
    for (int c = threadIdx.x; c < n_cols; c += MTA_BLOCK) {
#pragma unroll
      for (int k = 0; k < N_COL; ++k) {
        acc_t total = acc_t(0);
        for (int w = 0; w < WARPS; ++w) total += parts[w][c][k];
        t.col_parts[(k * t.row_groups + row_group) * t.batch * t.cols + matrix * t.cols + col0 + c] =
            total;
      }
    }
    __syncthreads();  // parts is written again by the next tile
  }
}

template <class Op, int LANE>
__device__ void factor_tiles(const Op& op, const Tiles& t, long long first, long long blocks,
                             char* const (&ptr)[Op::N_SLOTS], acc_t grad_scale,
                             ColumnParts<Op>& parts) {
  for (long long tile = first; tile < t.count(); tile += blocks)
    factor_tile<Op, LANE>(op, t, tile, ptr, grad_scale, parts);
}

// The pointers of the slots of MASK moved on by n elements of each slot's type.
template <unsigned MASK, int N, int S = 0>
__device__ __forceinline__ void advance(char* (&p)[N], long long n) {
  if constexpr (S < N) {
    using T = typename SlotType<S>::type;
    if constexpr ((MASK >> S) & 1u) p[S] += n * static_cast<long long>(sizeof(T));
    advance<MASK, N, S + 1>(p, n);
  }
}

// Whole-row tiles (a `rowwise` tensor's): the block's threads share each row, per_row of them
// (whole warps) taking `share` of its vectors of 4 (thread v0 the vectors v0, v0 + per_row,
// ...), MTA_BLOCK / per_row rows a trip. A trip: each row's terms summed by its warps (shared
// memory); the next trip's loads issued; one __syncthreads; then over the row's warps in
// order, the row's new state and product factors (row_factors, by every thread of the row),
// and each element's products E R. A column's sums stay in one thread's registers for the
// whole tile (a trip's rows' threads added in order at its end), products without column
// factors in a thread's total (block_sum): fixed orders, the same bits every run.
// Tiles of ROW_TILE elements (not TILE): fewer partial sums for the combine pass (gpt2-124M
// in float32 on an H200, factor and combine passes 341 + 31 -> 304 + 21 us).

template <class Op>
struct RowParts {
  static constexpr int N_ROW = Op::N_ROW > 0 ? Op::N_ROW : 1;
  static constexpr int N_OUT = Op::N_COL + Op::N_PRODUCTS;
  acc_t rows[2][WARPS][N_ROW];  // a trip's warp sums of its rows' terms, by trip parity
  acc_t cols[4 * MTA_BLOCK];  // a sum's column values of a trip's rows 1.., where it has several
};

// A vector's values: unpacked from its loads, or (VEC false) loaded element by element.
template <class Op, bool VEC, unsigned MASK, class Vector>
__device__ __forceinline__ void vector_values(const Vector& stored, char* const (&ptr)[Op::N_SLOTS],
                                              long long at, bool there, acc_t grad_scale,
                                              acc_t (&x)[4][Op::N_SLOTS]) {
  if constexpr (VEC) {
    stored.unpack(grad_scale, x);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc_t one[Op::N_SLOTS] = {};
      if (there) load_element<Op, MASK>(ptr, at + e, grad_scale, one);
#pragma unroll
      for (int s = 0; s < Op::N_SLOTS; ++s) x[e][s] = one[s];
    }
  }
}

// How many of its vectors of 4 each thread takes a row (at most ROW_VECTORS): per_row =
// vectors / q threads a row, whole warps, as few of MTA_BLOCK's left idle as can be (768
// columns: 64 threads of 3 vectors, four rows a trip), the fewer vectors on a tie.
__device__ __forceinline__ int row_share(int vectors) {
  int best = 0, idle = MTA_BLOCK;
  for (int q = (vectors + MTA_BLOCK - 1) / MTA_BLOCK; q <= ROW_VECTORS; ++q) {
    if (vectors % q != 0 || (vectors / q) % 32 != 0) continue;
    const int left = MTA_BLOCK % (vectors / q);
    if (left < idle) { best = q; idle = left; }
  }
  return best;  // (host: cols a multiple of 128 up to 4 * MTA_BLOCK * ROW_VECTORS, so q exists)
}

template <class Op, int Q, bool VEC>
__device__ void factor_rows(const Op& op, const Tiles& t, long long tile,
                            char* const (&ptr)[Op::N_SLOTS], acc_t grad_scale,
                            RowParts<Op>& parts) {
  constexpr int N = Op::N_SLOTS, NR = RowParts<Op>::N_ROW, NP = Op::N_PRODUCTS;
  constexpr int NC = Op::N_COL > 0 ? Op::N_COL : 1;
  constexpr unsigned MASK = loaded_slots<Op>();
  using Vector = Stored<Op, 4, widest_loaded<Op, MASK>(), MASK>;
  const long long matrix = tile / t.row_groups, row_group = tile % t.row_groups;
  const long long row0 = matrix * t.rows + row_group * t.tile_rows;  // its first stack row
  const int n_rows = static_cast<int>(min(static_cast<long long>(t.tile_rows),
                                          t.rows - row_group * t.tile_rows));
  const int vectors = t.tile_cols / 4;
  const int share = row_share(vectors);
  const int per_row = vectors / share, at_once = MTA_BLOCK / per_row;
  const int sub = threadIdx.x / per_row, v0 = threadIdx.x % per_row;
  const int warp = threadIdx.x / 32, row_warps = per_row / 32;
  // products with column factors are summed per column; the others (no C_j: p^2) per thread
  constexpr unsigned ROWS = Op::PRODUCT_ROWS, COLUMNS = Op::PRODUCT_COLUMNS;
  acc_t col_sums[Q][4][NC] = {};
  acc_t prod_sums[Q][4][NP] = {};
  acc_t totals[NP] = {};
  // a trip's loads: its data (VEC) and its rows' state, issued before the trip before it
  // finishes (that trip's products wait for its rows' sums, one __syncthreads away)
  Vector stored[Q];
  acc_t state[N] = {};
  // the thread's first vector of the row it loads next, a slot's pointer moved on a trip at a
  // time (not each load's address from its index: some 30 instructions fewer a trip)
  char* next[N];
#pragma unroll
  for (int s = 0; s < N; ++s) next[s] = ptr[s];
  advance<MASK>(next, (row0 + sub) * t.cols + 4 * v0);
  auto load = [&](int r) {
    if (sub >= at_once || r >= n_rows) return;
    if constexpr (VEC) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
        if (q < share) stored[q].load(next, 4 * q * per_row);
      advance<MASK>(next, static_cast<long long>(at_once) * t.cols);
    }
    op.row_load(row0 + r, state);
  };
  load(sub);
  int parity = 0;
  for (int r0 = 0; r0 < n_rows; r0 += at_once) {  // the same trips in every thread
    const int r = r0 + sub;
    const bool mine = sub < at_once && r < n_rows;
    acc_t row_sums[NR] = {}, elements[Q][4][NP];
#pragma unroll
    for (int q = 0; q < Q; ++q) {  // the row terms, column terms and products' element values
      const bool there = mine && q < share;
      acc_t x[4][N];
      vector_values<Op, VEC, MASK>(stored[q], ptr, (row0 + r) * t.cols + 4 * (v0 + q * per_row),
                                   there, grad_scale, x);
      if (!there) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc_t row[NR], col[NC];
        op.terms(x[e], row, col);
#pragma unroll
        for (int k = 0; k < Op::N_ROW; ++k) row_sums[k] += row[k];
#pragma unroll
        for (int k = 0; k < Op::N_COL; ++k) col_sums[q][e][k] += col[k];
        op.product_elements(x[e], elements[q][e]);
#pragma unroll
        for (int k = 0; k < NP; ++k) {  // (those without a row factor: now)
          if ((ROWS >> k) & 1u) continue;
          if ((COLUMNS >> k) & 1u) prod_sums[q][e][k] += elements[q][e][k];
          else totals[k] += elements[q][e][k];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < Op::N_ROW; ++k) {
      const acc_t total = warp_sum(row_sums[k]);
      if (threadIdx.x % 32 == 0) parts.rows[parity][warp][k] = total;
    }
    acc_t before[N];  // this trip's row state, the next one's loading
#pragma unroll
    for (int s = 0; s < N; ++s) before[s] = state[s];
    load(r + at_once);
    __syncthreads();
    if (mine) {  // the row's new state, then its products
      acc_t mean[NR];
#pragma unroll
      for (int k = 0; k < Op::N_ROW; ++k) {
        acc_t total = acc_t(0);  // (unrolled over every warp a row may have: no loop to run)
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
          if (w < row_warps) total += parts.rows[parity][sub * row_warps + w][k];
        if (v0 == 0) t.row_parts[k * t.batch * t.rows + row0 + r] = total;  // (one column group)
        mean[k] = total / acc_t(t.cols);
      }
      acc_t factor[NP];
      op.row_factors(before, mean, factor);
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (q >= share) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int k = 0; k < NP; ++k) {
            if (!((ROWS >> k) & 1u)) continue;
            if ((COLUMNS >> k) & 1u) prod_sums[q][e][k] += elements[q][e][k] * factor[k];
            else totals[k] += elements[q][e][k] * factor[k];
          }
      }
    }
    parity ^= 1;
  }
  // the tile's column sums: each a thread's where a trip has one row, else added over the trip's
  // rows in order (at_once rows of cols: at most MTA_BLOCK * 4 elements)
  const long long first = row_group * t.batch * t.cols + matrix * t.cols;
  const long long apart = t.row_groups * t.batch * t.cols;  // between sums k and k + 1
#pragma unroll
  for (int k = 0; k < NP; ++k) {  // a product without column factors: the tile's sum at column 0
    if ((COLUMNS >> k) & 1u) continue;
    const acc_t total = block_sum(totals[k]);
    for (int c = threadIdx.x; c < t.cols; c += MTA_BLOCK)
      t.prod_parts[k * apart + first + c] = c == 0 ? total : acc_t(0);
  }
  if (at_once == 1) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int v = v0 + q * per_row;
      if (q >= share) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int k = 0; k < Op::N_COL; ++k) t.col_parts[k * apart + first + 4 * v + e] = col_sums[q][e][k];
#pragma unroll
        for (int k = 0; k < NP; ++k)
          if ((COLUMNS >> k) & 1u) t.prod_parts[k * apart + first + 4 * v + e] = prod_sums[q][e][k];
      }
    }
    return;
  }
  // each vector q's values of each sum: the threads of rows 1.. of a trip through shared
  // memory (MTA_BLOCK vectors), added to row 0's thread's in row order
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q >= share) continue;  // (the same in every thread)
#pragma unroll
    for (int k = 0; k < RowParts<Op>::N_OUT; ++k) {
      if (k >= Op::N_COL && !((COLUMNS >> (k - Op::N_COL)) & 1u)) continue;
      acc_t mine[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        mine[e] = k < Op::N_COL ? col_sums[q][e][k < NC ? k : 0]
                                : prod_sums[q][e][k >= Op::N_COL ? k - Op::N_COL : 0];
      if (sub >= 1 && sub < at_once) {
#pragma unroll
        for (int e = 0; e < 4; ++e) parts.cols[4 * ((sub - 1) * per_row + v0) + e] = mine[e];
      }
      __syncthreads();
      if (sub == 0) {
        acc_t* out = k < Op::N_COL ? t.col_parts + k * apart : t.prod_parts + (k - Op::N_COL) * apart;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_t total = mine[e];
          for (int s = 1; s < at_once; ++s) total += parts.cols[4 * ((s - 1) * per_row + v0) + e];
          out[first + 4 * (v0 + q * per_row) + e] = total;
        }
      }
      __syncthreads();  // parts.cols is written again next
    }
  }
}

// The factor pass: every tile's partial sums of the element terms (the block's tiles are its
// chunk index, then every tensor's chunk count further).
template <class Op>
__device__ void factor_walk(const Launch<typename Op::Args>& launch) {
  const Chunk job = chunk_of(launch);
  const Op op(args_of(launch, job.tensor), job, launch.sums);
  if (!op.factored) return;  // (the same in every thread of the block)
  const acc_t grad_scale = acc_t(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
  char* ptr[Op::N_SLOTS];
  char* param_copy = nullptr;
  const bool aligned = (element_pointers(job, ptr, param_copy) & 15ull) == 0;
  const Tiles t = tiles_of<Op>(op.rows, op.cols, job.numel, op.means, op.rowwise);
  const long long blocks = (job.numel + MTA_CHUNK - 1) / MTA_CHUNK;
  if constexpr (Op::N_PRODUCTS > 0) {
    if (op.rowwise) {
      __shared__ RowParts<Op> rows;
      for (long long tile = job.index; tile < t.count(); tile += blocks) {
        if (aligned) factor_rows<Op, ROW_VECTORS, true>(op, t, tile, ptr, grad_scale, rows);
        else factor_rows<Op, ROW_VECTORS, false>(op, t, tile, ptr, grad_scale, rows);
      }
      return;
    }
  }
  __shared__ ColumnParts<Op> parts;
  if constexpr (widest_loaded<Op, terms_read<Op>()>() == 2) {  // 16-bit data only: 8 a vector
    if (aligned && t.cols % 8 == 0) {  // every row's vectors aligned
      factor_tiles<Op, 8>(op, t, job.index, blocks, ptr, grad_scale, parts);
      return;
    }
  }
  if (aligned && t.cols % 4 == 0) {
    factor_tiles<Op, 4>(op, t, job.index, blocks, ptr, grad_scale, parts);
  } else {
    factor_tiles<Op, 1>(op, t, job.index, blocks, ptr, grad_scale, parts);
  }
}

// Whether the combine pass gives each of n rows (or columns) of `groups` partial sums a warp,
// not a thread: for many groups (a thread's loop is latency-bound), unless the tensor's blocks
// have too few warps for a row each (a thread then takes a row of fewer than 64 groups: 768 x
// 3072 in tiles of whole rows, 35 groups of 3072 columns over 36 blocks, 84 -> 71 us an H200's
// combine pass of gpt2-124M's).
__device__ __forceinline__ bool by_warps(long long n, long long groups, long long blocks) {
  return groups >= 32 && (groups >= 64 || n <= WARPS * blocks);
}

// The blocks of a tensor's `blocks` that take its n rows (or columns) of `groups` partial sums
// each in the combine pass: a whole block's worth apiece (a thread or, for many groups, a warp
// a row), so that a pass over a few thousand rows keeps a few blocks busy and the rest return
// before they make the op (its hyperparameters: some hundred instructions a thread).
__device__ __forceinline__ long long busy_blocks(long long n, long long groups, long long blocks) {
  const long long each = by_warps(n, groups, blocks) ? WARPS : MTA_BLOCK;
  return min(blocks, (n + each - 1) / each);
}

// The means of n rows (or columns) from their partial sums, `groups` of them each (in `parts`,
// K sums apiece, `count` elements to a row), the tensor's busy blocks sharing the rows;
// `finish(j, means)` takes each. A thread adds a row's few groups in group order; a warp takes a
// row of many (some thousand in an embedding's columns, a latency-bound loop for one thread):
// lane l adds groups l, l + 32, ..., then warp_sum. Either order is fixed: the same bits every run.
template <int K, class Finish>
__device__ __forceinline__ void combine(long long n, long long groups, const acc_t* parts,
                                        long long count, const Chunk& job, Finish finish) {
  long long first, last;
  const long long blocks = (job.numel + MTA_CHUNK - 1) / MTA_CHUNK;
  share(n, busy_blocks(n, groups, blocks), job.index, first, last);
  const bool warps = by_warps(n, groups, blocks);  // (the same in every thread of the block)
  const int lane = warps ? threadIdx.x % 32 : 0, stride = warps ? 32 : 1;
  const long long start = first + (warps ? threadIdx.x / 32 : threadIdx.x);
  for (long long j = start; j < last; j += MTA_BLOCK / stride) {  // the same trips in a warp
    acc_t means[K] = {};  // (the K sums' loads side by side: one latency a group, not K)
#pragma unroll 4
    for (long long g = lane; g < groups; g += stride) {
#pragma unroll
      for (int k = 0; k < K; ++k) means[k] += parts[(k * groups + g) * n + j];
    }
#pragma unroll
    for (int k = 0; k < K; ++k) means[k] = (warps ? warp_sum(means[k]) : means[k]) / acc_t(count);
    if (lane == 0) finish(j, means);
  }
}

// A block of a pass over rows, columns or matrices: its chunk, its tensor's args and shape words
// (numel, rows, cols, ...; rows 0 where the tensor is not factored and the pass has nothing to
// do). The host may launch such a pass over the blocks with work only, listed in `jobs`
// (mtapply/rules/_factored_cuda.py, vector_blocks): a few hundred blocks rather than one per
// chunk, each of which would read its chunk, tensor and shape only to return.
template <class Op>
struct MatrixBlock {
  Chunk job;
  typename Op::Args args;
  const long long* shape;

  __device__ explicit MatrixBlock(const Launch<typename Op::Args>& launch)
      : job(chunk_at(launch, launch.jobs ? launch.jobs[blockIdx.x] : blockIdx.x)),
        args(args_of(launch, job.tensor)),
        shape(args.shape_array + SHAPE_WORDS * static_cast<long long>(job.tensor)) {}
  __device__ bool factored() const { return shape[1] != 0; }
};

// The combine pass: each row's (column's) partial sums added in group order, its mean, and
// the op's finish of that row (column). A block with no rows returns before making the op.
template <class Op>
__device__ void combine_walk(const Launch<typename Op::Args>& launch) {
  const MatrixBlock<Op> block(launch);
  if (!block.factored()) return;
  const Chunk& job = block.job;
  const long long* shape = block.shape;
  const Tiles t = tiles_of<Op>(shape[1], shape[2], job.numel, block.args.means_array + shape[3],
                               shape[10] != 0);
  const long long blocks = (job.numel + MTA_CHUNK - 1) / MTA_CHUNK;
  if (job.index >= max(Op::N_ROW > 0 ? busy_blocks(t.batch * t.rows, t.col_groups, blocks) : 0ll,
                       Op::N_COL > 0 ? busy_blocks(t.batch * t.cols, t.row_groups, blocks) : 0ll))
    return;
  const Op op(block.args, job, launch.sums);
  if constexpr (Op::N_ROW > 0)
    combine<Op::N_ROW>(t.batch * t.rows, t.col_groups, t.row_parts, t.cols, job,
                       [&](long long j, const acc_t (&means)[Op::N_ROW]) { op.finish_row(j, means); });
  if constexpr (Op::N_PRODUCTS > 0) {
    // whole rows: each column's products' sums too, times its new state's factors (C_j S_j /
    // rows, over group 0's: the matrix pass adds them)
    if (shape[10] != 0) {
      constexpr int K = Op::N_COL + Op::N_PRODUCTS;
      const long long apart = t.row_groups * t.batch * t.cols;
      combine<K>(t.batch * t.cols, t.row_groups, t.col_parts, t.rows, job,
                 [&](long long c, const acc_t (&means)[K]) {
                   acc_t col_means[Op::N_COL > 0 ? Op::N_COL : 1], factor[Op::N_PRODUCTS];
#pragma unroll
                   for (int k = 0; k < Op::N_COL; ++k) col_means[k] = means[k];
                   op.finish_col_factors(c, col_means, factor);
#pragma unroll
                   for (int k = 0; k < Op::N_PRODUCTS; ++k)
                     t.prod_parts[k * apart + c] = means[Op::N_COL + k] * factor[k];
                 });
      return;
    }
  }
  if constexpr (Op::N_COL > 0)
    combine<Op::N_COL>(t.batch * t.cols, t.row_groups, t.col_parts, t.rows, job,
                       [&](long long c, const acc_t (&means)[Op::N_COL]) { op.finish_col(c, means); });
}

// +infinity as acc_t (NVRTC has no INFINITY), the minima's start.
__device__ __forceinline__ acc_t infinity() {
  return acc_t(__longlong_as_double(0x7ff0000000000000ll));
}

// The means over each matrix's rows or columns (the op's matrix_sums over a part of them,
// added in a fixed order: the same bits every run; its matrix_store), and with product sums
// each one's sum over the columns and the minima its checks take. A tensor of no more
// matrices than chunks gives each matrix a block, its first blocks one apiece (a single large
// matrix, an embedding's 50,257 rows, is then summed by 256 threads rather than 32: with the
// launch over busy blocks only, gpt2-124M's pass 26.7 -> 6.7 us on an H200); else its first
// blocks take the matrices WARPS apiece, a warp each. The rest return before making the op.
template <class Op>
__device__ void matrix_walk(const Launch<typename Op::Args>& launch) {
  const MatrixBlock<Op> block(launch);
  if (!block.factored()) return;
  const Chunk& job = block.job;
  const long long* shape = block.shape;
  const long long batch = job.numel / (shape[1] * shape[2]);
  const long long chunks = (job.numel + MTA_CHUNK - 1) / MTA_CHUNK;
  const bool by_blocks = batch <= chunks;
  const long long blocks = by_blocks ? batch : min(chunks, (batch + WARPS - 1) / WARPS);
  if (job.index >= blocks) return;
  const Op op(block.args, job, launch.sums);
  const Tiles t = tiles_of<Op>(shape[1], shape[2], job.numel, block.args.means_array + shape[3],
                               shape[10] != 0);
  acc_t sums[Op::N_REDUCED], mins[Op::N_MINS];
  if (by_blocks) {
    op.matrix_sums(job.index, threadIdx.x, MTA_BLOCK, t, sums, mins);
#pragma unroll
    for (int k = 0; k < Op::N_REDUCED; ++k) sums[k] = block_sum(sums[k]);
#pragma unroll
    for (int k = 0; k < Op::N_MINS; ++k) mins[k] = block_reduce(mins[k], Least{});
    if (threadIdx.x == 0) op.matrix_store(job.index, sums, mins);
    return;
  }
  long long first, last;
  share(batch, blocks, job.index, first, last);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (long long b = first + warp; b < last; b += WARPS) {
    op.matrix_sums(b, lane, 32, t, sums, mins);
#pragma unroll
    for (int k = 0; k < Op::N_REDUCED; ++k) sums[k] = warp_sum(sums[k]);
#pragma unroll
    for (int k = 0; k < Op::N_MINS; ++k) mins[k] = group_reduce<32>(mins[k], Least{});
    if (lane == 0) op.matrix_store(b, sums, mins);
  }
}

}  // namespace mta
