// Causal multi-head self-attention with grouped-query heads (GQA).
//
// q is [B, T, Hq, D], k and v are [B, T, Hkv, D]; consecutive tokens of q are q_stride floats
// apart and of k/v kv_stride floats apart, so the kernel reads q, k, v straight out of a fused QKV
// projection (stride 3C) or out of separate buffers (stride Hq*D, Hkv*D). Query head h uses
// key/value head h / (Hq / Hkv). Scores are scaled by 1/sqrt(D) and masked causally.
//
// out is [B, T, Hq*D] contiguous. probs [B, Hq, T, T] keeps the softmax for backward (entries
// above the diagonal are written as 0). dq uses q_stride and dk, dv use kv_stride; all accumulate.
#pragma once

#include <cstdint>

namespace tessel::kernels {

#define TESSEL_ATTENTION_SIGNATURES                                                                \
  void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v, \
                         int B, int T, int Hq, int Hkv, int D, int64_t q_stride,                   \
                         int64_t kv_stride);                                                       \
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,  \
                          const float* q, const float* k, const float* v, int B, int T, int Hq,    \
                          int Hkv, int D, int64_t q_stride, int64_t kv_stride);

namespace ref {
TESSEL_ATTENTION_SIGNATURES
}
namespace cpu {
TESSEL_ATTENTION_SIGNATURES
}

}  // namespace tessel::kernels
