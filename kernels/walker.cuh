// The chunk walker: the only loop over tensor memory in mtapply. Each op is a functor that
// transforms the values of one element held in registers; the walker finds the block's
// (tensor, chunk), loads every slot, calls the functor and stores the slots it writes.
//
// Configuration comes from the generated preamble (see mtapply/_source.py):
//   MTA_BLOCK, MTA_CHUNK, MTA_VEC   threads per block (or a warp: see walk), elements per
//                                   chunk, elements per vector
//   MTA_SLOTS                       slots per table record (an op's pass may load fewer)
//   mta::acc_t                      math type (float, or double for float64 params)
//   mta::sum_t                      type of sums and scalar state (double with MTA_SUM64: a
//                                   plan whose params are all float64; else float)
//   mta::SlotType<S>::type          storage type of slot S
//   MTA_MASTER, mta::param_t        fp32 master weights (below), and the params' storage type
//   MTA_SCALAR_CHECKS(X)            the op's device scalars and their ranges (step_runs, below)
//
// An op's functor declares N_SLOTS (it uses the first slots of each record), WRITTEN (bit mask
// of the slots it stores), GRAD (the slot the walker unscales, -1 for none), N_SUMS (per-tensor
// sums it accumulates for a later pass) and Args; optionally READ (slots it loads, default all)
// and GLOBAL (a static finish(args, all_sums, positions, n) run once per launch, after every
// tensor's sums are known, by the block that finishes last). An op whose elements are not
// independent (blockwise-quantized states) sets OWN_WALK and a static walk(launch) that takes
// the block's chunk from chunk_of, as walk does; MIN_BLOCKS (optional) asks the compiler for
// that many resident blocks per SM; IN_FLIGHT (optional) how many strides of vectors each thread
// loads before it stores (walk_vectors); LAST_FIRST (optional) that its blocks take the launch's
// chunks last first (an update after a pass that summed over the same tensors then begins where
// that pass's last reads may still be in L2). An op that sets INDEXED (factored state: values kept per row
// or per column of a matrix) is made with the block's chunk, Op(args, chunk, sums), is called
// with each element's flat index and the index its row is taken from (an unsigned 32-bit word
// where its member `narrow` says every index of the tensor fits one, else a long long): the
// vector's first element where its member `whole_rows` says every vector lies in one row, else
// the element's own. Its member `absent` gives the slots that its tensor does not hold per
// element, which the walker neither loads nor stores. An indexed sums pass may set
// PRODUCT_SUMS: its products_hold(chunk, acc) says where its tensor's sums are taken already
// (mtapply/rules/_factored_sums.py), having added them to acc, and the chunk is not walked.
//
// Master weights (MTA_MASTER): the record's last slot holds an fp32 copy of each 16-bit param.
// The op then sees the master as its param (slot 0), and where it writes slot 0 the walker stores
// the master and also the master rounded to the param's own storage.
//
// Updates instead of params (for optax's contract, which returns updates):
//   MTA_DELTA       the op's new param minus the old goes to the record's last slot (of type
//                   last_t); the param itself is only read.
//   MTA_DELTA_STEP  with MTA_DELTA: the op's "new param" is the step itself (a rule whose
//                   param line was made the step: mtapply/rules/_step_update.py), stored as is.
// Stochastic rounding (MTA_STOCHASTIC): bfloat16 params without masters are stored rounded
// stochastically (rounding.cuh), with the op's member `rounding` giving the random bits.
//   MTA_ZERO_PARAM  the param is not read but taken as zero, so the new "param" the op writes to
//                   slot 0 is the update itself (ops whose update does not depend on the param).
#pragma once
#include "dtypes.cuh"
#include "rounding.cuh"

#ifndef MTA_MASTER
#define MTA_MASTER 0
#endif
#ifndef MTA_DELTA
#define MTA_DELTA 0
#endif
#ifndef MTA_DELTA_STEP
#define MTA_DELTA_STEP 0
#endif
#ifndef MTA_ZERO_PARAM
#define MTA_ZERO_PARAM 0
#endif

