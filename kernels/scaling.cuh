// Elementwise list utilities: scaling (in place, or into outputs with MTA_OUT), unscaling with
// non-finite detection (torch.amp's unscale), adding a number, and zeroing.
#pragma once
#include "walker.cuh"

#ifndef MTA_OUT
#define MTA_OUT 0
#endif

namespace mta {

struct ScaleArgs {
  double factor;
  const float* factor_ptr;
  float* found_inf_out;  // Unscale: set to 1 when any input is inf or NaN
};

__device__ __forceinline__ acc_t scale_factor(const ScaleArgs& a) {
  return acc_t(scalar_arg(a.factor_ptr, a.factor));
}

// x * factor, into the tensor itself or into slot 1.
struct Scale {
  static constexpr int N_SLOTS = MTA_OUT ? 2 : 1, N_SUMS = 0, GRAD = -1;
  static constexpr unsigned READ = 1u, WRITTEN = 1u << (N_SLOTS - 1);
  using Args = ScaleArgs;

  acc_t factor;

  __device__ Scale(const Args& a, int, const float*) : factor(scale_factor(a)) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const { x[N_SLOTS - 1] = x[0] * factor; }
};

// x *= factor, and a flag when x is not finite (checked before scaling, as torch does).
struct Unscale {
  static constexpr int N_SLOTS = 1, N_SUMS = 0, GRAD = -1;
  static constexpr unsigned WRITTEN = 1u;
  using Args = ScaleArgs;

  acc_t factor;
  float* found_inf;

  __device__ Unscale(const Args& a, int, const float*) : factor(scale_factor(a)), found_inf(a.found_inf_out) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {
    if (!isfinite(x[0])) *found_inf = 1.0f;  // every writer stores the same value
    if (factor != acc_t(1)) x[0] = x[0] * factor;
  }
};

// x += factor (e.g. device step counters, advanced where found_inf is not set).
struct Add {
  static constexpr int N_SLOTS = 1, N_SUMS = 0, GRAD = -1;
  static constexpr unsigned WRITTEN = 1u;
  using Args = ScaleArgs;

  acc_t addend;

  __device__ Add(const Args& a, int, const float*) : addend(scale_factor(a)) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const { x[0] = x[0] + addend; }
};

struct Zero {
  static constexpr int N_SLOTS = 1, N_SUMS = 0, GRAD = -1;
  static constexpr unsigned READ = 0u, WRITTEN = 1u;
  using Args = ScaleArgs;

  __device__ Zero(const Args&, int, const float*) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const { x[0] = acc_t(0); }
};

}  // namespace mta
