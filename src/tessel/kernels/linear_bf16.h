// The linear layer in mixed precision (issue 21), as torch.autocast runs it: the GEMM's operands
// are rounded to bf16, its products accumulate in float, and everything stored -- activations,
// gradients, bias -- stays float. The weight comes already rounded (a bf16 copy of the float
// master weight, made once per optimizer step by to_bf16 below); activations and output
// gradients are rounded inside each call, into scratch that grows to the largest call and then
// stays (no allocation per call in steady state).
//
// Shapes and accumulation as in linear.h: out[N,OC] = bf16(inp)[N,IC] · weight[OC,IC]^T + bias;
// backward accumulates dinp += bf16(dout) · weight and dweight += bf16(dout)^T · bf16(inp).
// ref:: computes the same rounded operands' products in double: the rounding to bf16 is the same
// deterministic round-to-nearest-even on both sides, so cpu:: differs from ref:: only by its
// float accumulation.
#pragma once

#include <cstdint>

#include "tessel/tensor/dtype.h"

namespace tessel::kernels {

#define TESSEL_LINEAR_BF16_SIGNATURES                                                           \
  void linear_forward_bf16(float* out, const float* inp, const bf16* weight, const float* bias, \
                           int N, int IC, int OC);                                              \
  void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* weight, int N,    \
                                  int IC, int OC);                                              \
  void linear_backward_weight_bf16(float* dweight, float* dbias, const float* dout,             \
                                   const float* inp, int N, int IC, int OC);                    \
  /* dst[i] = bf16(src[i]), round to nearest even (NaN stays NaN). */                           \
  void to_bf16(bf16* dst, const float* src, int64_t n);

namespace ref {
TESSEL_LINEAR_BF16_SIGNATURES
}
namespace cpu {
TESSEL_LINEAR_BF16_SIGNATURES
}

}  // namespace tessel::kernels
