// Reference linear layer: obvious loops with double accumulation, the oracle for cpu::linear.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tessel/kernels/linear.h"
#include "tessel/kernels/linear_bf16.h"

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

namespace {

// dbias[o] += sum_n dout[n, o], each column summed in double.
void bias_gradient(float* dbias, const float* dout, int N, int OC) {
  for (int o = 0; o < OC; ++o) {
    double acc = 0;
    for (int n = 0; n < N; ++n) acc += dout[int64_t(n) * OC + o];
    dbias[o] += float(acc);
  }
}

}  // namespace

void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                            int N, int IC, int OC) {
  for (int o = 0; o < OC; ++o) {
    for (int i = 0; i < IC; ++i) {
      double acc = 0;
      for (int n = 0; n < N; ++n)
        acc += double(dout[int64_t(n) * OC + o]) * inp[int64_t(n) * IC + i];
      dweight[int64_t(o) * IC + i] += float(acc);
    }
  }
  if (dbias != nullptr) bias_gradient(dbias, dout, N, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  if (dinp != nullptr) linear_backward_input(dinp, dout, weight, N, IC, OC);
  linear_backward_weight(dweight, dbias, dout, inp, N, IC, OC);
}

// ---- bf16 operands: the float loops on the operands rounded to bf16 and widened back ----

namespace {

std::vector<float> widened(const bf16* x, int64_t n) {
  std::vector<float> out(size_t(std::max<int64_t>(n, 0)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(x[i]);
  return out;
}

std::vector<float> rounded(const float* x, int64_t n) {
  std::vector<bf16> r(size_t(std::max<int64_t>(n, 0)));
  to_bf16(r.data(), x, n);
  return widened(r.data(), n);
}

}  // namespace

void to_bf16(bf16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void linear_forward_bf16(float* out, const float* inp, const bf16* weight, const float* bias, int N,
                         int IC, int OC) {
  linear_forward(out, rounded(inp, int64_t(N) * IC).data(),
                 widened(weight, int64_t(OC) * IC).data(), bias, N, IC, OC);
}

void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* weight, int N, int IC,
                                int OC) {
  linear_backward_input(dinp, rounded(dout, int64_t(N) * OC).data(),
                        widened(weight, int64_t(OC) * IC).data(), N, IC, OC);
}

void linear_backward_weight_bf16(float* dweight, float* dbias, const float* dout, const float* inp,
                                 int N, int IC, int OC) {
  linear_backward_weight(dweight, nullptr, rounded(dout, int64_t(N) * OC).data(),
                         rounded(inp, int64_t(N) * IC).data(), N, IC, OC);
  if (dbias != nullptr) bias_gradient(dbias, dout, N, OC);  // from the float dout, as autocast
}

}  // namespace tessel::kernels::ref