namespace mta {

template <class Op, class = void> struct ReadMask { static constexpr unsigned value = ~0u; };
template <class Op> struct ReadMask<Op, decltype(void(Op::READ))> { static constexpr unsigned value = Op::READ; };
template <class Op, class = void> struct IsGlobal { static constexpr bool value = false; };
template <class Op> struct IsGlobal<Op, decltype(void(Op::GLOBAL))> { static constexpr bool value = Op::GLOBAL; };
template <class Op, class = void> struct OwnWalk { static constexpr bool value = false; };
template <class Op> struct OwnWalk<Op, decltype(void(Op::OWN_WALK))> { static constexpr bool value = Op::OWN_WALK; };
template <class Op, class = void> struct MinBlocks { static constexpr int value = 1; };
template <class Op> struct MinBlocks<Op, decltype(void(Op::MIN_BLOCKS))> { static constexpr int value = Op::MIN_BLOCKS; };
template <class Op, class = void> struct Indexed { static constexpr bool value = false; };
template <class Op> struct Indexed<Op, decltype(void(Op::INDEXED))> { static constexpr bool value = Op::INDEXED; };
template <class Op, class = void> struct InFlight { static constexpr int value = 1; };
template <class Op> struct InFlight<Op, decltype(void(Op::IN_FLIGHT))> { static constexpr int value = Op::IN_FLIGHT; };
template <class A, class B> struct Same { static constexpr bool value = false; };
template <class A> struct Same<A, A> { static constexpr bool value = true; };
template <class Op, class = void> struct LastFirst { static constexpr bool value = false; };
template <class Op> struct LastFirst<Op, decltype(void(Op::LAST_FIRST))> { static constexpr bool value = Op::LAST_FIRST; };
template <class Op, class = void> struct ProductSums { static constexpr bool value = false; };
template <class Op> struct ProductSums<Op, decltype(void(Op::PRODUCT_SUMS))> { static constexpr bool value = Op::PRODUCT_SUMS; };

// A per-launch scalar given as a number, or (ptr non-null) as a float in device memory: a
// tensor lr, a device step count, GradScaler's scale; read in double, as the host would.
__device__ __forceinline__ double scalar_arg(const float* ptr, double value) {
  return ptr ? static_cast<double>(*ptr) : value;
}

// Arguments of every launch. The group's table, in device memory:
//   blocks[b]  = (tensor index, chunk index) of CUDA block b; a tensor's blocks are consecutive
//   records[t] = {numel, address of slot 0, ..., address of slot MTA_SLOTS - 1}
// AMP loss scaling, common to every op: grads arrive multiplied by grad_scale (or by
// *grad_scale_ptr) and are divided by it; when *found_inf_ptr is non-zero nothing is written.
// Ops that sum over each tensor (Op::N_SUMS > 0) use the workspace: partials (per block),
// arrivals (per tensor, zero between launches) and sums (per tensor, the totals). The sums of
// every group of the plan lie in all_sums; positions[i] is where the i-th tensor of the caller's
// list lies there; finished counts the tensors done in this step, over all groups. A fused
// launch (walk_fused) runs both passes of a two-pass op from its list of jobs.
template <class Args>
struct Launch {
  const int2* blocks;
  const long long* records;
  double grad_scale;
  const float* grad_scale_ptr;
  const float* found_inf_ptr;
  sum_t* partials;
  unsigned* arrivals;
  sum_t* sums;
  const sum_t* all_sums;
  const int* positions;
  unsigned* finished;
  const int* jobs;        // a fused launch's jobs (walk_fused), busy blocks (factored.cuh), or null
  unsigned* tickets;      // the jobs taken in a fused launch (zero between launches)
  long long n_tensors;
  long long n_nonempty;
  const Args* args_rows;  // per-tensor hyperparameters: the rows of distinct args, or null
  const int* row_of;      // the row of each tensor of the group
  float* step_counter;    // a plan that counts its steps: the steps taken, else null
  unsigned* step_arrivals;  // blocks of this step that have read the count (zero between steps)
  long long step_blocks;  // blocks of the step's last pass, which advances the count; else 0
  long long checked_rows;  // rows of args_rows whose device values step_runs checks (0: none)
  float* invalid;         // set to 1 by a step that a device value out of its range skipped
  Args args;
};

template <class Args, class = void> struct HasStep { static constexpr bool value = false; };
template <class Args> struct HasStep<Args, decltype(void(static_cast<Args*>(nullptr)->step_ptr))> {
  static constexpr bool value = true;
};

// The args of a tensor: its row where hyperparameters differ per tensor (param groups in one
// launch), else the launch's. A plan that counts its steps takes this step as one more than
// its counter holds: the counter advances once every block of the step has read it.
template <class Args>
__device__ __forceinline__ Args args_of(const Launch<Args>& launch, int tensor) {
  Args a = launch.args_rows ? launch.args_rows[launch.row_of[tensor]] : launch.args;
  if constexpr (HasStep<Args>::value) {
    if (launch.step_counter) {
      a.step = static_cast<double>(*launch.step_counter) + 1.0;
      a.step_ptr = nullptr;
    }
  }
  return a;
}

// Device scalars (a tensor lr, a device step, GradScaler's scale) are checked by every block
// before it writes anything, against the ranges the op declares (mtapply.ops._spec.Range): the
// generated preamble lists them as MTA_SCALAR_CHECKS(X), X(word of the value's address in
// Args, values there, low, high, flags). A value out of its range skips the whole step, as
// found_inf does (every block reads the same values, so all agree), and sets *invalid.
enum : unsigned { CHECK_LOW = 1u, CHECK_LOW_OPEN = 2u, CHECK_HIGH = 4u, CHECK_HIGH_OPEN = 8u,
                  CHECK_FINITE = 16u, CHECK_WHOLE = 32u };
#ifndef MTA_SCALAR_CHECKS
#define MTA_SCALAR_CHECKS(X)
#endif

__device__ __forceinline__ bool in_range(float value, double low, double high, unsigned flags) {
  const double v = static_cast<double>(value);
  if (v != v || ((flags & CHECK_FINITE) && !isfinite(v))) return false;
  if ((flags & CHECK_LOW) && ((flags & CHECK_LOW_OPEN) ? !(v > low) : !(v >= low))) return false;
  if ((flags & CHECK_HIGH) && ((flags & CHECK_HIGH_OPEN) ? !(v < high) : !(v <= high))) return false;
  return !(flags & CHECK_WHOLE) || v == floor(v);
}

// Whether the device values that `a` points at (as the functor reads them: a counted step
// comes from the counter) lie in their ranges; Args are 8-byte words.
template <class Args>
__device__ __forceinline__ bool args_in_range(const Launch<Args>& launch, Args a) {
  static_assert(sizeof(Args) % 8 == 0, "kernel arguments are 8-byte words");
  if constexpr (HasStep<Args>::value) {
    if (launch.step_counter) a.step_ptr = nullptr;
  }
  (void)launch;
  const unsigned long long* words = reinterpret_cast<const unsigned long long*>(&a);
  (void)words;
  bool ok = true;
#define MTA_CHECK_SCALAR(WORD, COUNT, LOW, HIGH, FLAGS)                                  \
  static_assert((WORD) < sizeof(Args) / 8, "a checked device scalar's word lies in Args"); \
  if (const float* p = reinterpret_cast<const float*>(words[WORD]))                      \
    for (int j = 0; j < (COUNT); ++j) ok = ok && in_range(p[j], LOW, HIGH, FLAGS);
  MTA_SCALAR_CHECKS(MTA_CHECK_SCALAR)
#undef MTA_CHECK_SCALAR
  return ok;
}

// Whether this step writes: not when found_inf is set, nor when a device value is out of its
// range (then *invalid is set). A launch without the flag is not checked: XLA's (its outputs
// are fresh buffers that a skipped step would leave unwritten), and one whose values are all
// host numbers the host checked (mtapply._launch gives it no flag). Per block, a few scalar loads
// before the walk; the rows of per-tensor args (where some hold device values the host did
// not check) are split among the block's threads.
template <class Args>
__device__ __forceinline__ bool step_runs(const Launch<Args>& launch) {
  if (launch.found_inf_ptr && *launch.found_inf_ptr != 0.0f) return false;
  if (!launch.invalid) return true;  // nothing to check (see above)
  bool valid = !launch.grad_scale_ptr ||
               in_range(*launch.grad_scale_ptr, 0.0, 0.0, CHECK_LOW | CHECK_LOW_OPEN | CHECK_FINITE);
  if constexpr (HasStep<Args>::value) {  // the step is the count plus one: a whole number >= 1
    if (launch.step_counter)
      valid = valid && in_range(*launch.step_counter, 0.0, 0.0, CHECK_LOW | CHECK_FINITE | CHECK_WHOLE);
  }
  if (!launch.args_rows) {
    valid = valid && args_in_range(launch, launch.args);
  } else if (launch.checked_rows > 0) {
    bool bad = !valid;
    for (long long r = threadIdx.x; r < launch.checked_rows; r += blockDim.x)
      bad = bad || !args_in_range(launch, launch.args_rows[r]);
    valid = !__syncthreads_or(bad);
  }
  if (!valid && threadIdx.x == 0 && launch.invalid) *launch.invalid = 1.0f;
  return valid;
}

// Advances a counting plan's step count, after the last block of the step's last pass (over
// all its launches) is done reading it; a step that found_inf or an invalid value skips (`runs`
// false in every block) does not count.
template <class Args>
__device__ __forceinline__ void count_step(const Launch<Args>& launch, bool runs) {
  if (launch.step_blocks == 0 || !runs) return;
  __syncthreads();  // every thread of the block has read the count
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(launch.step_arrivals, 1u) == static_cast<unsigned>(launch.step_blocks - 1)) {
    *launch.step_counter += 1.0f;
    *launch.step_arrivals = 0u;  // ready for the next step
  }
}

