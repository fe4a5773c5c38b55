// Adam on the CPU: one piece of whole blocks of 8-bit moments stepped in place
// (mtapply._cpu_eight_bit), or one piece of float32 moments (mtapply._cpu_adam), the same
// arithmetic (adam_element) in both.
//
// Each block's moments are dequantized, stepped with reference.adam_into's float32 operations
// in its order (built with -ffp-contract=off: no fused multiply-adds), and quantized again as
// mtapply._blockwise_into quantizes them. The results are the NumPy path's, bit for bit.
// A block whose new moments hold a NaN or an infinity, or whose absmax has an infinite
// reciprocal, is left to Python (quantization.quantize_blockwise): its values are spilled.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 256;
constexpr uint32_t MAGNITUDE = 0x7FFFFFFFu;
constexpr uint32_t INFINITY_BITS = 0x7F800000u;

// The scalars as reference.adam_into makes them, in float32 (see _cpu_eight_bit._adam_scalars).
struct Hyper {
  float decay, weight_decay, w, keep, one_minus_beta2, beta2, bias2, eps, neg_step;
};

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// One element of Adam: reference.adam_into's float32 operations in its order. DECAY: 0 none,
// 1 decoupled (p * (1 - lr * wd)), 2 L2 (g + wd * p). m0 and v0: the moments on entry.
template <bool MAXIMIZE, int DECAY, bool SMALL_W>
inline void adam_element(float& p, float g, float m0, float v0, const Hyper& h, float& m,
                         float& v) {
  // negated as a sign flip of the bits: -g + x folded into x - g would lose a NaN's sign
  float grad = MAXIMIZE ? float_of(bits_of(g) ^ 0x80000000u) : g;
  float param = p;
  if (DECAY == 1) param = param * h.decay;
  if (DECAY == 2) grad = grad + h.weight_decay * param;
  float t = grad - m0;
  float m1;
  if (SMALL_W) {
    t = t * h.w;
    m1 = m0 + t;
  } else {
    t = t * h.keep;
    m1 = grad - t;
  }
  float u = h.one_minus_beta2 * grad;
  u = u * grad;
  float v1 = v0 * h.beta2;
  v1 = v1 + u;
  float denom = std::sqrt(v1);
  denom = denom / h.bias2;
  denom = denom + h.eps;
  float ratio = m1 / denom;
  ratio = ratio * h.neg_step;
  p = param + ratio;
  m = m1;
  v = v1;
}

// m and v hold the moments' map values on entry (looked up apart: the arithmetic then
// vectorizes), scaled here by the block's absmax.
template <bool MAXIMIZE, int DECAY, bool SMALL_W>
void adam_block(float* __restrict p, const float* __restrict g, float ms, float vs, int64_t n,
                const Hyper& h, float* __restrict m, float* __restrict v) {
  for (int64_t i = 0; i < n; ++i) {
    adam_element<MAXIMIZE, DECAY, SMALL_W>(p[i], g[i], m[i] * ms, v[i] * vs, h, m[i], v[i]);
  }
}

// float32 moments, stepped in place.
template <bool MAXIMIZE, int DECAY, bool SMALL_W>
void adam_floats(float* __restrict p, const float* __restrict g, float* __restrict m,
                 float* __restrict v, int64_t n, const Hyper& h) {
  for (int64_t i = 0; i < n; ++i) {
    adam_element<MAXIMIZE, DECAY, SMALL_W>(p[i], g[i], m[i], v[i], h, m[i], v[i]);
  }
}

void look_up(const uint8_t* codes, int64_t n, const float* map, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = map[codes[i]];
}

// Codes and scale of one block; false (nothing written) where Python quantizes it instead.
bool quantize_block(const float* __restrict x, int64_t n, bool is_signed,
                    const uint32_t* words, uint8_t* __restrict codes, float* scale) {
  uint32_t top = 0;  // non-negative floats order as their bits
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_of(x[i]) & MAGNITUDE;
    top = b > top ? b : top;
  }
  if (top >= INFINITY_BITS) return false;
  const float absmax = float_of(top);
  const float inverse = top == 0 ? 0.0f : 1.0f / absmax;
  if (std::isinf(inverse)) return false;
  alignas(64) uint32_t keys[BLOCK];
  const uint32_t flip = is_signed ? 0xFFFFu : 0u;  // a negative value's low 16 bits flipped
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_of(x[i] * inverse);
    keys[i] = b ^ ((static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) >> 16) & flip);
  }
  for (int64_t i = 0; i < n; ++i) {  // the key's top 16 bits are the value's
    codes[i] = static_cast<uint8_t>((words[keys[i] >> 16] + keys[i]) >> 16);
  }
  *scale = absmax;
  return true;
}

struct Piece {
  float* p;
  const float* g;
  uint8_t* mc;
  float* ms;
  uint8_t* vc;
  float* vs;
  int64_t n;
};

