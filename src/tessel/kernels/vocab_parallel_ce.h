// Vocabulary-parallel softmax cross-entropy (Megatron-LM), as three local steps.
//
// With tensor parallelism the head's [N, Vp] logits are split by columns: a rank holds columns
// [vocab_start, vocab_start + rows) as a dense [N, rows] array. The softmax needs two reductions
// over all columns, which the caller performs between the steps (the kernels never communicate):
//
//   1. vp_ce_local_max:  row_max[n] = max of the shard's REAL columns of row n (global index < V);
//                        -inf when the shard has none (it may hold only vocabulary padding) or
//                        the row is ignored.                      then all-reduce MAX row_max[N]
//   2. vp_ce_local_sums: sums[n]     = sum over the shard's real columns of exp(x - row_max[n]),
//                        sums[N + n] = x[target - vocab_start] when this shard holds the target,
//                        else 0 (exactly one shard holds it). 0 for ignored rows.
//                                                                 then all-reduce SUM sums[2N]
//   3. vp_ce_finish:     losses[n] = log(sums[n]) + row_max[n] - sums[N + n] (0 for ignored rows)
//                        on every rank alike; the sum over valid rows and their count are
//                        returned (also identical on every rank). When dlogits is not null it is
//                        OVERWRITTEN, for this shard only, with (softmax - onehot(target)) *
//                        grad_scale on valid rows and 0 on ignored rows and padding columns.
//                        dlogits may alias logits (in place).
//
// With one shard (vocab_start 0, rows Vp) and no reductions the steps compute cross_entropy()
// (cross_entropy.h) up to rounding: the shard sums travel as floats.
//
// Targets must be in [0, V) or equal ignore_index: step 1 throws InvalidArgumentError otherwise,
// before any communication, so that all ranks (which see the same targets) fail at the same point.
// Shapes: logits, dlogits [N, rows]; row_max [N]; sums [2N]; losses [N].
#pragma once

#include <cstdint>

#include "tessel/kernels/cross_entropy.h"

namespace tessel::kernels {

#define TESSEL_VOCAB_PARALLEL_CE_SIGNATURES                                                        \
  void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,  \
                       int vocab_start, int rows, int ignore_index);                               \
  void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,                    \
                        const int32_t* targets, int N, int V, int vocab_start, int rows,           \
                        int ignore_index);                                                         \
  CrossEntropyResult vp_ce_finish(float* dlogits, float* losses, const float* logits,              \
                                  const float* row_max, const float* sums, const int32_t* targets, \
                                  int N, int V, int vocab_start, int rows, int ignore_index,       \
                                  float grad_scale);

namespace ref {
TESSEL_VOCAB_PARALLEL_CE_SIGNATURES
}
namespace cpu {
TESSEL_VOCAB_PARALLEL_CE_SIGNATURES
}

}  // namespace tessel::kernels
