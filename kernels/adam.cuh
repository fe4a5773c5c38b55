// Adam / AdamW per-element update, matching torch.optim.Adam and AdamW.
// Compile-time flags (from the generated preamble): MTA_AMSGRAD, MTA_DECOUPLED, MTA_MAXIMIZE,
// MTA_DECAY_MASK (weight decay scaled per tensor by decay_array: a mask of 1s and 0s, or any
// factors), MTA_LR_LABELS (lr_ptr is an array of learning rates, one per label, and each tensor
// reads the entry of its label, lr_label_array).
#pragma once
#include "walker.cuh"

namespace mta {

// sqrt(x) and a / b: IEEE, or where MTA_APPROXIMATE is set (kernels whose results carry a larger
// error anyway) one instruction each within 2 ulp, subnormals flushed to zero
template <class A> __device__ __forceinline__ A square_root(A x) { return sqrt(x); }
template <class A> __device__ __forceinline__ A divide(A a, A b) { return a / b; }
#if MTA_APPROXIMATE
template <> __device__ __forceinline__ float square_root(float x) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
template <> __device__ __forceinline__ float divide(float a, float b) {
  float r;
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

// Kernel arguments: every field is 8 bytes, so the host packs them as an array of words.
// lr and step may instead be read from device memory (lr_ptr / step_ptr non-null).
struct AdamArgs {
  double lr;
  const float* lr_ptr;
  double step;
  const float* step_ptr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
#if MTA_DECAY_MASK
  const float* decay_array;  // per tensor of the group: its weight decay's factor
#endif
#if MTA_LR_LABELS
  const int* lr_label_array;  // per tensor of the group: its entry of lr_ptr's array
#endif
#if MTA_STOCHASTIC
  double seed_lo, seed_hi;     // the 64-bit seed's words
  const int* sr_tensor_array;  // the caller's index of each tensor of the group
#endif
};

struct Adam {
  enum Slot { PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ };
  static constexpr int N_SLOTS = MTA_AMSGRAD ? 5 : 4;
  static constexpr unsigned WRITTEN = (1u << PARAM) | (1u << EXP_AVG) | (1u << EXP_AVG_SQ) |
                                      (MTA_AMSGRAD ? 1u << MAX_EXP_AVG_SQ : 0u);
  static constexpr int N_SUMS = 0;  // sums nothing per tensor
  using Args = AdamArgs;

  acc_t beta1_weight, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt;
#if MTA_STOCHASTIC
  StochasticRounding rounding;
#endif

  // Per-launch scalars are derived in double, as torch does on the host.
  __device__ Adam(const Args& a, int tensor, const float* /*sums*/) {
#if MTA_LR_LABELS
    const double lr = scalar_arg(a.lr_ptr ? a.lr_ptr + a.lr_label_array[tensor] : nullptr, a.lr);
#else
    const double lr = scalar_arg(a.lr_ptr, a.lr);
#endif
    const double step = scalar_arg(a.step_ptr, a.step);
#if MTA_STOCHASTIC
    rounding.init(a.seed_lo, a.seed_hi, step, a.sr_tensor_array, tensor);
#endif
    (void)tensor;
#if MTA_DECAY_MASK
    const double wd = a.weight_decay * static_cast<double>(a.decay_array[tensor]);
#else
    const double wd = a.weight_decay;
#endif
    beta1_weight = acc_t(1.0 - a.beta1);
    beta2 = acc_t(a.beta2);
    one_minus_beta2 = acc_t(1.0 - a.beta2);
    eps = acc_t(a.eps);
    weight_decay = acc_t(wd);
    decay = acc_t(1.0 - lr * wd);
    step_size = acc_t(lr / (1.0 - pow(a.beta1, step)));
    bias_correction2_sqrt = acc_t(sqrt(1.0 - pow(a.beta2, step)));
  }

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {
    acc_t grad = MTA_MAXIMIZE ? -x[GRAD] : x[GRAD];
    if (weight_decay != acc_t(0)) {
      if (MTA_DECOUPLED) x[PARAM] = x[PARAM] * decay;
      else grad = grad + weight_decay * x[PARAM];
    }
    // exp_avg.lerp_(grad, 1 - beta1), with torch's two-sided lerp formula.
    const acc_t diff = grad - x[EXP_AVG];
    x[EXP_AVG] = beta1_weight < acc_t(0.5) ? x[EXP_AVG] + beta1_weight * diff
                                           : grad - diff * (acc_t(1) - beta1_weight);
    x[EXP_AVG_SQ] = x[EXP_AVG_SQ] * beta2 + one_minus_beta2 * grad * grad;
    acc_t second = x[EXP_AVG_SQ];
    if constexpr (MTA_AMSGRAD) {
      x[N_SLOTS - 1] = max(x[N_SLOTS - 1], x[EXP_AVG_SQ]);
      second = x[N_SLOTS - 1];
    }
    const acc_t denom = divide(square_root(second), bias_correction2_sqrt) + eps;
    x[PARAM] = x[PARAM] + (-step_size) * divide(x[EXP_AVG], denom);
  }
};

}  // namespace mta
