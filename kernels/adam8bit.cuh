// Adam / AdamW with 8-bit blockwise-quantized moments (mtapply/quantization.py defines the format).
//
// Slots: params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax (params and
// grads float32 or 16-bit; bfloat16 params may be rounded stochastically). A group whose
// moments are uint8 codes runs Adam8bit: each warp takes whole blocks of QBLOCK elements (a chunk
// holds MTA_CHUNK / QBLOCK of them, so no block straddles chunks or tensors), dequantizes both
// moments with the block's scale, applies the Adam functor in registers, takes the block's fresh
// absolute maxima across the warp and stores the moments as the nearest codes of the dynamic
// maps. A group whose moments are float32 (small tensors) runs the plain Adam functor.
// The map values and the code tables (mtapply.quantization.code_words: one table read and one
// addition find a code) come from the generated dynamic_maps.cuh; each CUDA block loads them
// into shared memory once for a chunk of many quantization blocks (Adam8bitSpec.chunk_for), with
// the chunk's block scales (ChunkScales), and the 8-bit group compiles with approximate fp32
// division and square root (Adam8bitSpec.compile_options). The step then runs at the speed of
// its loads and stores.
#pragma once
#include "adam.cuh"
#include "dynamic_maps.cuh"

namespace mta {

constexpr int QBLOCK = 256;            // elements per quantization block
constexpr int PER_LANE = QBLOCK / 32;   // elements each lane of a warp holds, in two groups:
constexpr int GROUP = PER_LANE / 2;     // consecutive elements, the second group HALF after
constexpr int HALF = QBLOCK / 2;        // the first, so that each load or store of the warp
                                        // covers a contiguous half-block (whole sectors)
static_assert(MTA_CHUNK % QBLOCK == 0, "a chunk must hold whole quantization blocks");

constexpr int WORDS_TOTAL = 3 * CODE_CELLS;  // the signed map's cells of both signs, then the unsigned's

struct __align__(16) Maps {  // copied in 16-byte words
  float value[2][256];  // [signed, unsigned] map values, ascending
  unsigned words[(WORDS_TOTAL + 3) / 4 * 4];

  __device__ void load() {
    copy(&value[0][0], SIGNED_MAP, 256);
    copy(&value[1][0], UNSIGNED_MAP, 256);
    copy(words, CODE_WORDS, WORDS_TOTAL);
    __syncthreads();
  }

  // 16-byte words, four in flight per thread (the tables are some 37 kB)
  template <class T>
  static __device__ void copy(T* to, const T* from, int count) {
    const int n = (count * int(sizeof(T)) + 15) / 16;
    uint4* dst = reinterpret_cast<uint4*>(to);
    const uint4* src = reinterpret_cast<const uint4*>(from);
    for (int i = threadIdx.x; i < n; i += 4 * MTA_BLOCK) {
      uint4 w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i + j * MTA_BLOCK < n) w[j] = src[i + j * MTA_BLOCK];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (i + j * MTA_BLOCK < n) dst[i + j * MTA_BLOCK] = w[j];
    }
  }
};

// Bits 16-23 of the result are the code of x (the index of the nearest map value, ties to the
// lower one): x's cell word plus x's bits, as quantization.guided_code. |x| <= 1 + 2**-7 and a
// NaN reads the lowest cell (the block then takes its NaN codes from poison_codes).
template <bool SIGNED>
__device__ __forceinline__ unsigned code_sum(const unsigned* words, float x) {
  if (SIGNED) {
    const unsigned bits = __float_as_uint(fmaxf(fabsf(x), CELL_FLOOR));
    const unsigned negative = static_cast<unsigned>(__float_as_int(x) >> 31);  // all ones or zero
    return words[(negative & CODE_CELLS) + (bits >> 16) - CELL_LOW] + (bits ^ (negative & 0x7fffffffu));
  }
  const unsigned bits = __float_as_uint(fmaxf(x, CELL_FLOOR));  // second moments: x >= 0
  return words[2 * CODE_CELLS + (bits >> 16) - CELL_LOW] + bits;
}

// The maximum of a and b, NaN if either is (as NumPy's max), so that a NaN marks its block.
__device__ __forceinline__ float max_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// The codes in bits 16-23 of four sums, as the bytes of one word.
__device__ __forceinline__ unsigned pack_codes(const unsigned* sums) {
  return __byte_perm(__byte_perm(sums[0], sums[1], 0x0062), __byte_perm(sums[2], sums[3], 0x0062),
                     0x5410);
}

// The index of a lane's k-th element, the lane's first being i.
__device__ __forceinline__ long long element(long long i, int k) { return i + (k / GROUP) * HALF + k % GROUP; }

// A group of GROUP elements moves as one word: 16 bytes (floats), 8 (16-bit) or 4 (codes).
template <int BYTES> struct WordOf { typedef uint4 type; };
template <> struct WordOf<8> { typedef unsigned long long type; };
template <> struct WordOf<4> { typedef unsigned type; };

