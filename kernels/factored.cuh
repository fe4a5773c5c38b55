// Factored state (mtapply/rules/_factored.py): a param of two or more dimensions, seen as a
// stack of matrices (batch, rows, cols) over its last two dimensions, keeps some state as one
// value per row or per column of each matrix. Its row and column means are reductions, which
// run before the chunk walker's passes, on the same blocks (a tensor's blocks share its rows,
// then its columns, in fixed parts):
//   factor_walk   each row's and each column's sums of the op's element terms, in a fixed
//                 order (no float atomics: the same bits every run), then the op's finish of
//                 that row or column (its new row or column state, stored);
//   matrix_walk   per matrix, the means over its rows (or columns) of those new values, into
//                 the plan's workspace, which the later passes read.
// A row of the stack is j = element / cols (batch * rows rows), a column c = (j / rows) * cols
// + element % cols (batch * cols columns).
//
// The op (a generated rule functor, OWN_WALK) is made as an indexed op, Op(args, chunk, sums),
// with members `factored`, `rows`, `cols`; factor_walk calls its terms(x, row_terms,
// col_terms), finish_row(j, means) and finish_col(c, means) (N_ROW, N_COL values each),
// matrix_walk its matrix(b, lane) for matrix b.
#pragma once
#include "walker.cuh"

namespace mta {

constexpr int WARPS = MTA_BLOCK / 32;

// Exact quotients n / d of a tensor's element indices by its rows or columns, without the
// 64-bit division (some 70 instructions an element). Where every index is below 2^32 (the
// tensor's numel at most 2^32), Granlund and Montgomery's round-up method: with l = ceil(log2 d)
// and magic = floor(2^32 (2^l - d) / d) + 1 (below 2^32), n / d = (mulhi(magic, n) + n) >> l for
// every n < 2^32, the sum taken in 64 bits; larger tensors divide in 64 bits.
// tests/test_factored_division.py checks the arithmetic.
struct Divider {
  long long d;
  unsigned magic, shift;
  bool narrow;  // every index divided is below 2^32

  __device__ static Divider of(long long divisor, long long numel) {
    Divider v;
    v.d = divisor > 0 ? divisor : 1;  // (a param that is not factored has no rows)
    v.narrow = numel <= (1ll << 32) && v.d < (1ll << 32);
    v.magic = 1u;
    v.shift = 0u;
    if (v.narrow && v.d > 1) {
      const unsigned long long d = static_cast<unsigned long long>(v.d);
      v.shift = 64u - static_cast<unsigned>(__clzll(d - 1));  // ceil(log2 d)
      v.magic = static_cast<unsigned>((((1ull << v.shift) - d) << 32) / d) + 1u;
    }
    return v;
  }

