// Adam / AdamW with 8-bit blockwise-quantized moments: the Adam functor on the 8-bit walk
// (quantized.cuh). Slots: params, grads, exp_avgs (signed map), exp_avg_sqs (unsigned map),
// exp_avg_absmax, exp_avg_sq_absmax; params and grads float32 or 16-bit, bfloat16 params may be
// rounded stochastically. A group whose moments are float32 (small tensors) runs the plain Adam
// functor on the chunk walker.
#pragma once
#include "adam.cuh"
#include "quantized.cuh"

namespace mta {

struct Adam8bit : Quantized<Adam, (1u << Adam::EXP_AVG) | (1u << Adam::EXP_AVG_SQ), 1u << Adam::EXP_AVG_SQ> {};

}  // namespace mta
