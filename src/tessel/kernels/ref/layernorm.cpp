// Reference LayerNorm: statistics and gradient reductions in double.
#include "tessel/kernels/layernorm.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace tessel::kernels::ref {

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps) {
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    float* o = out + int64_t(n) * C;
    double m = 0;
    for (int c = 0; c < C; ++c) m += x[c];
    m /= C;
    double var = 0;
    for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    var /= C;
    const double s = 1.0 / std::sqrt(var + double(eps));
    for (int c = 0; c < C; ++c) {
      o[c] = float((x[c] - m) * s * weight[c] + (bias != nullptr ? bias[c] : 0.0f));
    }
    mean[n] = float(m);
    rstd[n] = float(s);
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  std::vector<double> dw(C, 0.0), db(C, 0.0);
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    const float* d = dout + int64_t(n) * C;
    float* dx = dinp + int64_t(n) * C;
    const double m = mean[n], s = rstd[n];
    // y = norm * w + b with norm = (x - mean) * rstd; the two row means below are the
    // projections of dnorm that mean and rstd's dependence on x remove.
    double dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int c = 0; c < C; ++c) {
      const double norm = (x[c] - m) * s;
      const double dnorm = double(weight[c]) * d[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int c = 0; c < C; ++c) {
      const double norm = (x[c] - m) * s;
      const double dnorm = double(weight[c]) * d[c];
      dx[c] += float((dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
      dw[c] += norm * d[c];
      db[c] += d[c];
    }
  }
  for (int c = 0; c < C; ++c) {
    dweight[c] += float(dw[c]);
    if (dbias != nullptr) dbias[c] += float(db[c]);
  }
}

}  // namespace tessel::kernels::ref
