// L2 norms of a list of tensors, per tensor and over the whole list, and global-norm clipping.
// Pass 0 (SumSquares) sums x^2 per tensor; the block that finishes the last tensor of the step
// writes the norms in the caller's order and the global norm, adding in a fixed order (so the
// result does not depend on timing or on how the list was grouped). Pass 1 of clipping
// (ClipScale) multiplies by min(1, max_norm / (global norm + eps)), as torch's clip_grad_norm_.
// Sums are fp32, for every storage type.
#pragma once
#include "walker.cuh"

namespace mta {

struct NormArgs {
  float* norms_out;  // one per tensor, in the caller's order; null when not wanted
  float* total_out;  // the global norm (one element)
  double max_norm;   // clipping only
  double eps;        // clipping only
};

struct SumSquares {
  static constexpr int N_SLOTS = 1, N_SUMS = 1, GRAD = -1;
  static constexpr unsigned WRITTEN = 0u;
  static constexpr bool GLOBAL = true;
  using Args = NormArgs;

  __device__ SumSquares(const Args&, int, const sum_t*) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS], sum_t (&sums)[N_SUMS]) const {
    sums[0] += static_cast<sum_t>(x[0] * x[0]);
  }

  __device__ static void finish(const Args& a, const sum_t* all_sums, const int* positions,
                                long long n) {
    sum_t part = 0;
    for (long long i = threadIdx.x; i < n; i += MTA_BLOCK) {
      const sum_t sum = __ldcg(&all_sums[positions[i]]);  // L2: written by other blocks
      part += sum;
      if (a.norms_out) a.norms_out[i] = static_cast<float>(sqrt(sum));
    }
    const sum_t total = block_sum(part);
    if (threadIdx.x == 0) *a.total_out = static_cast<float>(sqrt(total));
  }
};

struct ClipScale {
  static constexpr int N_SLOTS = 1, N_SUMS = 0, GRAD = -1;
  static constexpr unsigned WRITTEN = 1u;
  using Args = NormArgs;

  acc_t coefficient;

  // In fp32 like torch; a NaN norm keeps NaN (it is not clamped to 1).
  __device__ ClipScale(const Args& a, int, const sum_t*) {
    const float c = static_cast<float>(a.max_norm) / (*a.total_out + static_cast<float>(a.eps));
    coefficient = acc_t(c > 1.0f ? 1.0f : c);
  }

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const { x[0] = x[0] * coefficient; }
};

}  // namespace mta
