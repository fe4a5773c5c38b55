// The chunk walker: the only loop over tensor memory in mtapply. Each op is a functor that
// transforms the values of one element held in registers; the walker finds the block's
// (tensor, chunk), loads every slot, calls the functor and stores the slots it writes.
//
// Configuration comes from the generated preamble (see mtapply/_source.py):
//   MTA_BLOCK, MTA_CHUNK, MTA_VEC   threads per block, elements per chunk, elements per vector
//   mta::acc_t                      math type (float, or double for float64 params)
//   mta::SlotType<S>::type          storage type of slot S
#pragma once
#include "dtypes.cuh"

namespace mta {

// Table of one launch group, in device memory:
//   blocks[b]  = (tensor index, chunk index) of CUDA block b
//   records[t] = {numel, ptr[0], ..., ptr[N_SLOTS - 1]} as N_SLOTS + 1 64-bit words
// AMP loss scaling, common to every op: the grads arrive multiplied by grad_scale (or by
// *grad_scale_ptr) and are divided by it; when *found_inf_ptr is non-zero nothing is written.
template <class Op>
struct Launch {
  const int2* blocks;
  const long long* records;
  double grad_scale;
  const float* grad_scale_ptr;
  const float* found_inf_ptr;
  typename Op::Args args;
};

template <class T, int VEC>
__device__ __forceinline__ void load_vec(const char* base, long long i, acc_t (&out)[VEC]) {
  static_assert(VEC * sizeof(T) % 16 == 0, "vector must be whole 16-byte words");
  union { uint4 words[VEC * sizeof(T) / 16]; T vals[VEC]; } u;
  const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(base) + i);
#pragma unroll
  for (int w = 0; w < int(VEC * sizeof(T) / 16); ++w) u.words[w] = src[w];
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = to_acc(u.vals[k]);
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(char* base, long long i, const acc_t (&in)[VEC]) {
  union { uint4 words[VEC * sizeof(T) / 16]; T vals[VEC]; } u;
#pragma unroll
  for (int k = 0; k < VEC; ++k) u.vals[k] = from_acc<T>(in[k]);
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<T*>(base) + i);
#pragma unroll
  for (int w = 0; w < int(VEC * sizeof(T) / 16); ++w) dst[w] = u.words[w];
}

// Loads slots S..N-1 of W elements at i (W = 1: one element) into registers.
template <int S, int N, int W>
__device__ __forceinline__ void load_slots(char* const (&ptr)[N], long long i, acc_t (&v)[N][W]) {
  if constexpr (S < N) {
    using T = typename SlotType<S>::type;
    if constexpr (W == 1) v[S][0] = to_acc(reinterpret_cast<const T*>(ptr[S])[i]);
    else load_vec<T, W>(ptr[S], i, v[S]);
    load_slots<S + 1, N, W>(ptr, i, v);
  }
}

// Stores the slots among S..N-1 that the op writes (bit s of WRITTEN).
template <int S, int N, unsigned WRITTEN, int W>
__device__ __forceinline__ void store_slots(char* const (&ptr)[N], long long i, const acc_t (&v)[N][W]) {
  if constexpr (S < N) {
    using T = typename SlotType<S>::type;
    if constexpr ((WRITTEN >> S) & 1u) {
      if constexpr (W == 1) reinterpret_cast<T*>(ptr[S])[i] = from_acc<T>(v[S][0]);
      else store_vec<T, W>(ptr[S], i, v[S]);
    }
    store_slots<S + 1, N, WRITTEN, W>(ptr, i, v);
  }
}

// Applies op to W consecutive elements starting at i (W = MTA_VEC, or 1 for the scalar path).
template <class Op, int W>
__device__ __forceinline__ void apply(const Op& op, acc_t grad_scale, char* const (&ptr)[Op::N_SLOTS],
                                      long long i) {
  constexpr int N = Op::N_SLOTS;
  acc_t v[N][W];
  load_slots<0, N, W>(ptr, i, v);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    acc_t x[N];
#pragma unroll
    for (int s = 0; s < N; ++s) x[s] = v[s][k];
    if (grad_scale != acc_t(1)) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
    op(x);
#pragma unroll
    for (int s = 0; s < N; ++s) v[s][k] = x[s];
  }
  store_slots<0, N, Op::WRITTEN, W>(ptr, i, v);
}

template <class Op>
__device__ __forceinline__ void walk(const Launch<Op>& launch) {
  constexpr int N = Op::N_SLOTS;
  if (launch.found_inf_ptr && *launch.found_inf_ptr != 0.0f) return;
  const acc_t grad_scale = launch.grad_scale_ptr ? acc_t(*launch.grad_scale_ptr) : acc_t(launch.grad_scale);
  const int2 job = launch.blocks[blockIdx.x];
  const long long* rec = launch.records + static_cast<long long>(job.x) * (N + 1);
  const long long numel = rec[0];
  char* ptr[N];
  unsigned long long address_bits = 0;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    ptr[s] = reinterpret_cast<char*>(rec[1 + s]);
    address_bits |= static_cast<unsigned long long>(rec[1 + s]);
  }
  const long long begin = static_cast<long long>(job.y) * MTA_CHUNK;
  const long long end = min(begin + static_cast<long long>(MTA_CHUNK), numel);
  const Op op(launch.args);
  long long scalar_from = begin;
  // Chunks start at multiples of MTA_VEC elements, so one aligned base keeps every vector aligned.
  if ((address_bits & 15ull) == 0) {
    scalar_from = begin + (end - begin) / MTA_VEC * MTA_VEC;
    for (long long i = begin + threadIdx.x * MTA_VEC; i < scalar_from; i += MTA_BLOCK * MTA_VEC)
      apply<Op, MTA_VEC>(op, grad_scale, ptr, i);
  }
  for (long long i = scalar_from + threadIdx.x; i < end; i += MTA_BLOCK)
    apply<Op, 1>(op, grad_scale, ptr, i);
}

}  // namespace mta

// Defines the kernel entry point `mta_entry` for functor OP.
#define MTA_DEFINE_ENTRY(OP)                                                        \
  extern "C" __global__ void __launch_bounds__(MTA_BLOCK)                            \
  mta_entry(const mta::Launch<OP> launch) { mta::walk<OP>(launch); }
