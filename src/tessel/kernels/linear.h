// Linear layer: out[N,OC] = inp[N,IC] · weight[OC,IC]^T + bias[OC].
//
// weight is stored [out, in] like torch.nn.Linear (GPT-2's Conv1D checkpoints are transposed on
// import). bias may be null. Backward is split into the input gradient and the weight gradient so
// that zero-bubble schedules can run them at different times; linear_backward runs both.
#pragma once

namespace tessel::kernels {

#define TESSEL_LINEAR_SIGNATURES                                                                   \
  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N, \
                      int IC, int OC);                                                             \
  void linear_backward_input(float* dinp, const float* dout, const float* weight, int N, int IC,   \
                             int OC);                                                              \
  void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,   \
                              int N, int IC, int OC);                                              \
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout,               \
                       const float* inp, const float* weight, int N, int IC, int OC);

namespace ref {
TESSEL_LINEAR_SIGNATURES
}
namespace cpu {
TESSEL_LINEAR_SIGNATURES
}

}  // namespace tessel::kernels
