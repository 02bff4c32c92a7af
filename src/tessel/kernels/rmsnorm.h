// RMSNorm over the last dimension: out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
#pragma once

namespace tessel::kernels {

#define TESSEL_RMSNORM_SIGNATURES                                                             \
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, \
                       int C, float eps);                                                     \
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,     \
                        const float* weight, const float* rstd, int N, int C);

namespace ref {
TESSEL_RMSNORM_SIGNATURES
}
namespace cpu {
TESSEL_RMSNORM_SIGNATURES
}

}  // namespace tessel::kernels
