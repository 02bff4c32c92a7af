// LayerNorm over the last dimension: out = (x - mean) * rstd * weight + bias.
//
// mean[N] and rstd[N] are saved for backward. bias may be null (and dbias then is ignored).
#pragma once

namespace tessel::kernels {

#define TESSEL_LAYERNORM_SIGNATURES                                                        \
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,           \
                         const float* weight, const float* bias, int N, int C, float eps); \
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,    \
                          const float* inp, const float* weight, const float* mean,        \
                          const float* rstd, int N, int C);

namespace ref {
TESSEL_LAYERNORM_SIGNATURES
}
namespace cpu {
TESSEL_LAYERNORM_SIGNATURES
}

}  // namespace tessel::kernels