struct Tables {
  const float* maps;  // the signed map's 256 values, then the unsigned map's
  const uint32_t* m_words;
  const uint32_t* v_words;
};

template <bool MAXIMIZE, int DECAY, bool SMALL_W>
int64_t step_piece(const Piece& a, const Tables& t, const Hyper& h, float* m_spill,
                   float* v_spill, uint8_t* bad) {
  alignas(64) float m[BLOCK];
  alignas(64) float v[BLOCK];
  int64_t n_bad = 0;
  for (int64_t start = 0, b = 0; start < a.n; start += BLOCK, ++b) {
    const int64_t n = a.n - start < BLOCK ? a.n - start : BLOCK;
    look_up(a.mc + start, n, t.maps, m);
    look_up(a.vc + start, n, t.maps + 256, v);
    adam_block<MAXIMIZE, DECAY, SMALL_W>(a.p + start, a.g + start, a.ms[b], a.vs[b], n, h, m, v);
    uint8_t flag = 0;
    if (!quantize_block(m, n, true, t.m_words, a.mc + start, a.ms + b)) {
      std::memcpy(m_spill + start, m, n * sizeof(float));
      flag |= 1;
    }
    if (!quantize_block(v, n, false, t.v_words, a.vc + start, a.vs + b)) {
      std::memcpy(v_spill + start, v, n * sizeof(float));
      flag |= 2;
    }
    bad[b] = flag;
    n_bad += flag != 0;
  }
  return n_bad;
}

using Stepper = int64_t (*)(const Piece&, const Tables&, const Hyper&, float*, float*, uint8_t*);
using FloatStepper = void (*)(float*, const float*, float*, float*, int64_t, const Hyper&);

// The instance of Pick's function (step_piece or adam_floats) for a variant: bit 0 maximize,
// bits 1-2 the decay (0 none, 1 decoupled, 2 L2), bit 3 (1 - beta1) < 0.5.
template <template <bool, int, bool> class Pick, bool MAXIMIZE, int DECAY>
auto pick_w(bool small_w) {
  return small_w ? Pick<MAXIMIZE, DECAY, true>::get() : Pick<MAXIMIZE, DECAY, false>::get();
}

template <template <bool, int, bool> class Pick, bool MAXIMIZE>
auto pick_decay(int decay, bool small_w) {
  if (decay == 1) return pick_w<Pick, MAXIMIZE, 1>(small_w);
  if (decay == 2) return pick_w<Pick, MAXIMIZE, 2>(small_w);
  return pick_w<Pick, MAXIMIZE, 0>(small_w);
}

template <template <bool, int, bool> class Pick>
auto pick(int32_t variant) {
  const int decay = (variant >> 1) & 3;
  const bool small_w = (variant >> 3) & 1;
  return (variant & 1) ? pick_decay<Pick, true>(decay, small_w)
                       : pick_decay<Pick, false>(decay, small_w);
}

template <bool MAXIMIZE, int DECAY, bool SMALL_W>
struct EightBit {
  static Stepper get() { return step_piece<MAXIMIZE, DECAY, SMALL_W>; }
};

template <bool MAXIMIZE, int DECAY, bool SMALL_W>
struct Floats {
  static FloatStepper get() { return adam_floats<MAXIMIZE, DECAY, SMALL_W>; }
};

}  // namespace

// Steps one piece of n elements (whole blocks from its start) in place. variant: bit 0
// maximize, bits 1-2 the decay (0 none, 1 decoupled, 2 L2), bit 3 (1 - beta1) < 0.5.
// hyper: Hyper's nine float32s. Returns the number of blocks left to Python: bad[b] has bit 0
// (first moment) or bit 1 (second) set, and the spills hold those blocks' new float values.
extern "C" int64_t mtapply_adam8bit_piece(float* p, const float* g, uint8_t* m_codes,
                                          float* m_scales, uint8_t* v_codes, float* v_scales,
                                          int64_t n, const float* maps, const uint32_t* m_words,
                                          const uint32_t* v_words, const float* hyper,
                                          int32_t variant, float* m_spill, float* v_spill,
                                          uint8_t* bad) {
  Hyper h;
  std::memcpy(&h, hyper, sizeof(Hyper));
  const Piece a{p, g, m_codes, m_scales, v_codes, v_scales, n};
  const Tables t{maps, m_words, v_words};
  return pick<EightBit>(variant)(a, t, h, m_spill, v_spill, bad);
}

// Steps n elements of float32 Adam in place: param, grad and the moments, each dense and none
// overlapping another; hyper and variant as mtapply_adam8bit_piece takes them.
extern "C" void mtapply_adam_piece(float* p, const float* g, float* m, float* v, int64_t n,
                                   const float* hyper, int32_t variant) {
  Hyper h;
  std::memcpy(&h, hyper, sizeof(Hyper));
  pick<Floats>(variant)(p, g, m, v, n, h);
}