// VEC elements at i as whole 16-byte words, or one 8-byte word (four 16-bit elements: the
// factor pass's vectors, kernels/factored.cuh).
template <class T, int VEC>
__device__ __forceinline__ void load_vec(const char* base, long long i, acc_t (&out)[VEC]) {
  const T* at = reinterpret_cast<const T*>(base) + i;
  if constexpr (VEC * sizeof(T) == 8) {
    union { uint2 word; T vals[VEC]; } u;
    u.word = *reinterpret_cast<const uint2*>(at);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = to_acc(u.vals[k]);
  } else {
    static_assert(VEC * sizeof(T) % 16 == 0, "vector must be whole 16-byte words");
    union { uint4 words[VEC * sizeof(T) / 16]; T vals[VEC]; } u;
    const uint4* src = reinterpret_cast<const uint4*>(at);
#pragma unroll
    for (int w = 0; w < int(VEC * sizeof(T) / 16); ++w) u.words[w] = src[w];
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = to_acc(u.vals[k]);
  }
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(char* base, long long i, const acc_t (&in)[VEC]) {
  union { uint4 words[VEC * sizeof(T) / 16]; T vals[VEC]; } u;
#pragma unroll
  for (int k = 0; k < VEC; ++k) u.vals[k] = from_acc<T>(in[k]);
  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<T*>(base) + i);
#pragma unroll
  for (int w = 0; w < int(VEC * sizeof(T) / 16); ++w) dst[w] = u.words[w];
}

