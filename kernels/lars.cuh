// LARS (You et al. 2017, as in Paddle's lars_momentum): two passes over one table.
// Pass 0 sums ||p||^2 and ||g||^2 of each tensor; pass 1 updates with the tensor's local lr:
//   local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
//              (lr when a norm is zero, or when the tensor is excluded from adaptation)
//   v = momentum * v + local_lr * (g + weight_decay * p);   p = p - v
// Excluded tensors (adapt[t] == 0, e.g. biases and norm layers) get neither adaptation nor decay.
#pragma once
#include "walker.cuh"

namespace mta {

struct LarsArgs {
  double lr;
  const float* lr_ptr;
  double momentum;
  double weight_decay;
  double trust_coefficient;
  double eps;
  const float* adapt_array;  // per tensor of the group: 1 adapts, 0 is excluded
};

struct LarsNorms {
  enum Slot { PARAM, GRAD };
  static constexpr int N_SLOTS = 2, N_SUMS = 2;
  static constexpr unsigned WRITTEN = 0u;
  using Args = LarsArgs;

  __device__ LarsNorms(const Args&, int, const float*) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS], float (&sums)[N_SUMS]) const {
    sums[0] += static_cast<float>(x[PARAM] * x[PARAM]);
    sums[1] += static_cast<float>(x[GRAD] * x[GRAD]);
  }
};

struct Lars {
  enum Slot { PARAM, GRAD, MOMENTUM_BUFFER };
  static constexpr int N_SLOTS = 3, N_SUMS = 0;
  static constexpr unsigned WRITTEN = (1u << PARAM) | (1u << MOMENTUM_BUFFER);
  using Args = LarsArgs;

  acc_t local_lr, momentum, weight_decay;

  __device__ Lars(const Args& a, int tensor, const float* sums) {
    const double lr = scalar_arg(a.lr_ptr, a.lr);
    const bool adapt = a.adapt_array[tensor] != 0.0f;
    double rate = lr;
    if (adapt) {
      const double p_norm = sqrt(static_cast<double>(sums[2 * tensor]));
      const double g_norm = sqrt(static_cast<double>(sums[2 * tensor + 1]));
      if (p_norm > 0.0 && g_norm > 0.0)
        rate = lr * a.trust_coefficient * p_norm / (g_norm + a.weight_decay * p_norm + a.eps);
    }
    local_lr = acc_t(rate);
    momentum = acc_t(a.momentum);
    weight_decay = acc_t(adapt ? a.weight_decay : 0.0);
  }

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {
    x[MOMENTUM_BUFFER] = momentum * x[MOMENTUM_BUFFER] + local_lr * (x[GRAD] + weight_decay * x[PARAM]);
    x[PARAM] = x[PARAM] - x[MOMENTUM_BUFFER];
  }
};

}  // namespace mta
