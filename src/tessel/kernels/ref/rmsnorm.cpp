// Reference RMSNorm: statistics and gradient reductions in double.
#include "tessel/kernels/rmsnorm.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace tessel::kernels::ref {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    float* o = out + int64_t(n) * C;
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += double(x[c]) * x[c];
    ms /= C;
    const double s = 1.0 / std::sqrt(ms + double(eps));
    for (int c = 0; c < C; ++c) o[c] = float(x[c] * s * weight[c]);
    rstd[n] = float(s);
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  std::vector<double> dw(C, 0.0);
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    const float* d = dout + int64_t(n) * C;
    float* dx = dinp + int64_t(n) * C;
    const double s = rstd[n];
    // y_i = x_i s w_i with s = (mean(x^2) + eps)^(-1/2), so ds/dx_j = -s^3 x_j / C.
    double dot = 0;
    for (int c = 0; c < C; ++c) dot += double(d[c]) * weight[c] * x[c];
    const double coef = s * s * s * dot / C;
    for (int c = 0; c < C; ++c) {
      dx[c] += float(double(d[c]) * weight[c] * s - coef * x[c]);
      dw[c] += double(d[c]) * x[c] * s;
    }
  }
  for (int c = 0; c < C; ++c) dweight[c] += float(dw[c]);
}

}  // namespace tessel::kernels::ref