// Loads the slots among S..N-1 that the op reads (bit s of READ), W elements at i (W = 1: one
// element), into registers; the others, and those `absent` from the tensor, are zero. A slot
// not read is not compiled either: it may hold 8-bit codes (a factored rule's reductions beside
// 8-bit slots, quantized.cuh), which have no to_acc.
template <int S, int N, unsigned READ, int W>
__device__ __forceinline__ void load_slots(char* const (&ptr)[N], long long i, acc_t (&v)[N][W],
                                           unsigned absent = 0u) {
  if constexpr (S < N) {
    using T = typename SlotType<S>::type;
    if constexpr (((READ >> S) & 1u) == 0u) {
#pragma unroll
      for (int k = 0; k < W; ++k) v[S][k] = acc_t(0);
    } else if ((absent >> S) & 1u) {
#pragma unroll
      for (int k = 0; k < W; ++k) v[S][k] = acc_t(0);
    } else if constexpr (W == 1) {
      v[S][0] = to_acc(reinterpret_cast<const T*>(ptr[S])[i]);
    } else {
      load_vec<T, W>(ptr[S], i, v[S]);
    }
    load_slots<S + 1, N, READ, W>(ptr, i, v, absent);
  }
}

// Stores the slots among S..N-1 that the op writes (bit s of WRITTEN), but those `absent`.
template <int S, int N, unsigned WRITTEN, int W>
__device__ __forceinline__ void store_slots(char* const (&ptr)[N], long long i, const acc_t (&v)[N][W],
                                            unsigned absent = 0u) {
  if constexpr (S < N) {
    using T = typename SlotType<S>::type;
    if constexpr ((WRITTEN >> S) & 1u) {
      if (!((absent >> S) & 1u)) {
        if constexpr (W == 1) reinterpret_cast<T*>(ptr[S])[i] = from_acc<T>(v[S][0]);
        else store_vec<T, W>(ptr[S], i, v[S]);
      }
    }
    store_slots<S + 1, N, WRITTEN, W>(ptr, i, v, absent);
  }
}

// The slots an indexed op's tensor does not hold per element (none for other ops).
template <class Op>
__device__ __forceinline__ unsigned absent_slots(const Op& op) {
  if constexpr (Indexed<Op>::value) return op.absent;
  else return 0u;
}

// The same, known at compile time where the walk is made for one form of tensor (walk_indexed).
template <class Op, bool FACTORED>
__device__ constexpr unsigned absent_in() {
  if constexpr (Indexed<Op>::value) return FACTORED ? Op::FACTORED_ABSENT : 0u;
  else return 0u;
}

// The slots the walker loads for the op: those it reads, but the param where it is taken as 0.
template <class Op>
__device__ constexpr unsigned loaded_slots() {
  return ReadMask<Op>::value & (MTA_ZERO_PARAM ? ~1u : ~0u);
}