// Loads the lane's PER_LANE elements of type T: whole words when `vector`, else those below numel.
template <class T>
__device__ __forceinline__ void load_lane(const T* base, long long i, long long numel, bool vector,
                                          T (&out)[PER_LANE]) {
  typedef typename WordOf<GROUP * sizeof(T)>::type Word;
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      union { Word word; T vals[GROUP]; } u;
      u.word = *reinterpret_cast<const Word*>(base + i + h * HALF);
#pragma unroll
      for (int k = 0; k < GROUP; ++k) out[h * GROUP + k] = u.vals[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) out[k] = element(i, k) < numel ? base[element(i, k)] : T{};
  }
}

template <class T>
__device__ __forceinline__ void store_lane(T* base, long long i, long long numel, bool vector,
                                           const T (&in)[PER_LANE]) {
  typedef typename WordOf<GROUP * sizeof(T)>::type Word;
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      union { Word word; T vals[GROUP]; } u;
#pragma unroll
      for (int k = 0; k < GROUP; ++k) u.vals[k] = in[h * GROUP + k];
      *reinterpret_cast<Word*>(base + i + h * HALF) = u.word;
    }
  } else {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k)
      if (element(i, k) < numel) base[element(i, k)] = in[k];
  }
}

// The lane's new params, rounded to their storage: to nearest, or stochastically.
template <class P>
__device__ __forceinline__ void store_params(P* param, long long i, long long numel, bool vector,
                                             const float (&p)[PER_LANE], const Adam& op) {
#if MTA_STOCHASTIC
  char* base = reinterpret_cast<char*>(param);
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float group[GROUP] = {p[h * GROUP], p[h * GROUP + 1], p[h * GROUP + 2], p[h * GROUP + 3]};
      store_bf16_stochastic<GROUP>(base, i + h * HALF, group, op.rounding);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < PER_LANE; ++k) {
    const float one[1] = {p[k]};
    if (element(i, k) < numel) store_bf16_stochastic<1>(base, element(i, k), one, op.rounding);
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

// A chunk's block scales, staged in shared memory: the CUDA block reads and writes them in whole
// lines, not four bytes at a time per warp (which cost some 15% of a step).
struct ChunkScales {
  float m[MTA_CHUNK / QBLOCK], v[MTA_CHUNK / QBLOCK];

  template <class P, class G>
  __device__ void load(const Tensor8bit<P, G>& t, const Chunk& job) {
    const long long first = job.begin / QBLOCK;
    for (int b = threadIdx.x; b < blocks(job); b += MTA_BLOCK) {
      m[b] = t.m_absmax[first + b];
      v[b] = t.v_absmax[first + b];
    }
  }

  template <class P, class G>
  __device__ void store(const Tensor8bit<P, G>& t, const Chunk& job) const {
    __syncthreads();
    const long long first = job.begin / QBLOCK;
    for (int b = threadIdx.x; b < blocks(job); b += MTA_BLOCK) {
      t.m_absmax[first + b] = m[b];
      t.v_absmax[first + b] = v[b];
    }
  }

  static __device__ int blocks(const Chunk& job) { return static_cast<int>((job.end - job.begin + QBLOCK - 1) / QBLOCK); }
};

struct Adam8bit {
  static constexpr bool OWN_WALK = true;
  static constexpr int MIN_BLOCKS = 4;  // per SM: caps registers at 64 (occupancy over spills)
  using Args = AdamArgs;
  enum Slot { PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_ABSMAX, EXP_AVG_SQ_ABSMAX };

  static __device__ void walk(const Launch<Args>& launch) {
    __shared__ Maps maps;
    __shared__ ChunkScales scales;
    const Chunk job = chunk_of(launch);
    typedef typename SlotType<PARAM>::type P;  // float, or 16-bit params (stochastic rounding)
    typedef typename SlotType<GRAD>::type G;
    const Tensor8bit<P, G> t{reinterpret_cast<P*>(job.addresses[PARAM]),
                             reinterpret_cast<const G*>(job.addresses[GRAD]),
                             reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG]),
                             reinterpret_cast<unsigned char*>(job.addresses[EXP_AVG_SQ]),
                             reinterpret_cast<float*>(job.addresses[EXP_AVG_ABSMAX]),
                             reinterpret_cast<float*>(job.addresses[EXP_AVG_SQ_ABSMAX]), job.numel};
    scales.load(t, job);
    maps.load();  // then synchronizes
    const float grad_scale = float(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
    // words of codes and of params and grads (GROUP elements each), when every base allows them;
    // blocks from `whole` on are cut by the tensor's end (or unaligned) and go element by element
    const bool aligned = (((job.addresses[PARAM] | job.addresses[GRAD]) & 15) |
                          ((job.addresses[EXP_AVG] | job.addresses[EXP_AVG_SQ]) & 7)) == 0;
    const long long whole = aligned ? min(job.end, job.numel / QBLOCK * QBLOCK) : job.begin;
    const Adam op(args_of(launch, job.tensor), job.tensor, nullptr);
    const int warp = threadIdx.x / 32;
    constexpr long long STRIDE = (MTA_BLOCK / 32) * QBLOCK;  // a warp's step through the chunk
    long long start = job.begin + static_cast<long long>(warp) * QBLOCK;
    for (; start < whole; start += STRIDE)
      update_block(maps, scales, op, grad_scale, t, load_block<true>(t, scales, start, job.begin));
    for (; start < job.end; start += STRIDE)
      update_block(maps, scales, op, grad_scale, t, load_block<false>(t, scales, start, job.begin));
    scales.store(t, job);
  }

  // A quantization block as a lane holds it: its PER_LANE elements from `i`, the block's scales.
  // VECTOR: the whole block lies in the tensor and moves in words.
  template <bool VECTOR, class P, class G>
  struct Block {
    long long i;
    int local;  // the block's index in the chunk
    P param[PER_LANE];
    G grad[PER_LANE];
    unsigned char m[PER_LANE], v[PER_LANE];
    float m_scale, v_scale;
  };

  template <bool VECTOR, class P, class G>
  static __device__ __forceinline__ Block<VECTOR, P, G> load_block(const Tensor8bit<P, G>& t,
                                                                    const ChunkScales& scales,
                                                                    long long start, long long begin) {
    Block<VECTOR, P, G> b;
    b.i = start + (threadIdx.x % 32) * GROUP;
    b.local = static_cast<int>((start - begin) / QBLOCK);
    load_lane(t.param, b.i, t.numel, VECTOR, b.param);
    load_lane(t.grad, b.i, t.numel, VECTOR, b.grad);
    load_lane(t.m_codes, b.i, t.numel, VECTOR, b.m);
    load_lane(t.v_codes, b.i, t.numel, VECTOR, b.v);
    b.m_scale = scales.m[b.local];
    b.v_scale = scales.v[b.local];
    return b;
  }

  // A block holding a NaN: its absmax is NaN, its other values scaled to zero, and a NaN's
  // code is 255 (NaN sorts last), as in quantization.quantize_blockwise.
  static __device__ __forceinline__ void poison_codes(const float (&m)[PER_LANE], const float (&v)[PER_LANE],
                                                   unsigned (&m_sums)[PER_LANE], unsigned (&v_sums)[PER_LANE]) {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      if (m[k] != m[k]) m_sums[k] = 255u << 16;
      if (v[k] != v[k]) v_sums[k] = 255u << 16;
    }
  }

  // One quantization block, a warp's: Adam on the loaded block, its fresh scales and codes.
  template <bool VECTOR, class P, class G>
  static __device__ __forceinline__ void update_block(const Maps& maps, ChunkScales& scales, const Adam& op,
                                                      float grad_scale,
                                                      const Tensor8bit<P, G>& t, const Block<VECTOR, P, G>& b) {
    const long long i = b.i;
    float grads[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) grads[k] = to_acc(b.grad[k]);
    if (grad_scale != 1.0f) {  // the same for the whole launch
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) grads[k] = grads[k] / grad_scale;
    }
    float p[PER_LANE], m[PER_LANE], v[PER_LANE], m_max = 0.0f, v_max = 0.0f;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      acc_t x[4] = {to_acc(b.param[k]), grads[k], maps.value[0][b.m[k]] * b.m_scale,
                    maps.value[1][b.v[k]] * b.v_scale};
      op(x);
      p[k] = x[PARAM];
      m[k] = x[EXP_AVG];
      v[k] = x[EXP_AVG_SQ];
      if (VECTOR || element(i, k) < t.numel) {  // elements past the tensor's end weigh nothing in the maxima
        m_max = max_nan(m_max, fabsf(m[k]));
        v_max = max_nan(v_max, fabsf(v[k]));
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
    unsigned m_sums[PER_LANE], v_sums[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      m_sums[k] = code_sum<true>(maps.words, m[k]);
      v_sums[k] = code_sum<false>(maps.words, v[k]);
    }
    if (m_max != m_max || v_max != v_max) poison_codes(m, v, m_sums, v_sums);  // the whole warp
    store_params(t.param, i, t.numel, VECTOR, p, op);
    if (VECTOR) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<unsigned*>(t.m_codes + i + h * HALF) = pack_codes(m_sums + h * GROUP);
        *reinterpret_cast<unsigned*>(t.v_codes + i + h * HALF) = pack_codes(v_sums + h * GROUP);
      }
    } else {
      unsigned char mc[PER_LANE], vc[PER_LANE];
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) {
        mc[k] = static_cast<unsigned char>(m_sums[k] >> 16);
        vc[k] = static_cast<unsigned char>(v_sums[k] >> 16);
      }
      store_lane(t.m_codes, i, t.numel, false, mc);
      store_lane(t.v_codes, i, t.numel, false, vc);
    }
    // Every lane read this block's old scales in load_block; lane 0 overwrites them. The
    // maxima's shuffles already order the two, but only a warp barrier says so to racecheck.
    __syncwarp();
    if (i % QBLOCK == 0) {  // lane 0
      scales.m[b.local] = m_max;
      scales.v[b.local] = v_max;
    }
  }
};

}  // namespace mta
