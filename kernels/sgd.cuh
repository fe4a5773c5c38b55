// SGD with momentum, dampening, Nesterov momentum and weight decay, matching torch.optim.SGD.
// Compile-time flags (from the generated preamble): MTA_MOMENTUM (momentum buffers present),
// MTA_NESTEROV, MTA_MAXIMIZE.
#pragma once
#include "walker.cuh"

namespace mta {

// Kernel arguments, 8 bytes each. On step 1 the momentum buffers take the gradient itself,
// as torch.optim.SGD does when it creates them.
struct SgdArgs {
  double lr;
  const float* lr_ptr;
  double step;
  const float* step_ptr;
  double momentum;
  double dampening;
  double weight_decay;
#if MTA_STOCHASTIC
  double seed_lo, seed_hi;     // the 64-bit seed's words
  const int* sr_tensor_array;  // the caller's index of each tensor of the group
#endif
};

struct Sgd {
  enum Slot { PARAM, GRAD, MOMENTUM_BUFFER };
  static constexpr int N_SLOTS = MTA_MOMENTUM ? 3 : 2;
  static constexpr unsigned WRITTEN = (1u << PARAM) | (MTA_MOMENTUM ? 1u << MOMENTUM_BUFFER : 0u);
  static constexpr int N_SUMS = 0;  // sums nothing per tensor
  using Args = SgdArgs;

  acc_t lr, momentum, one_minus_dampening, weight_decay;
  bool first_step;
#if MTA_STOCHASTIC
  StochasticRounding rounding;
#endif

  __device__ Sgd(const Args& a, int tensor, const float* /*sums*/) {
    lr = acc_t(scalar_arg(a.lr_ptr, a.lr));
    first_step = scalar_arg(a.step_ptr, a.step) < 1.5;
#if MTA_STOCHASTIC
    rounding.init(a.seed_lo, a.seed_hi, scalar_arg(a.step_ptr, a.step), a.sr_tensor_array, tensor);
#endif
    (void)tensor;
    momentum = acc_t(a.momentum);
    one_minus_dampening = acc_t(1.0 - a.dampening);
    weight_decay = acc_t(a.weight_decay);
  }

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {
    acc_t grad = MTA_MAXIMIZE ? -x[GRAD] : x[GRAD];
    if (weight_decay != acc_t(0)) grad = grad + weight_decay * x[PARAM];
    if constexpr (MTA_MOMENTUM) {
      if (momentum != acc_t(0)) {
        acc_t& buffer = x[N_SLOTS - 1];
        buffer = first_step ? grad : buffer * momentum + one_minus_dampening * grad;
        grad = MTA_NESTEROV ? grad + momentum * buffer : buffer;
      }
    }
    x[PARAM] = x[PARAM] + (-lr) * grad;
  }
};

}  // namespace mta