// Applies op to the values v of W consecutive elements starting at i (W = MTA_VEC, or 1 for the
// scalar path), loaded by load_slots, and stores the slots it writes; an op that sums also adds
// each element's contributions to `acc`; an indexed op gets each element's index as an Index.
// With master weights, `param_copy` is the 16-bit param that receives the rounded master; with
// MTA_DELTA it is the slot that receives the update.
template <class Op, int W, class Index, bool ROWS = false, bool FACTORED = false>
__device__ __forceinline__ void update(const Op& op, acc_t grad_scale, char* const (&ptr)[Op::N_SLOTS],
                                       char* param_copy, long long i,
                                       sum_t (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1],
                                       acc_t (&v)[Op::N_SLOTS][W]) {
  constexpr int N = Op::N_SLOTS;
  constexpr unsigned STORED = Op::WRITTEN & (MTA_DELTA || MTA_STOCHASTIC ? ~1u : ~0u);
  const unsigned absent = absent_in<Op, FACTORED>();
#if MTA_DELTA
  acc_t before[W];
#pragma unroll
  for (int k = 0; k < W; ++k) before[k] = v[0][k];
#endif
#pragma unroll
  for (int k = 0; k < W; ++k) {
    acc_t x[N];
#pragma unroll
    for (int s = 0; s < N; ++s) x[s] = v[s][k];
    if constexpr (Op::GRAD >= 0) {
      if (grad_scale != acc_t(1)) x[Op::GRAD] = x[Op::GRAD] / grad_scale;
    }
    if constexpr (Indexed<Op>::value) {
      // ROWS: the W elements lie in one row, whose index the op then takes once (from i)
      const Index row_of = static_cast<Index>(ROWS ? i : i + k);
      const Index index = static_cast<Index>(i + k);
      if constexpr (Op::N_SUMS > 0) op.template element<FACTORED>(x, acc, index, row_of);
      else op.template element<FACTORED>(x, index, row_of);
    } else if constexpr (Op::N_SUMS > 0) {
      op(x, acc);
    } else {
      op(x);
    }
#pragma unroll
    for (int s = 0; s < N; ++s) v[s][k] = x[s];
  }
  if constexpr (STORED != 0u) store_slots<0, N, STORED, W>(ptr, i, v, absent);
#if MTA_STOCHASTIC
  static_assert(!MTA_MASTER && !MTA_DELTA, "stochastic rounding stores the params themselves");
  if constexpr ((Op::WRITTEN & 1u) != 0u) store_bf16_stochastic<W>(ptr[0], i, v[0], op.rounding);
#endif
#if MTA_DELTA
  if constexpr ((Op::WRITTEN & 1u) != 0u) {
    acc_t update[W];
#pragma unroll
    for (int k = 0; k < W; ++k) update[k] = MTA_DELTA_STEP ? v[0][k] : v[0][k] - before[k];
    if constexpr (W == 1) reinterpret_cast<last_t*>(param_copy)[i] = from_acc<last_t>(update[0]);
    else store_vec<last_t, W>(param_copy, i, update);
  }
#endif
#if MTA_MASTER
  if constexpr ((Op::WRITTEN & 1u) != 0u) {
    if constexpr (W == 1) reinterpret_cast<param_t*>(param_copy)[i] = from_acc<param_t>(v[0][0]);
    else store_vec<param_t, W>(param_copy, i, v[0]);
  }
#endif
}

// Loads and updates W consecutive elements starting at i.
template <class Op, int W, class Index, bool ROWS = false, bool FACTORED = false>
__device__ __forceinline__ void apply(const Op& op, acc_t grad_scale, char* const (&ptr)[Op::N_SLOTS],
                                      char* param_copy, long long i,
                                      sum_t (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1]) {
  acc_t v[Op::N_SLOTS][W];
  load_slots<0, Op::N_SLOTS, loaded_slots<Op>(), W>(ptr, i, v, absent_in<Op, FACTORED>());
  update<Op, W, Index, ROWS, FACTORED>(op, grad_scale, ptr, param_copy, i, acc, v);
}

// The operations the reductions below combine with: a sum, and a minimum (fmin: a NaN is
// dropped, so a check that must see one counts it apart).
struct Plus {
  template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Least {
  template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return fmin(a, b); }
};

// `value` combined over each group of GROUP lanes (a power of 2 up to 32) in a fixed order;
// every lane of the group gets it.
template <int GROUP, class Combine = Plus, class T>
__device__ __forceinline__ T group_reduce(T value, Combine combine = {}) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// `value` combined over the block in a fixed order (deterministic); every thread gets it.
template <class Combine = Plus, class T>
__device__ __forceinline__ T block_reduce(T value, Combine combine = {}) {
  __shared__ T warp_values[MTA_BLOCK / 32];
  __syncthreads();  // warp_values may still be read by the previous call
  value = group_reduce<32>(value, combine);
  if (threadIdx.x % 32 == 0) warp_values[threadIdx.x / 32] = value;
  __syncthreads();
  T total = warp_values[0];
#pragma unroll
  for (int w = 1; w < MTA_BLOCK / 32; ++w) total = combine(total, warp_values[w]);
  return total;
}

template <class T>
__device__ __forceinline__ T block_sum(T value) { return block_reduce(value, Plus{}); }

// Writes this block's sums; the last block of the tensor to finish adds all of the tensor's
// block sums in block order (so the result does not depend on timing) into sums[tensor].
// Of the blocks that finish a tensor, the last one of the launch's plan-wide step runs the op's
// global finish (every tensor's sums are then in all_sums), and resets the count.
template <class Op>
__device__ void finish_global(const Launch<typename Op::Args>& launch) {
  __shared__ bool last_tensor;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this tensor's sums, written by thread 0, before the count
    last_tensor = atomicAdd(launch.finished, 1u) == static_cast<unsigned>(launch.n_nonempty - 1);
  }
  __syncthreads();
  if (!last_tensor) return;
  __threadfence();
  Op::finish(launch.args, launch.all_sums, launch.positions, launch.n_tensors);
  if (threadIdx.x == 0) *launch.finished = 0u;  // ready for the next step
}

// Set in a tensor's arrival count once its sums are known, in a fused launch (walk_fused).
constexpr unsigned SUMS_READY = 1u << 31;

