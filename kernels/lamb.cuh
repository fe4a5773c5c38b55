// LAMB (You et al. 2019) with Apex FusedLAMB's semantics, in two passes over one table.
// Slots are ordered (param, exp_avg, exp_avg_sq, grad) so that pass 1 loads only the first three.
// Pass 0: g = grad / clip; Adam moments; update u = m_hat / (sqrt(v_hat) + eps) (+ wd * p in
//         AdamW mode, or wd * p added to g first in L2 mode); sums ||p||^2 and ||u||^2.
// Pass 1: recomputes u from the new moments; p -= lr * ratio * u, where ratio = ||p|| / ||u||
//         when weight_decay != 0 or MTA_NVLAMB (1 when either norm is zero), else 1.
// clip = global_grad_norm / max_grad_norm when that exceeds 1 (global gradient-norm clipping).
// Compile-time flags: MTA_ADAMW (decoupled decay), MTA_NVLAMB (trust ratio even without decay).
#pragma once
#include "walker.cuh"

namespace mta {

struct LambArgs {
  double lr;
  const float* lr_ptr;
  double step;
  const float* step_ptr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double grad_averaging;   // 1: m takes (1 - beta1) * g; 0: m takes g
  double bias_correction;  // 1 or 0
  double max_grad_norm;    // 0: no clipping
  double global_grad_norm;
  const float* global_grad_norm_ptr;
};

// What both passes derive from the arguments, in double as on the host.
struct LambScalars {
  acc_t beta1, beta2, one_minus_beta2, m_weight, eps, weight_decay, bc1, bc2, inv_clip;

  __device__ explicit LambScalars(const LambArgs& a) {
    const double step = scalar_arg(a.step_ptr, a.step);
    const double norm = scalar_arg(a.global_grad_norm_ptr, a.global_grad_norm);
    const double clip = (a.max_grad_norm > 0.0 && norm > a.max_grad_norm) ? norm / a.max_grad_norm : 1.0;
    beta1 = acc_t(a.beta1);
    beta2 = acc_t(a.beta2);
    one_minus_beta2 = acc_t(1.0 - a.beta2);
    m_weight = acc_t(a.grad_averaging != 0.0 ? 1.0 - a.beta1 : 1.0);
    eps = acc_t(a.eps);
    weight_decay = acc_t(a.weight_decay);
    bc1 = acc_t(a.bias_correction != 0.0 ? 1.0 - pow(a.beta1, step) : 1.0);
    bc2 = acc_t(a.bias_correction != 0.0 ? 1.0 - pow(a.beta2, step) : 1.0);
    inv_clip = acc_t(1.0 / clip);
  }

  // The update direction from the new moments (shared by both passes: same rounding).
  __device__ __forceinline__ acc_t update(acc_t p, acc_t m, acc_t v) const {
    const acc_t u = (m / bc1) / (sqrt(v / bc2) + eps);
    return MTA_ADAMW ? u + weight_decay * p : u;
  }
};

struct LambMoments {
  enum Slot { PARAM, EXP_AVG, EXP_AVG_SQ, GRAD };
  static constexpr int N_SLOTS = 4, N_SUMS = 2;
  static constexpr unsigned WRITTEN = (1u << EXP_AVG) | (1u << EXP_AVG_SQ);
  using Args = LambArgs;

  LambScalars k;

  __device__ LambMoments(const Args& a, int, const float*) : k(a) {}

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS], float (&sums)[N_SUMS]) const {
    acc_t g = x[GRAD] * k.inv_clip;
    if (!MTA_ADAMW) g = g + k.weight_decay * x[PARAM];
    x[EXP_AVG] = x[EXP_AVG] * k.beta1 + k.m_weight * g;
    x[EXP_AVG_SQ] = x[EXP_AVG_SQ] * k.beta2 + k.one_minus_beta2 * g * g;
    const acc_t u = k.update(x[PARAM], x[EXP_AVG], x[EXP_AVG_SQ]);
    sums[0] += static_cast<float>(x[PARAM] * x[PARAM]);
    sums[1] += static_cast<float>(u * u);
  }
};

struct Lamb {
  enum Slot { PARAM, EXP_AVG, EXP_AVG_SQ };
  static constexpr int N_SLOTS = 3, N_SUMS = 0, GRAD = -1;  // grads are not read by this pass
  static constexpr unsigned WRITTEN = 1u << PARAM;
  using Args = LambArgs;

  LambScalars k;
  acc_t rate;

  __device__ Lamb(const Args& a, int tensor, const float* sums) : k(a) {
    const double lr = scalar_arg(a.lr_ptr, a.lr);
    double ratio = 1.0;
    if (MTA_NVLAMB || a.weight_decay != 0.0) {
      const double p_norm = sqrt(static_cast<double>(sums[2 * tensor]));
      const double u_norm = sqrt(static_cast<double>(sums[2 * tensor + 1]));
      if (p_norm != 0.0 && u_norm != 0.0) ratio = p_norm / u_norm;
    }
    rate = acc_t(lr * ratio);
  }

  __device__ __forceinline__ void operator()(acc_t (&x)[N_SLOTS]) const {
    x[PARAM] = x[PARAM] - rate * k.update(x[PARAM], x[EXP_AVG], x[EXP_AVG_SQ]);
  }
};

}  // namespace mta
