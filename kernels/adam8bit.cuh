// Adam / AdamW with 8-bit blockwise-quantized moments (mtapply/quantization.py defines the format).
//
// Slots: params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax (params and
// grads float32 or 16-bit; bfloat16 params may be rounded stochastically). A group whose
// moments are uint8 codes runs Adam8bit: each warp takes whole blocks of QBLOCK elements (a chunk
// holds MTA_CHUNK / QBLOCK of them, so no block straddles chunks or tensors), dequantizes both
// moments with the block's scale, applies the Adam functor in registers, takes the block's fresh
// absolute maxima across the warp and stores the moments as the nearest codes of the dynamic
// maps. A group whose moments are float32 (small tensors) runs the plain Adam functor.
// The maps, the midpoints between their values and the guides that find a code in a few
// comparisons (mtapply.quantization.code_guide) come from the generated dynamic_maps.cuh.
#pragma once
#include "adam.cuh"
#include "dynamic_maps.cuh"

namespace mta {

constexpr int QBLOCK = 256;           // elements per quantization block
constexpr int PER_LANE = QBLOCK / 32;  // consecutive elements each lane of a warp holds
static_assert(MTA_CHUNK % QBLOCK == 0, "a chunk must hold whole quantization blocks");

constexpr unsigned GUIDE_LOW = (127u - 23u) << GUIDE_BITS, GUIDE_HIGH = 127u << GUIDE_BITS;
constexpr unsigned GUIDE_CELLS = GUIDE_HIGH - GUIDE_LOW + 1;  // per sign
constexpr int MAX_STEPS = SIGNED_STEPS > UNSIGNED_STEPS ? SIGNED_STEPS : UNSIGNED_STEPS;

struct Maps {
  float value[2][256];              // [signed, unsigned] map values, ascending
  float mid[2][256 + MAX_STEPS];    // midpoints between neighbours, then +inf
  unsigned char guide[2][2 * GUIDE_CELLS];
};

// Index of the map value nearest to x (ties to the lower one), i.e. the number of midpoints
// below x: the guide gives those below x's cell (sign, exponent, top mantissa bits), and the
// at most STEPS midpoints inside the cell are compared.
template <int STEPS>
__device__ __forceinline__ unsigned nearest_code(const unsigned char* guide, const float* mid, float x) {
  if (x != x) return 255u;  // NaN sorts last, as in NumPy
  const unsigned bits = __float_as_uint(x);
  const unsigned cell = min(max((bits & 0x7fffffffu) >> (23 - GUIDE_BITS), GUIDE_LOW), GUIDE_HIGH) - GUIDE_LOW;
  const unsigned first = guide[(bits >> 31) * GUIDE_CELLS + cell];
  unsigned code = first;
#pragma unroll
  for (int j = 0; j < STEPS; ++j) code += mid[first + j] < x ? 1u : 0u;
  return code;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// A lane's PER_LANE elements move as 16-byte words (floats) or one 8-byte word (codes).
template <int BYTES> struct WordOf { typedef uint4 type; };
template <> struct WordOf<8> { typedef unsigned long long type; };

// Loads PER_LANE elements of type T at i: whole words when `vector`, else those below numel.
template <class T>
__device__ __forceinline__ void load_lane(const T* base, long long i, long long numel, bool vector,
                                          T (&out)[PER_LANE]) {
  typedef typename WordOf<PER_LANE * sizeof(T) == 8 ? 8 : 16>::type Word;
  constexpr int WORDS = PER_LANE * sizeof(T) / sizeof(Word);
  if (vector) {
    union { Word words[WORDS]; T vals[PER_LANE]; } u;
    const Word* src = reinterpret_cast<const Word*>(base + i);
#pragma unroll
    for (int w = 0; w < WORDS; ++w) u.words[w] = src[w];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) out[k] = u.vals[k];
  } else {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) out[k] = i + k < numel ? base[i + k] : T{};
  }
}

template <class T>
__device__ __forceinline__ void store_lane(T* base, long long i, long long numel, bool vector,
                                           const T (&in)[PER_LANE]) {
  typedef typename WordOf<PER_LANE * sizeof(T) == 8 ? 8 : 16>::type Word;
  constexpr int WORDS = PER_LANE * sizeof(T) / sizeof(Word);
  if (vector) {
    union { Word words[WORDS]; T vals[PER_LANE]; } u;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) u.vals[k] = in[k];
    Word* dst = reinterpret_cast<Word*>(base + i);
#pragma unroll
    for (int w = 0; w < WORDS; ++w) dst[w] = u.words[w];
  } else {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k)
      if (i + k < numel) base[i + k] = in[k];
  }
}

// The lane's new params, rounded to their storage: to nearest, or stochastically.
template <class P>
__device__ __forceinline__ void store_params(P* param, long long i, long long numel, bool vector,
                                             const float (&p)[PER_LANE], const Adam& op) {
#if MTA_STOCHASTIC
  char* base = reinterpret_cast<char*>(param);
  if (vector) {
    store_bf16_stochastic<PER_LANE>(base, i, p, op.rounding);
    return;
  }
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const float one[1] = {p[k]};
    if (i + k < numel) store_bf16_stochastic<1>(base, i + k, one, op.rounding);
  }
