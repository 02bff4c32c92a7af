// Rotary position embedding, Hugging Face LLaMA convention ("rotate_half"): for head dimension
// D, element i < D/2 pairs with i + D/2 and rotates by angle t * theta^(-2i/D) at position t.
//
// Applied in place to x [B, T, H, D] whose consecutive tokens are `stride` floats apart (so q and
// k can be rotated inside a fused QKV buffer). Backward rotates the gradient by the opposite
// angle, also in place (the exception to the accumulate contract: rotation is its own buffer's
// transform).
#pragma once

#include <cstdint>

namespace tessel::kernels {

#define TESSEL_ROPE_SIGNATURES                                                          \
  void rope_forward(float* x, int B, int T, int H, int D, int64_t stride, float theta); \
  void rope_backward(float* dx, int B, int T, int H, int D, int64_t stride, float theta);

namespace ref {
TESSEL_ROPE_SIGNATURES
}
namespace cpu {
TESSEL_ROPE_SIGNATURES
}

}  // namespace tessel::kernels
