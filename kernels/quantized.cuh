// 8-bit blockwise states for any op (mtapply/quantization.py defines the format): the op's
// functor runs unchanged; Quantized<Op, QUANTIZED, UNSIGNED> walks its memory instead of the
// chunk walker. Slot s of the op is kept as uint8 codes where bit s of QUANTIZED is set (on the
// unsigned map where bit s of UNSIGNED is set too: values >= 0, as second moments), with one
// float32 scale (absmax) per block of QBLOCK elements in the record's slot N_SLOTS + k for the
// k-th such slot. Each warp takes whole blocks of QBLOCK elements (a chunk holds MTA_CHUNK / QBLOCK
// of them, so no block straddles chunks or tensors), dequantizes the 8-bit slots with the
// block's scales, applies the functor in registers, takes the block's fresh absolute maxima
// across the warp and stores the 8-bit slots as the nearest codes of the dynamic maps.
// The map values and the code tables (mtapply.quantization.code_words: one table read and one
// addition find a code) come from the generated dynamic_maps.cuh; each CUDA block loads them
// into shared memory once for a chunk of many quantization blocks (see chunk_for of the specs),
// with the chunk's block scales (ChunkScales). A step then runs at the speed of its loads and
// stores. Groups of tensors too small for 8-bit states run the op on the chunk walker. A pass
// that sums (a rule's first pass, e.g. LAMB's norms) walks the same blocks, dequantizing the
// 8-bit slots as the update will, and writes nothing but its sums. An INDEXED op (factored
// state, walker.cuh) is made with the chunk and given each element's index, as the chunk walker
// gives them; the slots its tensor lacks (`absent`) are neither loaded nor stored. Its factored
// slots are never 8-bit (Rule.with_state_bits refuses them), so an absent slot holds floats.
#pragma once
#include "walker.cuh"
#include "dynamic_maps.cuh"

namespace mta {

constexpr int QBLOCK = 256;            // elements per quantization block
constexpr int PER_LANE = QBLOCK / 32;   // elements each lane of a warp holds, in two groups:
constexpr int GROUP = PER_LANE / 2;     // consecutive elements, the second group HALF after
constexpr int HALF = QBLOCK / 2;        // the first, so that each load or store of the warp
                                        // covers a contiguous half-block (whole sectors)

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
// lower one): x's cell word plus x's bits, as quantization.guided_code. |x| <= 1 + 2**-7 (the
// walk stores non-finite values as zero before they get here).
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
template <class T> struct GroupWord {
  typedef typename WordOf<GROUP * sizeof(T)>::type type;
  static_assert(sizeof(type) == GROUP * sizeof(T), "one word holds a group of the lane's elements");
};

// Loads the lane's PER_LANE elements of type T: whole words when `vector`, else those below numel.
template <class T>
__device__ __forceinline__ void load_lane(const T* base, long long i, long long numel, bool vector,
                                          T (&out)[PER_LANE]) {
  typedef typename GroupWord<T>::type Word;
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

// One store instruction per word: a plain store of the union may be split into one per element
// (the compiler stores each value as soon as the op has it), four times the store instructions.
// An asm without outputs is volatile (never dropped); no "memory" clobber, so that loads of the
// next blocks may move above it: no thread reads an address it stored to.
__device__ __forceinline__ void store_word(uint4* to, uint4 w) {
  asm("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(to), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w));
}
__device__ __forceinline__ void store_word(unsigned long long* to, unsigned long long w) {
  asm("st.global.u64 [%0], %1;" ::"l"(to), "l"(w));
}
__device__ __forceinline__ void store_word(unsigned* to, unsigned w) {
  asm("st.global.u32 [%0], %1;" ::"l"(to), "r"(w));
}

template <class T>
__device__ __forceinline__ void store_lane(T* base, long long i, long long numel, bool vector,
                                           const T (&in)[PER_LANE]) {
  typedef typename GroupWord<T>::type Word;
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      union { Word word; T vals[GROUP]; } u;
#pragma unroll
      for (int k = 0; k < GROUP; ++k) u.vals[k] = in[h * GROUP + k];
      store_word(reinterpret_cast<Word*>(base + i + h * HALF), u.word);
    }
  } else {
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k)
      if (element(i, k) < numel) base[element(i, k)] = in[k];
  }
}