#else
  (void)op;
  P rounded[PER_LANE];
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) rounded[k] = from_acc<P>(p[k]);
  store_lane(param, i, numel, vector, rounded);
#endif
}

struct Adam8bit {
  static constexpr bool OWN_WALK = true;
  static constexpr int MIN_BLOCKS = 4;  // per SM: caps registers at 64 (occupancy over spills)
  using Args = AdamArgs;
  enum Slot { PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX };

  static __device__ void walk(const Launch<Args>& launch) {
    __shared__ Maps maps;
    for (int i = threadIdx.x; i < 256 + MAX_STEPS; i += MTA_BLOCK) {
      if (i < 256) {
        maps.value[0][i] = SIGNED_MAP[i];
        maps.value[1][i] = UNSIGNED_MAP[i];
      }
      maps.mid[0][i] = i < 255 ? SIGNED_MIDPOINTS[i] : __int_as_float(0x7f800000);
      maps.mid[1][i] = i < 255 ? UNSIGNED_MIDPOINTS[i] : __int_as_float(0x7f800000);
    }
    for (int i = threadIdx.x; i < 2 * GUIDE_CELLS; i += MTA_BLOCK) {
      maps.guide[0][i] = SIGNED_GUIDE[i];
      maps.guide[1][i] = UNSIGNED_GUIDE[i];
    }
    __syncthreads();
    if (launch.found_inf_ptr && *launch.found_inf_ptr != 0.0f) return;
    const float grad_scale = float(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
    const Chunk job = chunk_of(launch);
    typedef typename SlotType<PARAM>::type P;  // float, or 16-bit params (stochastic rounding)
    typedef typename SlotType<GRAD>::type G;
    P* param = reinterpret_cast<P*>(job.addresses[PARAM]);
    const G* grad = reinterpret_cast<const G*>(job.addresses[GRAD]);
    unsigned char* m_codes = reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG]);
    unsigned char* v_codes = reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG_SQ]);
    float* m_absmax = reinterpret_cast<float*>(job.addresses[EXP_AVG_ABSMAX]);
    float* v_absmax = reinterpret_cast<float*>(job.addresses[EXP_AVG_SQ_ABSMAX]);
    // 8-byte words of codes and 16-byte words of params and grads, when every base allows them
    const bool aligned = (((job.addresses[PARAM] | job.addresses[GRAD]) & 15) |
                          ((job.addresses[EXP_AVG] | job.addresses[EXP_AVG_SQ]) & 7)) == 0;
    const Adam op(launch.args, job.tensor, nullptr);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (long long start = job.begin + static_cast<long long>(warp) * QBLOCK; start < job.end;
         start += (MTA_BLOCK / 32) * QBLOCK) {
      const long long block = start / QBLOCK, i = start + lane * PER_LANE;
      const bool vector = aligned && i + PER_LANE <= job.numel;
      P stored[PER_LANE];
      G g[PER_LANE];
      unsigned char mc[PER_LANE], vc[PER_LANE];
      load_lane(param, i, job.numel, vector, stored);
      load_lane(grad, i, job.numel, vector, g);
      load_lane(m_codes, i, job.numel, vector, mc);
      load_lane(v_codes, i, job.numel, vector, vc);
      const float m_scale = m_absmax[block], v_scale = v_absmax[block];
      float p[PER_LANE], m[PER_LANE], v[PER_LANE], m_max = 0.0f, v_max = 0.0f;
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        const float gk = to_acc(g[k]);
        acc_t x[4] = {to_acc(stored[k]), grad_scale != 1.0f ? gk / grad_scale : gk,
                      maps.value[0][mc[k]] * m_scale, maps.value[1][vc[k]] * v_scale};
        op(x);
        p[k] = x[PARAM];
        m[k] = x[EXP_AVG];
        v[k] = x[EXP_AVG_SQ];
        if (i + k < job.numel) {  // elements past the tensor's end weigh nothing in the maxima
          m_max = fmaxf(m_max, fabsf(m[k]));
          v_max = fmaxf(v_max, fabsf(v[k]));
        }
      }
      m_max = warp_max(m_max);
      v_max = warp_max(v_max);
      // times the reciprocal, as quantize_blockwise; divided where it overflows (a subnormal
      // maximum: the branch is the same for the whole warp)
      const float m_inverse = m_max > 0.0f ? 1.0f / m_max : 0.0f;
      const float v_inverse = v_max > 0.0f ? 1.0f / v_max : 0.0f;
      const bool m_divide = m_inverse > 3.40282347e38f, v_divide = v_inverse > 3.40282347e38f;
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        const float mn = m_divide ? m[k] / m_max : m[k] * m_inverse;
        const float vn = v_divide ? v[k] / v_max : v[k] * v_inverse;
        mc[k] = nearest_code<SIGNED_STEPS>(maps.guide[0], maps.mid[0], mn);
        vc[k] = nearest_code<UNSIGNED_STEPS>(maps.guide[1], maps.mid[1], vn);
      }
      store_params(param, i, job.numel, vector, p, op);
      store_lane(m_codes, i, job.numel, vector, mc);
      store_lane(v_codes, i, job.numel, vector, vc);
      if (lane == 0) {
        m_absmax[block] = m_max;
        v_absmax[block] = v_max;
      }
    }
  }
};

}  // namespace mta