  __device__ __forceinline__ long long quotient(long long n) const {
    if (narrow) {
      const unsigned x = static_cast<unsigned>(n);
      const unsigned long long high = __umulhi(x, magic);
      return static_cast<long long>((high + x) >> shift);
    }
    return n / d;
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

// Sum over the warp's lanes in a fixed order; every lane gets it.
__device__ __forceinline__ acc_t warp_sum(acc_t value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// [first, last): the part of n items that block `index` of `blocks` takes.
__device__ __forceinline__ void share(long long n, long long blocks, long long index,
                                      long long& first, long long& last) {
  const long long each = (n + blocks - 1) / blocks;
  first = min(index * each, n);
  last = min(first + each, n);
}

// The values of the slots the op reads at element i, as the walker loads them (the grad
// unscaled by AMP's scale).
template <class Op>
__device__ __forceinline__ void load_element(char* const (&ptr)[Op::N_SLOTS], long long i,
                                             acc_t grad_scale, acc_t (&x)[Op::N_SLOTS]) {
  constexpr int N = Op::N_SLOTS;
  constexpr unsigned READ = ReadMask<Op>::value & (MTA_ZERO_PARAM ? ~1u : ~0u);
  acc_t v[N][1];
  load_slots<0, N, READ, 1>(ptr, i, v);
#pragma unroll
  for (int s = 0; s < N; ++s) x[s] = v[s][0];
  if (grad_scale != acc_t(1)) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
}

// Each row of the block's part: a warp sums its elements' row terms (lanes stride the row,
// then the warp adds its lanes), and its first lane finishes the row.
template <class Op>
__device__ void factor_rows(const Op& op, const Chunk& job, char* const (&ptr)[Op::N_SLOTS],
                            acc_t grad_scale) {
  long long first, last;
  share(job.numel / op.cols, (job.numel + MTA_CHUNK - 1) / MTA_CHUNK, job.index, first, last);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (long long j = first + warp; j < last; j += WARPS) {
    acc_t sums[Op::N_ROW] = {};
    for (long long c = lane; c < op.cols; c += 32) {
      acc_t x[Op::N_SLOTS], row[Op::N_ROW], col[Op::N_COL > 0 ? Op::N_COL : 1];
      load_element<Op>(ptr, j * op.cols + c, grad_scale, x);
      op.terms(x, row, col);
#pragma unroll
      for (int k = 0; k < Op::N_ROW; ++k) sums[k] += row[k];
    }
    acc_t means[Op::N_ROW];
#pragma unroll
    for (int k = 0; k < Op::N_ROW; ++k) means[k] = warp_sum(sums[k]) / acc_t(op.cols);
    if (lane == 0) op.finish_row(j, means);
  }
}

// Each column of the block's part, 32 at a time: lane l takes column c0 + l, warp w the rows
// w, w + WARPS, ...; the warps' sums are added in warp order, and warp 0 finishes the columns.
template <class Op>
__device__ void factor_cols(const Op& op, const Chunk& job, char* const (&ptr)[Op::N_SLOTS],
                            acc_t grad_scale) {
  __shared__ acc_t parts[WARPS][32][Op::N_COL];
  long long first, last;
  share(job.numel / op.rows, (job.numel + MTA_CHUNK - 1) / MTA_CHUNK, job.index, first, last);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (long long c0 = first; c0 < last; c0 += 32) {  // the same trips in every thread
    const long long c = c0 + lane;
    acc_t sums[Op::N_COL] = {};
    if (c < last) {
      const long long base = c / op.cols * op.rows * op.cols + c % op.cols;
      for (long long r = warp; r < op.rows; r += WARPS) {
        acc_t x[Op::N_SLOTS], row[Op::N_ROW > 0 ? Op::N_ROW : 1], col[Op::N_COL];
        load_element<Op>(ptr, base + r * op.cols, grad_scale, x);
        op.terms(x, row, col);
#pragma unroll
        for (int k = 0; k < Op::N_COL; ++k) sums[k] += col[k];
      }
    }
#pragma unroll
    for (int k = 0; k < Op::N_COL; ++k) parts[warp][lane][k] = sums[k];
    __syncthreads();
    if (warp == 0 && c < last) {
      acc_t means[Op::N_COL];
#pragma unroll
      for (int k = 0; k < Op::N_COL; ++k) {
        acc_t total = acc_t(0);
        for (int w = 0; w < WARPS; ++w) total += parts[w][lane][k];
        means[k] = total / acc_t(op.rows);
      }
      op.finish_col(c, means);
    }
    __syncthreads();  // parts is written again by the next columns
  }
}

template <class Op>
__device__ void factor_walk(const Launch<typename Op::Args>& launch) {
  const Chunk job = chunk_of(launch);
  const Op op(args_of(launch, job.tensor), job, launch.sums);
  if (!op.factored) return;  // (the same in every thread of the block)
  const acc_t grad_scale = acc_t(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
  char* ptr[Op::N_SLOTS];
  char* param_copy = nullptr;
  element_pointers(job, ptr, param_copy);
  if constexpr (Op::N_ROW > 0) factor_rows(op, job, ptr, grad_scale);
  if constexpr (Op::N_COL > 0) factor_cols(op, job, ptr, grad_scale);
}

// Each matrix of the block's part, a warp each: the op's means over the matrix's rows or
// columns (its `matrix`, whose first lane stores them).
template <class Op>
__device__ void matrix_walk(const Launch<typename Op::Args>& launch) {
  const Chunk job = chunk_of(launch);
  const Op op(args_of(launch, job.tensor), job, launch.sums);
  if (!op.factored) return;
  long long first, last;
  share(job.numel / (op.rows * op.cols), (job.numel + MTA_CHUNK - 1) / MTA_CHUNK, job.index,
        first, last);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (long long b = first + warp; b < last; b += WARPS) op.matrix(b, lane);
}

}  // namespace mta
