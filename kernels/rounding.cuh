// Stochastic rounding of fp32 results to bfloat16 params (MTA_STOCHASTIC), as
// mtapply/stochastic.py defines it: the value's 16 low bits plus 16 random bits, truncated.
// The bits of element `index` of the caller's tensor `tensor` at `step` are the low 16 bits of
// word index % 4 of Philox4x32-10 (Salmon et al. 2011) keyed by the 64-bit seed at counter
// (index / 4 low word, high word, step, tensor): reproducible, and the same under a CUDA graph.
#pragma once
#include "dtypes.cuh"

#ifndef MTA_STOCHASTIC
#define MTA_STOCHASTIC 0
#endif

namespace mta {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    uint4 next;
    next.x = hi1 ^ c.y ^ k0;
    next.y = lo1;
    next.z = hi0 ^ c.w ^ k1;
    next.w = lo0;
    c = next;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// One tensor's stream of random bits at one step; an op holds one (member `rounding`).
struct StochasticRounding {
  unsigned key0, key1, step, tensor;

  // seed words, the step and the caller's index of each tensor of the group, as the op's
  // arguments carry them
  __device__ void init(double seed_lo, double seed_hi, double step_value, const int* tensors,
                       int group_tensor) {
    key0 = static_cast<unsigned>(seed_lo);
    key1 = static_cast<unsigned>(seed_hi);
    step = static_cast<unsigned>(step_value);
    tensor = static_cast<unsigned>(tensors[group_tensor]);
  }

  // The random words of elements 4 * quad ... 4 * quad + 3.
  __device__ __forceinline__ uint4 words(long long quad) const {
    uint4 counter;
    counter.x = static_cast<unsigned>(static_cast<unsigned long long>(quad));
    counter.y = static_cast<unsigned>(static_cast<unsigned long long>(quad) >> 32);
    counter.z = step;
    counter.w = tensor;
    return philox4x32_10(counter, key0, key1);
  }
};

__device__ __forceinline__ unsigned short round_bf16_stochastic(float x, unsigned word) {
  const unsigned bits = __float_as_uint(x);
  if (x != x) return 0x7FC0u;                                        // a quiet NaN
  if ((bits & 0x7F800000u) == 0x7F800000u) return bits >> 16;        // an infinity stays
  return static_cast<unsigned short>((bits + (word & 0xFFFFu)) >> 16);
}

__device__ __forceinline__ unsigned pick(const uint4& w, int k) {
  return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}

// Stores W fp32 values at element i of a bfloat16 tensor, rounded stochastically. W is 1 or a
// multiple of 4, and i a multiple of W: one Philox call serves four elements.
template <int W>
__device__ __forceinline__ void store_bf16_stochastic(char* base, long long i, const float (&v)[W],
                                                      const StochasticRounding& rounding) {
  static_assert(W == 1 || W % 4 == 0, "vectors of whole Philox words");
  if constexpr (W == 1) {
    const uint4 w = rounding.words(i >> 2);
    reinterpret_cast<unsigned short*>(base)[i] = round_bf16_stochastic(v[0], pick(w, int(i & 3)));
  } else {
    unsigned short vals[W];
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 w = rounding.words((i >> 2) + q);
#pragma unroll
      for (int k = 0; k < 4; ++k) vals[4 * q + k] = round_bf16_stochastic(v[4 * q + k], pick(w, k));
    }
    // 8-byte words for 4 values, 16-byte words for whole multiples of 8
    unsigned short* dst = reinterpret_cast<unsigned short*>(base) + i;
    if constexpr (W % 8 == 0) {
      union { uint4 words[W / 8]; unsigned short vals[W]; } u;
#pragma unroll
      for (int k = 0; k < W; ++k) u.vals[k] = vals[k];
#pragma unroll
      for (int w = 0; w < W / 8; ++w) reinterpret_cast<uint4*>(dst)[w] = u.words[w];
    } else {
      union { uint2 words[W / 4]; unsigned short vals[W]; } u;
#pragma unroll
      for (int k = 0; k < W; ++k) u.vals[k] = vals[k];
#pragma unroll
      for (int w = 0; w < W / 4; ++w) reinterpret_cast<uint2*>(dst)[w] = u.words[w];
    }
  }
}

}  // namespace mta