template <class Op>
__device__ void finish_sums(const Launch<typename Op::Args>& launch, const sum_t (&acc)[Op::N_SUMS],
                            long long slot, int tensor, int chunk, long long numel,
                            bool fused = false) {
  constexpr int N_SUMS = Op::N_SUMS;
  sum_t mine[N_SUMS];
#pragma unroll
  for (int k = 0; k < N_SUMS; ++k) mine[k] = block_sum(acc[k]);
  __shared__ bool last;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < N_SUMS; ++k) launch.partials[slot * N_SUMS + k] = mine[k];
    __threadfence();
    const unsigned chunks = static_cast<unsigned>((numel + MTA_CHUNK - 1) / MTA_CHUNK);
    last = atomicAdd(&launch.arrivals[tensor], 1u) == chunks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const long long first = slot - chunk;
  const long long chunks = (numel + MTA_CHUNK - 1) / MTA_CHUNK;
#pragma unroll
  for (int k = 0; k < N_SUMS; ++k) {
    sum_t part = 0;
    for (long long b = threadIdx.x; b < chunks; b += MTA_BLOCK)
      part += __ldcg(&launch.partials[(first + b) * N_SUMS + k]);  // L2: written by other blocks
    const sum_t total = block_sum(part);
    if (threadIdx.x == 0) launch.sums[static_cast<long long>(tensor) * N_SUMS + k] = total;
  }
  if (threadIdx.x == 0) {
    if (fused) {  // the tensor's update jobs may start (they then count themselves out)
      __threadfence();  // the sums before the flag
      atomicAdd(&launch.arrivals[tensor], SUMS_READY);
    } else {
      launch.arrivals[tensor] = 0u;  // ready for the next launch
    }
  }
  if constexpr (IsGlobal<Op>::value) finish_global<Op>(launch);
}

// The block's chunk: its tensor, the tensor's size and slot addresses, and the chunk's
// [begin, end) element range.
struct Chunk {
  int tensor, index;
  long long numel, begin, end;
  const long long* addresses;  // slot s at addresses[s]
};

template <class Args>
__device__ __forceinline__ Chunk chunk_at(const Launch<Args>& launch, long long block) {
  const int2 job = launch.blocks[block];
  const long long* rec = launch.records + static_cast<long long>(job.x) * (MTA_SLOTS + 1);
  const long long begin = static_cast<long long>(job.y) * MTA_CHUNK;
  return Chunk{job.x, job.y, rec[0], begin, min(begin + static_cast<long long>(MTA_CHUNK), rec[0]),
               rec + 1};
}

// The addresses of the first N slots of the chunk's tensor as the op sees them (with master
// weights its param is the fp32 master), and in `param_copy` the slot that receives the param
// rounded to its storage (MTA_MASTER) or the update (MTA_DELTA); returns the addresses' bits
// or-ed together (16-byte alignment decides the vector path).
template <int N>
__device__ __forceinline__ unsigned long long element_pointers(const Chunk& job, char* (&ptr)[N],
                                                               char*& param_copy) {
  unsigned long long address_bits = 0;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    ptr[s] = reinterpret_cast<char*>(job.addresses[s]);
    address_bits |= static_cast<unsigned long long>(job.addresses[s]);
  }
#if MTA_MASTER
  param_copy = ptr[0];
  ptr[0] = reinterpret_cast<char*>(job.addresses[MTA_SLOTS - 1]);  // the fp32 master is the op's param
  address_bits |= static_cast<unsigned long long>(job.addresses[MTA_SLOTS - 1]);
#elif MTA_DELTA
  param_copy = reinterpret_cast<char*>(job.addresses[MTA_SLOTS - 1]);  // the updates
  address_bits |= static_cast<unsigned long long>(job.addresses[MTA_SLOTS - 1]);
#endif
  return address_bits;
}

template <class Args>
__device__ __forceinline__ Chunk chunk_of(const Launch<Args>& launch) {
  return chunk_at(launch, blockIdx.x);
}

// The op's functor for the block's chunk: an indexed op is made with the chunk itself.
template <class Op>
__device__ __forceinline__ Op make_op(const Launch<typename Op::Args>& launch, const Chunk& job) {
  if constexpr (Indexed<Op>::value) return Op(args_of(launch, job.tensor), job, launch.sums);
  else return Op(args_of(launch, job.tensor), job.tensor, launch.sums);
}

// The vectors of [begin, end), MTA_BLOCK apart: the op's IN_FLIGHT strides at a time (default 1)
// are all loaded before the first of them is stored. (The compiler cannot move a load above a
// store that may alias it, so a plain loop waits for each stride's loads in turn; no two strides
// share an element, so these loads read what the plain loop would.) The rest one at a time.
// More strides in flight pay where an element costs many instructions (factored rules: 7% on
// gpt2-124M's Adafactor step, H200) and cost registers elsewhere (Adam 4%, SGD and Lion 2-3%).
template <class Op, class Index, bool ROWS, bool FACTORED>
__device__ __forceinline__ void walk_vectors(const Op& op, acc_t grad_scale,
                                             char* const (&ptr)[Op::N_SLOTS], char* param_copy,
                                             long long begin, long long end,
                                             sum_t (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1]) {
  constexpr long long STRIDE = static_cast<long long>(MTA_BLOCK) * MTA_VEC;
  constexpr int U = InFlight<Op>::value;
  long long i = begin + threadIdx.x * MTA_VEC;
  if constexpr (U > 1) {
    for (; i + (U - 1) * STRIDE < end; i += U * STRIDE) {
      acc_t v[U][Op::N_SLOTS][MTA_VEC];
#pragma unroll
      for (int u = 0; u < U; ++u)
        load_slots<0, Op::N_SLOTS, loaded_slots<Op>(), MTA_VEC>(ptr, i + u * STRIDE, v[u],
                                                               absent_in<Op, FACTORED>());
#pragma unroll
      for (int u = 0; u < U; ++u)
        update<Op, MTA_VEC, Index, ROWS, FACTORED>(op, grad_scale, ptr, param_copy, i + u * STRIDE, acc,
                                                   v[u]);
    }
  }
  for (; i < end; i += STRIDE)
    apply<Op, MTA_VEC, Index, ROWS, FACTORED>(op, grad_scale, ptr, param_copy, i, acc);
}

