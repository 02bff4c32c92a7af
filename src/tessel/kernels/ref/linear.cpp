// Reference linear layer: obvious loops with double accumulation, the oracle for cpu::linear.
#include <cstdint>

#include "tessel/kernels/linear.h"

namespace tessel::kernels::ref {

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC) {
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * IC;
    for (int o = 0; o < OC; ++o) {
      const float* w = weight + int64_t(o) * IC;
      double acc = bias != nullptr ? bias[o] : 0.0;
      for (int i = 0; i < IC; ++i) acc += double(x[i]) * w[i];
      out[int64_t(n) * OC + o] = float(acc);
    }
  }
}

void linear_backward_input(float* dinp, const float* dout, const float* weight, int N, int IC,
                           int OC) {
  for (int n = 0; n < N; ++n) {
    for (int i = 0; i < IC; ++i) {
      double acc = 0;
      for (int o = 0; o < OC; ++o)
        acc += double(dout[int64_t(n) * OC + o]) * weight[int64_t(o) * IC + i];
      dinp[int64_t(n) * IC + i] += float(acc);
    }
  }
}

void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                            int N, int IC, int OC) {
  for (int o = 0; o < OC; ++o) {
    for (int i = 0; i < IC; ++i) {
      double acc = 0;
      for (int n = 0; n < N; ++n)
        acc += double(dout[int64_t(n) * OC + o]) * inp[int64_t(n) * IC + i];
      dweight[int64_t(o) * IC + i] += float(acc);
    }
    if (dbias != nullptr) {
      double acc = 0;
      for (int n = 0; n < N; ++n) acc += dout[int64_t(n) * OC + o];
      dbias[o] += float(acc);
    }
  }
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  if (dinp != nullptr) linear_backward_input(dinp, dout, weight, N, IC, OC);
  linear_backward_weight(dweight, dbias, dout, inp, N, IC, OC);
}

}  // namespace tessel::kernels::ref
