// Fast RMSNorm: rows in parallel, vectorised row reductions in float. Backward splits like
// LayerNorm's: dinp over rows, dweight over channel blocks (race-free, thread-count independent).
#include "tessel/kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tessel::kernels::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;  // floats; below this stay on one thread
constexpr int kChannelBlock = 32;
}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
#pragma omp parallel for schedule(static) if (int64_t(N) * C >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    const float* x = inp + int64_t(n) * C;
    float* o = out + int64_t(n) * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; ++c) ss += x[c] * x[c];
    const float s = 1.0f / std::sqrt(ss / float(C) + eps);
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  const int blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel if (int64_t(N) * C >= kParallelMin)
  {
#pragma omp for schedule(static) nowait
    for (int n = 0; n < N; ++n) {
      const float* x = inp + int64_t(n) * C;
      const float* d = dout + int64_t(n) * C;
      float* dx = dinp + int64_t(n) * C;
      const float s = rstd[n];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < C; ++c) dot += d[c] * weight[c] * x[c];
      // d rstd / d x_j = -rstd^3 x_j / C
      const float coef = s * s * s * dot / float(C);
#pragma omp simd
      for (int c = 0; c < C; ++c) dx[c] += d[c] * weight[c] * s - coef * x[c];
    }
#pragma omp for schedule(static)
    for (int blk = 0; blk < blocks; ++blk) {
      const int c0 = blk * kChannelBlock;
      const int width = std::min(kChannelBlock, C - c0);
      float dw[kChannelBlock] = {};
      for (int n = 0; n < N; ++n) {
        const float* x = inp + int64_t(n) * C + c0;
        const float* d = dout + int64_t(n) * C + c0;
        const float s = rstd[n];
#pragma omp simd
        for (int j = 0; j < width; ++j) dw[j] += x[j] * s * d[j];
      }
      for (int j = 0; j < width; ++j) dweight[c0 + j] += dw[j];
    }
  }
}

}  // namespace tessel::kernels::cpu
