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
// comparisons (mtapply.quantization.code_guide) come from the generated dynamic_maps.cuh; each
// CUDA block loads them into shared memory once for a chunk of many quantization blocks
// (Adam8bitSpec.chunk_for), and the 8-bit group compiles with fp32 division and square root
// to within 2 ulp (Adam8bitSpec.compile_options): the kernel is bound by its instructions.
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
  float value[2][256];            // [signed, unsigned] map values, ascending
  float mid[2][256 + MAX_STEPS];  // midpoints between neighbours, then +inf
  // guides as words (copied whole): the signed map's for both signs, the unsigned map's for
  // non-negative values only (second moments are never negative)
  unsigned signed_guide[(2 * GUIDE_CELLS + 3) / 4], unsigned_guide[(GUIDE_CELLS + 3) / 4];

  __device__ void load() {
    for (int i = threadIdx.x; i < 256 + MAX_STEPS; i += MTA_BLOCK) {
      if (i < 256) {
        value[0][i] = SIGNED_MAP[i];
        value[1][i] = UNSIGNED_MAP[i];
      }
      mid[0][i] = i < 255 ? SIGNED_MIDPOINTS[i] : __int_as_float(0x7f800000);
      mid[1][i] = i < 255 ? UNSIGNED_MIDPOINTS[i] : __int_as_float(0x7f800000);
    }
    copy_words(signed_guide, SIGNED_GUIDE, (2 * GUIDE_CELLS + 3) / 4);
    copy_words(unsigned_guide, UNSIGNED_GUIDE, (GUIDE_CELLS + 3) / 4);
    __syncthreads();
  }

  static __device__ void copy_words(unsigned* to, const unsigned char* from, int words) {
    for (int i = threadIdx.x; i < words; i += MTA_BLOCK) to[i] = reinterpret_cast<const unsigned*>(from)[i];
  }
};

// Index of the map value nearest to x (ties to the lower one), i.e. the number of midpoints
// below x: the guide gives those below x's cell (sign, exponent, top mantissa bits), and the
// at most STEPS midpoints inside the cell are compared. An unsigned guide covers x >= 0 only.
template <int STEPS, bool SIGNED>
__device__ __forceinline__ unsigned nearest_code(const unsigned* guide_words, const float* mid, float x) {
  if (x != x) return 255u;  // NaN sorts last, as in NumPy
  const unsigned bits = __float_as_uint(x);
  const unsigned cell = min(max((bits & 0x7fffffffu) >> (23 - GUIDE_BITS), GUIDE_LOW), GUIDE_HIGH) - GUIDE_LOW;
  const unsigned char* guide = reinterpret_cast<const unsigned char*>(guide_words);
  const unsigned first = guide[SIGNED ? (bits >> 31) * GUIDE_CELLS + cell : cell];
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

// The slots of one group's tensor, as the 8-bit walk reads them.
template <class P, class G>
struct Tensor8bit {
  P* param;
  const G* grad;
  unsigned char *m_codes, *v_codes;
  float *m_absmax, *v_absmax;
  long long numel;
};

struct Adam8bit {
  static constexpr bool OWN_WALK = true;
  static constexpr int MIN_BLOCKS = 4;  // per SM: caps registers at 64 (occupancy over spills)
  using Args = AdamArgs;
  enum Slot { PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX };

  static __device__ void walk(const Launch<Args>& launch) {
    __shared__ Maps maps;
    maps.load();
    if (launch.found_inf_ptr && *launch.found_inf_ptr != 0.0f) return;
    const float grad_scale = float(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
    const Chunk job = chunk_of(launch);
    typedef typename SlotType<PARAM>::type P;  // float, or 16-bit params (stochastic rounding)
    typedef typename SlotType<GRAD>::type G;
    const Tensor8bit<P, G> t{reinterpret_cast<P*>(job.addresses[PARAM]),
                             reinterpret_cast<const G*>(job.addresses[GRAD]),
                             reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG]),
                             reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG_SQ]),
                             reinterpret_cast<float*>(job.addresses[EXP_AVG_ABSMAX]),
                             reinterpret_cast<float*>(job.addresses[EXP_AVG_SQ_ABSMAX]), job.numel};
    // 8-byte words of codes and 16-byte words of params and grads, when every base allows them
    const bool aligned = (((job.addresses[PARAM] | job.addresses[GRAD]) & 15) |
                          ((job.addresses[EXP_AVG] | job.addresses[EXP_AVG_SQ]) & 7)) == 0;
    const Adam op(args_of(launch, job.tensor), job.tensor, nullptr);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (long long start = job.begin + static_cast<long long>(warp) * QBLOCK; start < job.end;
         start += (MTA_BLOCK / 32) * QBLOCK) {
      const long long i = start + lane * PER_LANE;
      if (aligned && start + QBLOCK <= job.numel) step_block<true>(maps, op, grad_scale, t, start / QBLOCK, i);
      else step_block<false>(maps, op, grad_scale, t, start / QBLOCK, i);
    }
  }

  // One quantization block, a warp's: this lane's PER_LANE elements from i. VECTOR: the whole
  // block lies in the tensor and moves in words.
  template <bool VECTOR, class P, class G>
  static __device__ __forceinline__ void step_block(const Maps& maps, const Adam& op, float grad_scale,
                                                    const Tensor8bit<P, G>& t, long long block, long long i) {
    P stored[PER_LANE];
    G g[PER_LANE];
    unsigned char mc[PER_LANE], vc[PER_LANE];
    load_lane(t.param, i, t.numel, VECTOR, stored);
    load_lane(t.grad, i, t.numel, VECTOR, g);
    load_lane(t.m_codes, i, t.numel, VECTOR, mc);
    load_lane(t.v_codes, i, t.numel, VECTOR, vc);
    const float m_scale = t.m_absmax[block], v_scale = t.v_absmax[block];
    float grads[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) grads[k] = to_acc(g[k]);
    if (grad_scale != 1.0f) {  // the same for the whole launch
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) grads[k] = grads[k] / grad_scale;
    }
    float p[PER_LANE], m[PER_LANE], v[PER_LANE], m_max = 0.0f, v_max = 0.0f;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      acc_t x[4] = {to_acc(stored[k]), grads[k], maps.value[0][mc[k]] * m_scale,
                    maps.value[1][vc[k]] * v_scale};
      op(x);
      p[k] = x[PARAM];
      m[k] = x[EXP_AVG];
      v[k] = x[EXP_AVG_SQ];
      if (VECTOR || i + k < t.numel) {  // elements past the tensor's end weigh nothing in the maxima
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
    if (m_inverse > 3.40282347e38f || v_inverse > 3.40282347e38f) {
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        m[k] = m_inverse > 3.40282347e38f ? m[k] / m_max : m[k] * m_inverse;
        v[k] = v_inverse > 3.40282347e38f ? v[k] / v_max : v[k] * v_inverse;
      }
    } else {
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        m[k] *= m_inverse;
        v[k] *= v_inverse;
      }
    }
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      mc[k] = nearest_code<SIGNED_STEPS, true>(maps.signed_guide, maps.mid[0], m[k]);
      vc[k] = nearest_code<UNSIGNED_STEPS, false>(maps.unsigned_guide, maps.mid[1], v[k]);
    }
    store_params(t.param, i, t.numel, VECTOR, p, op);
    store_lane(t.m_codes, i, t.numel, VECTOR, mc);
    store_lane(t.v_codes, i, t.numel, VECTOR, vc);
    if (i % QBLOCK == 0) {  // lane 0
      t.m_absmax[block] = m_max;
      t.v_absmax[block] = v_max;
    }
  }
};

}  // namespace mta
