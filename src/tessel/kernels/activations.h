// Pointwise activations and the residual add.
//
// GELU uses the tanh approximation of GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// SwiGLU: out = silu(gate) * up, silu(x) = x * sigmoid(x).
// Residual: out = a + b.
#pragma once

#include <cstdint>

namespace tessel::kernels {

#define TESSEL_ACTIVATION_SIGNATURES                                                   \
  void gelu_forward(float* out, const float* inp, int64_t n);                          \
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);     \
  void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);      \
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, \
                       const float* up, int64_t n);                                    \
  void residual_forward(float* out, const float* a, const float* b, int64_t n);        \
  void residual_backward(float* da, float* db, const float* dout, int64_t n);

namespace ref {
TESSEL_ACTIVATION_SIGNATURES
}
namespace cpu {
TESSEL_ACTIVATION_SIGNATURES
}

}  // namespace tessel::kernels
