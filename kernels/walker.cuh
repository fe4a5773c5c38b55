// The chunk walker: the only loop over tensor memory in mtapply. Each op is a functor that
// transforms the values of one element held in registers; the walker finds the block's
// (tensor, chunk), loads every slot, calls the functor and stores the slots it writes.
//
// Configuration comes from the generated preamble (see mtapply/_source.py):
//   MTA_BLOCK, MTA_CHUNK, MTA_VEC   threads per block, elements per chunk, elements per vector
//   MTA_SLOTS                       slots per table record (an op's pass may load fewer)
//   mta::acc_t                      math type (float, or double for float64 params)
//   mta::SlotType<S>::type          storage type of slot S
#pragma once
#include "dtypes.cuh"

namespace mta {

// Arguments of every launch. The group's table, in device memory:
//   blocks[b]  = (tensor index, chunk index) of CUDA block b; a tensor's blocks are consecutive
//   records[t] = {numel, address of slot 0, ..., address of slot MTA_SLOTS - 1}
// AMP loss scaling, common to every op: grads arrive multiplied by grad_scale (or by
// *grad_scale_ptr) and are divided by it; when *found_inf_ptr is non-zero nothing is written.
// Ops that sum over each tensor (Op::N_SUMS > 0) use the workspace: partials (per block),
// arrivals (per tensor, zero between launches) and sums (per tensor, the totals).
template <class Args>
struct Launch {
  const int2* blocks;
  const long long* records;
  double grad_scale;
  const float* grad_scale_ptr;
  const float* found_inf_ptr;
  float* partials;
  unsigned* arrivals;
  float* sums;
  Args args;
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

// Applies op to W consecutive elements starting at i (W = MTA_VEC, or 1 for the scalar path);
// an op that sums also adds each element's contributions to `acc`.
template <class Op, int W>
__device__ __forceinline__ void apply(const Op& op, acc_t grad_scale, char* const (&ptr)[Op::N_SLOTS],
                                      long long i, float (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1]) {
  constexpr int N = Op::N_SLOTS;
  acc_t v[N][W];
  load_slots<0, N, W>(ptr, i, v);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    acc_t x[N];
#pragma unroll
    for (int s = 0; s < N; ++s) x[s] = v[s][k];
    if constexpr (Op::GRAD >= 0) {
      if (grad_scale != acc_t(1)) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
    }
    if constexpr (Op::N_SUMS > 0) op(x, acc);
    else op(x);
#pragma unroll
    for (int s = 0; s < N; ++s) v[s][k] = x[s];
  }
  if constexpr (Op::WRITTEN != 0u) store_slots<0, N, Op::WRITTEN, W>(ptr, i, v);
}

// Sum of `value` over the block, in a fixed order (deterministic); every thread gets it.
__device__ __forceinline__ float block_sum(float value) {
  __shared__ float warp_sums[MTA_BLOCK / 32];
  __syncthreads();  // warp_sums may still be read by the previous call
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < MTA_BLOCK / 32; ++w) total += warp_sums[w];
  return total;
}

// Writes this block's sums; the last block of the tensor to finish adds all of the tensor's
// block sums in block order (so the result does not depend on timing) into sums[tensor].
template <int N_SUMS, class Args>
__device__ void finish_sums(const Launch<Args>& launch, const float (&acc)[N_SUMS], int tensor,
                            int chunk, long long numel) {
  float mine[N_SUMS];
#pragma unroll
  for (int k = 0; k < N_SUMS; ++k) mine[k] = block_sum(acc[k]);
  __shared__ bool last;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < N_SUMS; ++k) launch.partials[static_cast<long long>(blockIdx.x) * N_SUMS + k] = mine[k];
    __threadfence();
    const unsigned chunks = static_cast<unsigned>((numel + MTA_CHUNK - 1) / MTA_CHUNK);
    last = atomicAdd(&launch.arrivals[tensor], 1u) == chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const long long first = static_cast<long long>(blockIdx.x) - chunk;
  const long long chunks = (numel + MTA_CHUNK - 1) / MTA_CHUNK;
#pragma unroll
  for (int k = 0; k < N_SUMS; ++k) {
    float part = 0.0f;
    for (long long b = threadIdx.x; b < chunks; b += MTA_BLOCK)
      part += __ldcg(&launch.partials[(first + b) * N_SUMS + k]);  // L2: written by other blocks
    const float total = block_sum(part);
    if (threadIdx.x == 0) launch.sums[static_cast<long long>(tensor) * N_SUMS + k] = total;
  }
  if (threadIdx.x == 0) launch.arrivals[tensor] = 0u;  // ready for the next launch
}

template <class Op>
__device__ __forceinline__ void walk(const Launch<typename Op::Args>& launch) {
  constexpr int N = Op::N_SLOTS;
  if (launch.found_inf_ptr && *launch.found_inf_ptr != 0.0f) return;
  const acc_t grad_scale = launch.grad_scale_ptr ? acc_t(*launch.grad_scale_ptr) : acc_t(launch.grad_scale);
  const int2 job = launch.blocks[blockIdx.x];
  const long long* rec = launch.records + static_cast<long long>(job.x) * (MTA_SLOTS + 1);
  const long long numel = rec[0];
  char* ptr[N];  // an op may use only the first slots of the records (e.g. a norms pass)
  unsigned long long address_bits = 0;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    ptr[s] = reinterpret_cast<char*>(rec[1 + s]);
    address_bits |= static_cast<unsigned long long>(rec[1 + s]);
  }
  const long long begin = static_cast<long long>(job.y) * MTA_CHUNK;
  const long long end = min(begin + static_cast<long long>(MTA_CHUNK), numel);
  const Op op(launch.args, job.x, launch.sums);
  float acc[Op::N_SUMS > 0 ? Op::N_SUMS : 1] = {};
  long long scalar_from = begin;
  // Chunks start at multiples of MTA_VEC elements, so one aligned base keeps every vector aligned.
  if ((address_bits & 15ull) == 0) {
    scalar_from = begin + (end - begin) / MTA_VEC * MTA_VEC;
    for (long long i = begin + threadIdx.x * MTA_VEC; i < scalar_from; i += MTA_BLOCK * MTA_VEC)
      apply<Op, MTA_VEC>(op, grad_scale, ptr, i, acc);
  }
  for (long long i = scalar_from + threadIdx.x; i < end; i += MTA_BLOCK)
    apply<Op, 1>(op, grad_scale, ptr, i, acc);
  if constexpr (Op::N_SUMS > 0) finish_sums<Op::N_SUMS>(launch, acc, job.x, job.y, numel);
}

}  // namespace mta

// Defines the kernel entry point NAME for functor OP (an op has one entry per pass).
#define MTA_DEFINE_ENTRY(NAME, OP)                                                  \
  extern "C" __global__ void __launch_bounds__(MTA_BLOCK)                            \
  NAME(const mta::Launch<OP::Args> launch) { mta::walk<OP>(launch); }
