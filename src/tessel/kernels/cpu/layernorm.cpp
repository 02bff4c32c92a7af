// Fast LayerNorm: rows in parallel, vectorised row reductions in float.
//
// Backward computes dinp row-parallel, and dweight/dbias (sums over rows) parallel over blocks of
// channels, so no two threads write the same gradient entry and the summation order does not
// depend on the thread count.
#include "tessel/kernels/layernorm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tessel::kernels::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;  // floats; below this stay on one thread
constexpr int kChannelBlock = 32;
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, float eps) {
#pragma omp parallel for schedule(static) if (int64_t(N) * C >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    float* o = out + int64_t(n) * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int c = 0; c < C; ++c) sum += x[c];
    const float m = sum / float(C);
    // Two passes (variance of x - mean) rather than E[x^2] - E[x]^2, which cancels badly when
    // activations carry a large common offset.
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    const float s = 1.0f / std::sqrt(var / float(C) + eps);
    if (bias != nullptr) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c];
    }
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  const int blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel if (int64_t(N) * C >= kParallelMin)
  {
#pragma omp for schedule(static) nowait
    for (int n = 0; n < N; ++n) {
      const float* x = inp + int64_t(n) * C;
      const float* d = dout + int64_t(n) * C;
      float* dx = dinp + int64_t(n) * C;
      const float m = mean[n], s = rstd[n];
      float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int c = 0; c < C; ++c) {
        const float dnorm = weight[c] * d[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * ((x[c] - m) * s);
      }
      dnorm_mean /= float(C);
      dnorm_norm_mean /= float(C);
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        const float norm = (x[c] - m) * s;
        dx[c] += (weight[c] * d[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
#pragma omp for schedule(static)
    for (int blk = 0; blk < blocks; ++blk) {
      const int c0 = blk * kChannelBlock;
      const int width = std::min(kChannelBlock, C - c0);
      float dw[kChannelBlock] = {}, db[kChannelBlock] = {};
      for (int n = 0; n < N; ++n) {
        const float* x = inp + int64_t(n) * C + c0;
        const float* d = dout + int64_t(n) * C + c0;
        const float m = mean[n], s = rstd[n];
#pragma omp simd
        for (int j = 0; j < width; ++j) {
          dw[j] += (x[j] - m) * s * d[j];
          db[j] += d[j];
        }
      }
      for (int j = 0; j < width; ++j) dweight[c0 + j] += dw[j];
      if (dbias != nullptr) {
        for (int j = 0; j < width; ++j) dbias[c0 + j] += db[j];
      }
    }
  }
}

}  // namespace tessel::kernels::cpu