// The chunk's elements: vectors where the slots are 16-byte aligned, then the rest one by one.
// An indexed op is given each element's index as an Index (an unsigned 32-bit word where its
// tensor's indices fit one, which its functor divides more cheaply).
template <class Op, class Index, bool FACTORED = false>
__device__ __forceinline__ void walk_range(const Op& op, acc_t grad_scale,
                                           char* const (&ptr)[Op::N_SLOTS], char* param_copy,
                                           bool aligned, const Chunk& job,
                                           sum_t (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1]) {
  const long long begin = job.begin, end = job.end;
  long long scalar_from = begin;
  // Chunks start at multiples of MTA_VEC elements, so one aligned base keeps every vector aligned.
  if (aligned) {
    scalar_from = begin + (end - begin) / MTA_VEC * MTA_VEC;
    bool rows = false;
    if constexpr (Indexed<Op>::value && FACTORED) rows = op.whole_rows;  // (none unfactored)
    if (rows)
      walk_vectors<Op, Index, true, FACTORED>(op, grad_scale, ptr, param_copy, begin, scalar_from, acc);
    else
      walk_vectors<Op, Index, false, FACTORED>(op, grad_scale, ptr, param_copy, begin, scalar_from, acc);
  }
#pragma unroll 4
  for (long long i = scalar_from + threadIdx.x; i < end; i += blockDim.x)
    apply<Op, 1, Index, false, FACTORED>(op, grad_scale, ptr, param_copy, i, acc);
}

// The chunk of an indexed op, walked for the form of its tensor (FACTORED: a stack of matrices
// whose elements read row and column state; its functor's element<FACTORED>), so that the form
// is decided once a chunk, not at each element (the branch kept the compiler from sharing an
// element's row among its vector's elements), and with its Index.
template <class Op, bool FACTORED>
__device__ __forceinline__ void walk_indexed(const Op& op, acc_t grad_scale,
                                             char* const (&ptr)[Op::N_SLOTS], char* param_copy,
                                             bool aligned, const Chunk& job,
                                             sum_t (&acc)[Op::N_SUMS > 0 ? Op::N_SUMS : 1]) {
  if (op.narrow)
    walk_range<Op, unsigned, FACTORED>(op, grad_scale, ptr, param_copy, aligned, job, acc);
  else
    walk_range<Op, long long, FACTORED>(op, grad_scale, ptr, param_copy, aligned, job, acc);
}

// Whether a sums pass's tensor has its sums already, taken by its factor and matrix passes in
// their product forms (then in acc): its elements are not walked.
template <class Op, class Acc>
__device__ __forceinline__ bool sums_taken(const Op& op, const Chunk& job, Acc& acc) {
  if constexpr (ProductSums<Op>::value) return op.factored && op.products_hold(job.index, acc);
  return false;
}

// Applies the op's functor to every element of the block's chunk. A block is MTA_BLOCK threads,
// or one warp where the host found every chunk of the launch no longer than a warp's vectors
// (mtapply._source.block_threads): 2,000 blocks over 100-element tensors then fit on the GPU at
// once instead of taking four waves. The vector loop keeps MTA_BLOCK as its stride (a constant
// lets the compiler overlap the loads of several strides); a warp's chunk ends within its first
// stride. The scalar loop (a tail, or a chunk not 16-byte aligned) strides by the block.
// Passes that sum over a block (block_sum) and ops that walk by themselves get whole blocks.
template <class Op>
__device__ __forceinline__ void walk_chunk(const Launch<typename Op::Args>& launch, const Chunk& job,
                                           long long slot, bool fused = false) {
  constexpr int N = Op::N_SLOTS;
  const acc_t grad_scale = acc_t(scalar_arg(launch.grad_scale_ptr, launch.grad_scale));
  const long long numel = job.numel;
  // The op first: its constructor's per-launch math (hyperparameters read in double) is the
  // walk's register peak, which the element pointers would otherwise add to.
  const Op op = make_op<Op>(launch, job);
  char* ptr[N];  // an op may use only the first slots of the records (e.g. a norms pass)
  char* param_copy = nullptr;
  const unsigned long long address_bits = element_pointers(job, ptr, param_copy);
  sum_t acc[Op::N_SUMS > 0 ? Op::N_SUMS : 1] = {};
  const bool aligned = (address_bits & 15ull) == 0;
  if constexpr (Indexed<Op>::value) {  // (the same branches in every thread of the block)
    if (sums_taken(op, job, acc)) {
      // nothing to walk: acc holds the tensor's sums
    } else if (op.factored) {
      walk_indexed<Op, true>(op, grad_scale, ptr, param_copy, aligned, job, acc);
    } else {
      walk_indexed<Op, false>(op, grad_scale, ptr, param_copy, aligned, job, acc);
    }
  } else {
    walk_range<Op, long long>(op, grad_scale, ptr, param_copy, aligned, job, acc);
  }
  if constexpr (Op::N_SUMS > 0) finish_sums<Op>(launch, acc, slot, job.tensor, job.index, numel, fused);
}