// The lane's new params, rounded to their storage: to nearest, or stochastically.
template <class P, class Op>
__device__ __forceinline__ void store_params(P* param, long long i, long long numel, bool vector,
                                             const float (&p)[PER_LANE], const Op& op) {
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


__host__ __device__ constexpr int bits_set(unsigned mask) { return mask ? int(mask & 1u) + bits_set(mask >> 1) : 0; }
__host__ __device__ constexpr int bits_below(unsigned mask, int s) { return bits_set(mask & ((1u << s) - 1u)); }

// A lane's PER_LANE elements of each slot S..N-1, in their storage types (codes for 8-bit slots).
template <int S, int N> struct LaneSlots {
  typename SlotType<S>::type value[PER_LANE];
  LaneSlots<S + 1, N> rest;
};
template <int N> struct LaneSlots<N, N> {};

template <int S, int T, int N>
__device__ __forceinline__ auto& lane_slot(LaneSlots<T, N>& lanes) {
  if constexpr (S == T) return lanes.value;
  else return lane_slot<S>(lanes.rest);
}
template <int S, int T, int N>
__device__ __forceinline__ const auto& lane_slot(const LaneSlots<T, N>& lanes) {
  if constexpr (S == T) return lanes.value;
  else return lane_slot<S>(lanes.rest);
}

// A chunk's block scales of each 8-bit slot, staged in shared memory: the CUDA block reads and
// writes them in whole lines, not four bytes at a time per warp (which cost some 15% of a step).
template <int NQ>
struct ChunkScales {
  float scale[NQ][MTA_CHUNK / QBLOCK];

  template <int FIRST_SLOT>
  __device__ void load(const Chunk& job) {
    const long long first = job.begin / QBLOCK;
    for (int b = threadIdx.x; b < blocks(job); b += MTA_BLOCK) {
#pragma unroll
      for (int q = 0; q < NQ; ++q) scale[q][b] = reinterpret_cast<const float*>(job.addresses[FIRST_SLOT + q])[first + b];
    }
  }

  template <int FIRST_SLOT>
  __device__ void store(const Chunk& job) const {
    __syncthreads();
    const long long first = job.begin / QBLOCK;
    for (int b = threadIdx.x; b < blocks(job); b += MTA_BLOCK) {
#pragma unroll
      for (int q = 0; q < NQ; ++q) reinterpret_cast<float*>(job.addresses[FIRST_SLOT + q])[first + b] = scale[q][b];
    }
  }

  static __device__ int blocks(const Chunk& job) { return static_cast<int>((job.end - job.begin + QBLOCK - 1) / QBLOCK); }
};

template <class Op, unsigned QUANTIZED, unsigned UNSIGNED>
struct Quantized {
  static constexpr bool OWN_WALK = true;
  // per SM: caps registers at 64 (occupancy over spills); 80 for an indexed op, as on the chunk
  // walker (its shape, dividers and row and column pointers take some 30 registers: it used
  // about 115 uncapped, spilled some 600 bytes a thread at 64 and about 130 at 80)
  static constexpr int MIN_BLOCKS = Indexed<Op>::value ? 3 : 4;
  static constexpr int N = Op::N_SLOTS;
  static constexpr int NQ = bits_set(QUANTIZED);
  // the param is not read where it is taken as zero (the op then writes its update to slot 0)
  static constexpr unsigned READ = loaded_slots<Op>();
  static constexpr int UPDATES = N + NQ;  // with MTA_DELTA: the record's slot for new - old
  using Args = typename Op::Args;
  // a pass that sums (a rule's first pass) reads the 8-bit slots and writes nothing
  static constexpr bool SUMS = Op::N_SUMS > 0;
  static_assert(NQ > 0 && (QUANTIZED >> N) == 0u && (UNSIGNED & ~QUANTIZED) == 0u, "8-bit slots are the op's");
  static_assert((QUANTIZED & 1u) == 0u && (Op::GRAD < 0 || ((QUANTIZED >> Op::GRAD) & 1u) == 0u),
                "params and grads keep their own dtypes");
  static_assert(SUMS ? Op::WRITTEN == 0u : (QUANTIZED & ~Op::WRITTEN) == 0u,
                "an update writes its 8-bit slots (their scales are fresh); a summing pass writes nothing");
  static_assert(MTA_SLOTS == N + NQ + (MTA_DELTA ? 1 : 0),
                "a record holds the op's slots, one scale slot per 8-bit slot, then any updates");
  static_assert(!MTA_MASTER, "8-bit states step float32 or 16-bit params themselves");
  static_assert(!MTA_DELTA || (READ & 1u) != 0u, "updates are new - old params: the params are read");
  static_assert(MTA_CHUNK % QBLOCK == 0, "a chunk must hold whole quantization blocks");

  template <int S> __host__ __device__ static constexpr bool eight_bit() { return ((QUANTIZED >> S) & 1u) != 0u; }
  template <int S> __host__ __device__ static constexpr bool written() { return ((Op::WRITTEN >> S) & 1u) != 0u; }

  static __device__ void walk(const Launch<Args>& launch) {
    __shared__ Maps maps;
    __shared__ ChunkScales<NQ> scales;
    // the record's addresses staged in shared memory: read from the table they were read again
    // for every block (the stores between might alias it), and held in registers they spilled
    __shared__ long long bases[MTA_SLOTS];
    const Chunk record = chunk_of(launch);
    if (threadIdx.x < MTA_SLOTS) bases[threadIdx.x] = record.addresses[threadIdx.x];
    scales.template load<N>(record);
    maps.load();  // then synchronizes
    const Chunk job{record.tensor, record.index, record.numel, record.begin, record.end, bases};
    const float grad_scale = float(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
    const int blocks = ChunkScales<NQ>::blocks(job);
    if constexpr (Indexed<Op>::value) {  // (the same branch in every thread of the block)
      const Op op = make_op<Op>(launch, job);
      const int whole = whole_blocks(job, op.absent);
      if (op.narrow) walk_blocks<unsigned>(launch, maps, scales, op, grad_scale, job, whole, blocks);
      else walk_blocks<long long>(launch, maps, scales, op, grad_scale, job, whole, blocks);
    } else {
      const int whole = whole_blocks(job, 0u);
      const Op op(args_of(launch, job.tensor), job.tensor, launch.sums);  // (an earlier pass's)
      walk_blocks<long long>(launch, maps, scales, op, grad_scale, job, whole, blocks);
    }
  }

  // The chunk's blocks that go in whole words of every slot (GROUP elements each), where every
  // base allows them; blocks from there on are cut by the tensor's end (or unaligned) and go
  // element by element.
  static __device__ __forceinline__ int whole_blocks(const Chunk& job, unsigned absent) {
    const bool aligned = bases_aligned<0>(job, absent) && updates_aligned(job);
    return aligned ? static_cast<int>((min(job.end, job.numel / QBLOCK * QBLOCK) - job.begin) / QBLOCK) : 0;
  }

  // The chunk's quantization blocks: each warp takes every WARPS-th block of the chunk, counted
  // by its index there (a 32-bit counter: a 64-bit one spilled to local memory). An indexed op
  // gets each element's index as an Index (unused by other ops).
  template <class Index>
  static __device__ __forceinline__ void walk_blocks(const Launch<Args>& launch, const Maps& maps,
                                                     ChunkScales<NQ>& scales, const Op& op,
                                                     float grad_scale, const Chunk& job, int whole,
                                                     int blocks) {
    constexpr int WARPS = MTA_BLOCK / 32;
    int local = threadIdx.x / 32;
    if constexpr (SUMS) {
      sum_t acc[SUMS ? Op::N_SUMS : 1] = {};
      if (!sums_taken(op, job, acc)) {
        for (; local < whole; local += WARPS) sum_block<true, Index>(maps, scales, op, grad_scale, job, local, acc);
        for (; local < blocks; local += WARPS) sum_block<false, Index>(maps, scales, op, grad_scale, job, local, acc);
      }
      finish_sums<Op>(launch, acc, blockIdx.x, job.tensor, job.index, job.numel);
    } else {
      for (; local < whole; local += WARPS) update_block<true, Index>(maps, scales, op, grad_scale, job, local);
      for (; local < blocks; local += WARPS) update_block<false, Index>(maps, scales, op, grad_scale, job, local);
      scales.template store<N>(job);
    }
  }

  // An indexed op reads its element's row and column state: an element past the tensor's end
  // (computed with zeros, never stored) takes the last element's index, not one past the vectors.
  template <bool VECTOR>
  static __device__ __forceinline__ long long within(long long index, long long numel) {
    if constexpr (VECTOR || !Indexed<Op>::value) return ((void)numel, index);
    else return min(index, numel - 1);
  }

  // The op on one element's values x (the lane's element at `index`), adding to acc where it sums.
  template <class Index>
  static __device__ __forceinline__ void apply(const Op& op, acc_t (&x)[N], long long index) {
    if constexpr (Indexed<Op>::value) op(x, static_cast<Index>(index), static_cast<Index>(index));
    else op(x);
  }
  template <class Index>
  static __device__ __forceinline__ void apply(const Op& op, acc_t (&x)[N], sum_t (&acc)[SUMS ? Op::N_SUMS : 1],
                                               long long index) {
    if constexpr (Indexed<Op>::value) op(x, acc, static_cast<Index>(index), static_cast<Index>(index));
    else op(x, acc);
  }

  // Words of GROUP elements: 16 bytes of floats, 8 of 16-bit values, 4 of codes; only the
  // slots the walk loads or stores count (not an indexed op's row and column vectors, nor the
  // slots its tensor lacks).
  template <int S>
  static __device__ __forceinline__ bool bases_aligned(const Chunk& job, unsigned absent) {
    if constexpr (S == N) {
      return true;
    } else if constexpr ((((READ | Op::WRITTEN) >> S) & 1u) == 0u) {
      return bases_aligned<S + 1>(job, absent);
    } else {
      constexpr unsigned long long align = GROUP * sizeof(typename SlotType<S>::type) - 1;
      const bool aligned = (static_cast<unsigned long long>(job.addresses[S]) & align) == 0 || lacks<S>(absent);
      return aligned && bases_aligned<S + 1>(job, absent);
    }
  }

  // Whether the tensor lacks slot S (an indexed op's `absent`; no slot of other ops).
  template <int S>
  static __device__ __forceinline__ bool lacks(unsigned absent) {
    if constexpr (Indexed<Op>::value) return ((absent >> S) & 1u) != 0u;
    else return ((void)absent, false);
  }

  static __device__ __forceinline__ bool updates_aligned(const Chunk& job) {
#if MTA_DELTA
    return (static_cast<unsigned long long>(job.addresses[UPDATES]) & (GROUP * sizeof(last_t) - 1)) == 0;
#else
    (void)job;
    return true;
#endif
  }

  // The slots the op reads; those the tensor lacks are zero, as the chunk walker has them.
  template <int S, bool VECTOR>
  static __device__ __forceinline__ void load(const Chunk& job, long long i, unsigned absent,
                                              LaneSlots<0, N>& lanes) {
    if constexpr (S < N) {
      typedef typename SlotType<S>::type T;
      if constexpr (((READ >> S) & 1u) != 0u) {
        if (lacks<S>(absent)) {
#pragma unroll
          for (int k = 0; k < PER_LANE; ++k) lane_slot<S>(lanes)[k] = T{};
        } else {
          load_lane(reinterpret_cast<const T*>(job.addresses[S]), i, job.numel, VECTOR, lane_slot<S>(lanes));
        }
      }
      load<S + 1, VECTOR>(job, i, absent, lanes);
    }
  }

  // x[S..N-1] of the lane's k-th element: 8-bit slots dequantized with the block's scales.
  template <int S>
  static __device__ __forceinline__ void values(const Maps& maps, const LaneSlots<0, N>& lanes,
                                                const float (&scale)[NQ], int k, acc_t (&x)[N]) {
    if constexpr (S < N) {
      if constexpr (((READ >> S) & 1u) == 0u) {
        x[S] = acc_t(0);
      } else if constexpr (eight_bit<S>()) {
        constexpr int map = ((UNSIGNED >> S) & 1u) ? 1 : 0;
        x[S] = maps.value[map][lane_slot<S>(lanes)[k]] * scale[bits_below(QUANTIZED, S)];
      } else {
        x[S] = to_acc(lane_slot<S>(lanes)[k]);
      }
      values<S + 1>(maps, lanes, scale, k, x);
    }
  }

  // The sums of one quantization block, a warp's: the op on the block's elements (the 8-bit
  // slots dequantized as the update will read them), each adding its terms to the lane's acc.
  // Nothing is written, so every lane reads the block's scales.
  template <bool VECTOR, class Index>
  static __device__ __forceinline__ void sum_block(const Maps& maps, const ChunkScales<NQ>& scales, const Op& op,
                                                   float grad_scale, const Chunk& job, int local,
                                                   sum_t (&acc)[SUMS ? Op::N_SUMS : 1]) {
    const long long i = job.begin + local * QBLOCK + (threadIdx.x % 32) * GROUP;
    LaneSlots<0, N> lanes;
    load<0, VECTOR>(job, i, absent_slots(op), lanes);
    float scale[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) scale[q] = scales.scale[q][local];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      if (!VECTOR && element(i, k) >= job.numel) continue;
      acc_t x[N];
      values<0>(maps, lanes, scale, k, x);
      if constexpr (Op::GRAD >= 0) {
        if (grad_scale != 1.0f) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
      }
      apply<Index>(op, x, acc, element(i, k));
    }
  }

  // One quantization block, a warp's: the op on the block, its fresh scales and codes.
  template <bool VECTOR, class Index>
  static __device__ __forceinline__ void update_block(const Maps& maps, ChunkScales<NQ>& scales, const Op& op,
                                                      float grad_scale, const Chunk& job, int local) {
    const long long i = job.begin + local * QBLOCK + (threadIdx.x % 32) * GROUP;
    LaneSlots<0, N> lanes;
    load<0, VECTOR>(job, i, absent_slots(op), lanes);
    // The block's old scales: lane 0 reads them from shared memory and hands them to the other
    // lanes in registers, so that lane 0 alone touches this block's entries (it writes the
    // fresh scales below): no other thread reads them, and no barrier is needed (no other warp
    // takes this block; the CUDA block's barriers order the chunk's loads and stores of them).
    const bool first_lane = threadIdx.x % 32 == 0;
    float scale[NQ];
#pragma unroll
    for (int q = 0; q < NQ; ++q) scale[q] = __shfl_sync(0xffffffffu, first_lane ? scales.scale[q][local] : 0.0f, 0);
    acc_t out[N][PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      acc_t x[N];
      values<0>(maps, lanes, scale, k, x);
      if constexpr (Op::GRAD >= 0) {
        if (grad_scale != 1.0f) x[Op::GRAD] = x[Op::GRAD] / grad_scale;  // the same for the whole launch
      }
      apply<Index>(op, x, within<VECTOR>(element(i, k), job.numel));
#pragma unroll
      for (int s = 0; s < N; ++s) out[s][k] = x[s];
      finite_codes<0>(out, k);
    }
    // the blocks' fresh absolute maxima, the 8-bit slots' shuffles interleaved
    float fresh[NQ];
    lane_maxima<0, VECTOR>(job.numel, i, out, fresh);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int q = 0; q < NQ; ++q) fresh[q] = fmaxf(fresh[q], __shfl_xor_sync(0xffffffffu, fresh[q], offset));
    }
    store<0, VECTOR>(maps, op, job, i, lanes, out, fresh);
    if (first_lane) {
#pragma unroll
      for (int q = 0; q < NQ; ++q) scales.scale[q][local] = fresh[q];
    }
  }

  // A non-finite value of an 8-bit slot is stored as zero: codes hold no NaN or infinity, and
  // left in, it would set its block's scale and take the block's other 255 values with it.
  // The param takes the update as it is (non-finite, as torch.optim leaves it).
  template <int S>
  static __device__ __forceinline__ void finite_codes(acc_t (&out)[N][PER_LANE], int k) {
    if constexpr (S < N) {
      if constexpr (eight_bit<S>()) {
        if (!isfinite(out[S][k])) out[S][k] = 0.0f;
      }
      finite_codes<S + 1>(out, k);
    }
  }

  // The lane's largest |x| of each 8-bit slot; elements past the tensor's end weigh nothing.
  template <int S, bool VECTOR>
  static __device__ __forceinline__ void lane_maxima(long long numel, long long i, const acc_t (&out)[N][PER_LANE],
                                                     float (&top)[NQ]) {
    if constexpr (S < N) {
      if constexpr (eight_bit<S>()) {
        float m = 0.0f;
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k)
          if (VECTOR || element(i, k) < numel) m = fmaxf(m, fabsf(out[S][k]));
        top[bits_below(QUANTIZED, S)] = m;
      }
      lane_maxima<S + 1, VECTOR>(numel, i, out, top);
    }
  }

  template <int S, bool VECTOR>
  static __device__ __forceinline__ void store(const Maps& maps, const Op& op, const Chunk& job, long long i,
                                               const LaneSlots<0, N>& lanes, acc_t (&out)[N][PER_LANE],
                                               const float (&fresh)[NQ]) {
    if constexpr (S < N) {
      typedef typename SlotType<S>::type T;
      if constexpr (written<S>() && eight_bit<S>()) {
        store_codes<((UNSIGNED >> S) & 1u) == 0u, VECTOR>(
            maps, reinterpret_cast<unsigned char*>(job.addresses[S]), i, job.numel, out[S],
            fresh[bits_below(QUANTIZED, S)]);
      } else if constexpr (written<S>() && S == 0 && MTA_DELTA) {  // new - old, not the params
        const auto& before = lane_slot<0>(lanes);
        last_t update[PER_LANE];
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) update[k] = from_acc<last_t>(out[0][k] - to_acc(before[k]));
        store_lane(reinterpret_cast<last_t*>(job.addresses[UPDATES]), i, job.numel, VECTOR, update);
      } else if constexpr (written<S>() && S == 0) {
        store_params(reinterpret_cast<T*>(job.addresses[S]), i, job.numel, VECTOR, out[S], op);
      } else if constexpr (written<S>()) {
        if (!lacks<S>(absent_slots(op))) {
          T rounded[PER_LANE];
#pragma unroll
          for (int k = 0; k < PER_LANE; ++k) rounded[k] = from_acc<T>(out[S][k]);
          store_lane(reinterpret_cast<T*>(job.addresses[S]), i, job.numel, VECTOR, rounded);
        }
      }
      store<S + 1, VECTOR>(maps, op, job, i, lanes, out, fresh);
    }
  }

  // Stores a block's (finite) values as codes of its absolute maximum `top` (the warp's).
  template <bool SIGNED, bool VECTOR>
  static __device__ __forceinline__ void store_codes(const Maps& maps, unsigned char* codes, long long i,
                                                     long long numel, const float (&x)[PER_LANE], float top) {
    // times the reciprocal, as quantize_blockwise; divided where it overflows (a subnormal
    // maximum: the branch is the same for the whole warp)
    const float inverse = top > 0.0f ? 1.0f / top : 0.0f;
    float normalized[PER_LANE];
    if (inverse > 3.40282347e38f) {
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) normalized[k] = x[k] / top;
    } else {
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) normalized[k] = x[k] * inverse;
    }
    unsigned sums[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) sums[k] = code_sum<SIGNED>(maps.words, normalized[k]);
    if (VECTOR) {
#pragma unroll
      for (int h = 0; h < 2; ++h) store_word(reinterpret_cast<unsigned*>(codes + i + h * HALF), pack_codes(sums + h * GROUP));
    } else {
      unsigned char c[PER_LANE];
#pragma unroll
      for (int k = 0; k < PER_LANE; ++k) c[k] = static_cast<unsigned char>(sums[k] >> 16);
      store_lane(codes, i, numel, false, c);
    }
  }
};

}  // namespace mta
