// Fused softmax + cross-entropy over the vocabulary.
//
// logits are [N, Vp]; only the first V columns are real classes (the rest is vocabulary padding
// and excluded from the softmax). Rows whose target equals ignore_index are skipped. Writes the
// per-row loss to losses[N] (0 for ignored rows) and returns the sum over valid rows and their
// count, so callers can take the mean over valid tokens across micro-batches.
//
// When dlogits is not null it is OVERWRITTEN (it is the first gradient of backward, so there is
// nothing to accumulate into) with (softmax - onehot(target)) * grad_scale on valid rows and 0 on
// ignored rows and padding columns. dlogits may alias logits (in place, saving a [N, Vp] buffer).
// Targets must be in [0, V) or equal ignore_index; any other target throws InvalidArgumentError
// (an O(N) check, cheap next to the O(N·Vp) softmax, that keeps a bad id from reading out of
// bounds).
#pragma once

#include <cstdint>

namespace tessel::kernels {

struct CrossEntropyResult {
  double loss_sum = 0;
  int64_t valid = 0;
};

#define TESSEL_CROSS_ENTROPY_SIGNATURES                                                            \
  CrossEntropyResult cross_entropy(float* dlogits, float* losses, const float* logits,             \
                                   const int32_t* targets, int N, int V, int Vp, int ignore_index, \
                                   float grad_scale);

// Throws the InvalidArgumentError promised above for the first target outside [0, V) that is not
// ignore_index; `op` names the calling kernel in the message. Shared by every cross-entropy form.
void check_targets(const char* op, const int32_t* targets, int N, int V, int ignore_index);

namespace ref {
TESSEL_CROSS_ENTROPY_SIGNATURES
}
namespace cpu {
TESSEL_CROSS_ENTROPY_SIGNATURES
}

}  // namespace tessel::kernels