// A chunk's partial sums go to the slot of the chunk walked (block order reversed for LAST_FIRST).
template <class Op>
__device__ __forceinline__ void walk_elements(const Launch<typename Op::Args>& launch) {
  const long long walked = LastFirst<Op>::value ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  walk_chunk<Op>(launch, chunk_at(launch, walked), walked);
}

// Both passes of an op whose first pass sums over each tensor (Sum: it writes nothing) and
// whose update reads those sums (Update), in one launch: no drain and launch between the
// passes, and each chunk's update soon after its sums read it, so that it re-reads them from
// L2. Block b takes ticket b in the order the blocks start (an atomic count), and the job
// `jobs[ticket]`: the sums of chunk k (k >= 0) or the update of chunk ~k. The host lists each
// update after every sum of its tensor, so a block that waits for a tensor's sums waits only
// for blocks that took earlier tickets, which are running and wait for nothing: no deadlock,
// however many blocks fit on the GPU. The tensor's arrival count says when its sums are in
// (SUMS_READY); each update job then counts itself, and the last one zeroes it.
template <class Sum, class Update>
__device__ void walk_fused(const Launch<typename Sum::Args>& launch) {
  static_assert(Sum::WRITTEN == 0u && Sum::N_SUMS > 0 && !IsGlobal<Sum>::value,
                "a fused launch's first pass only sums over each tensor");
  __shared__ int job;
  if (threadIdx.x == 0) {
    const unsigned ticket = atomicAdd(launch.tickets, 1u);
    if (ticket == gridDim.x - 1) *launch.tickets = 0u;  // every ticket is taken: for the next launch
    job = launch.jobs[ticket];
  }
  __syncthreads();
  const long long block = job >= 0 ? job : ~job;
  const Chunk chunk = chunk_at(launch, block);
  if (job >= 0) {
    walk_chunk<Sum>(launch, chunk, block, true);
    return;
  }
  if (threadIdx.x == 0) {
    unsigned* count = &launch.arrivals[chunk.tensor];
    while ((atomicAdd(count, 0u) & SUMS_READY) == 0u) __nanosleep(100);
    __threadfence();  // the sums after the flag
    const unsigned chunks = static_cast<unsigned>((chunk.numel + MTA_CHUNK - 1) / MTA_CHUNK);
    if (atomicAdd(count, 1u) == SUMS_READY + 2u * chunks - 1u) *count = 0u;  // the last update
  }
  __syncthreads();
  walk_chunk<Update>(launch, chunk, block);
}

template <class Op>
__device__ __forceinline__ void walk(const Launch<typename Op::Args>& launch) {
  if constexpr (OwnWalk<Op>::value) Op::walk(launch);
  else walk_elements<Op>(launch);
}

}  // namespace mta

// Defines the kernel entry point NAME for functor OP (an op has one entry per pass).
#define MTA_DEFINE_ENTRY(NAME, OP)                                                  \
  extern "C" __global__ void __launch_bounds__(MTA_BLOCK, mta::MinBlocks<OP>::value) \
  NAME(const mta::Launch<OP::Args> launch) {                                        \
    const bool runs = mta::step_runs(launch);                                       \
    if (runs) mta::walk<OP>(launch);                                                \
    mta::count_step(launch, runs);                                                  \
  }

// The fused launch NAME of a two-pass op (walk_fused): the first pass's functor SUM, the
// update's UPDATE, one Args.
#define MTA_DEFINE_FUSED_ENTRY(NAME, SUM, UPDATE)                                        \
  static_assert(mta::Same<SUM::Args, UPDATE::Args>::value, "both passes take one Args"); \
  extern "C" __global__ void __launch_bounds__(MTA_BLOCK, mta::MinBlocks<UPDATE>::value)    \
  NAME(const mta::Launch<SUM::Args> launch) {                                               \
    const bool runs = mta::step_runs(launch);                                               \
    if (runs) mta::walk_fused<SUM, UPDATE>(launch);                                         \
    mta::count_step(launch, runs);                                                          \
  }
