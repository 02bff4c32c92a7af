// Fast AdamW, sum of squares and scaling over flat parameter/gradient buffers.
//
// AdamW is memory-bound (it reads p, g, m, v and writes p, m, v: 28 bytes per parameter), so it
// is one fused pass with no temporaries. Its body is written on 8-float GCC vector types because
// without -fno-math-errno the compiler refuses to vectorise a loop containing std::sqrt (errno
// must be set for negative inputs); on AVX the vector sqrt is one instruction.
#include "tessel/kernels/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace tessel::kernels::cpu {

namespace {

constexpr int64_t kParallelMin = 1 << 16;  // elements; below this stay on one thread
constexpr int64_t kSumChunk = 1 << 16;     // fixed reduction chunks: thread-count independent

using f32x8 = float __attribute__((vector_size(32)));

f32x8 load8(const float* p) {
  f32x8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

void store8(float* p, f32x8 x) {
  std::memcpy(p, &x, sizeof x);
}

f32x8 sqrt8(f32x8 x) {
#if defined(__AVX__)
  return _mm256_sqrt_ps(x);
#else
  for (int k = 0; k < 8; ++k) x[k] = std::sqrt(x[k]);
  return x;
#endif
}

// torch.optim.AdamW's arithmetic, with the bias corrections folded into two scalars:
//   p = p (1 - lr wd) - step_size m / (sqrt(v) / sqrt(bias2) + eps),  step_size = lr / bias1
struct AdamWScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, sqrt_bias2, eps;
};

AdamWScalars adamw_scalars(const AdamWConfig& cfg) {
  const double bias1 = 1.0 - std::pow(double(cfg.beta1), double(cfg.step));
  const double bias2 = 1.0 - std::pow(double(cfg.beta2), double(cfg.step));
  return {cfg.beta1,
          1.0f - cfg.beta1,
          cfg.beta2,
          1.0f - cfg.beta2,
          float(1.0 - double(cfg.lr) * double(cfg.weight_decay)),
          float(double(cfg.lr) / bias1),
          float(std::sqrt(bias2)),
          cfg.eps};
}

}  // namespace

void adamw_update(float* param, float* grad, float* m, float* v, int64_t n,
                  const AdamWConfig& cfg) {
  const AdamWScalars k = adamw_scalars(cfg);
  const float gs = cfg.grad_scale;
  const bool zero = cfg.zero_grad;
  const int64_t blocks = n / 8;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i = blk * 8;
    const f32x8 g = load8(grad + i) * gs;
    if (zero) store8(grad + i, f32x8{});
    const f32x8 mi = k.beta1 * load8(m + i) + k.one_minus_beta1 * g;
    const f32x8 vi = k.beta2 * load8(v + i) + k.one_minus_beta2 * (g * g);
    const f32x8 denom = sqrt8(vi) / k.sqrt_bias2 + k.eps;
    store8(param + i, load8(param + i) * k.decay - k.step_size * mi / denom);
    store8(m + i, mi);
    store8(v + i, vi);
  }
  for (int64_t i = blocks * 8; i < n; ++i) {
    const float g = grad[i] * gs;
    if (zero) grad[i] = 0.0f;
    const float mi = k.beta1 * m[i] + k.one_minus_beta1 * g;
    const float vi = k.beta2 * v[i] + k.one_minus_beta2 * (g * g);
    const float denom = std::sqrt(vi) / k.sqrt_bias2 + k.eps;
    param[i] = param[i] * k.decay - k.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

double sum_of_squares(const float* x, int64_t n) {
  // Partial sums over fixed chunks, added in chunk order: the result is bit-identical for any
  // thread count (an OpenMP reduction clause combines in completion order).
  const int64_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(chunks, 0.0);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const float* p = x + ch * kSumChunk;
    const int64_t len = std::min(kSumChunk, n - ch * kSumChunk);
    // 16 independent lanes (four 4-double vectors) hide the FMA latency that a single vector
    // accumulator would serialise on; the lane order is fixed, so the result is deterministic.
    double lanes[16] = {};
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
      for (int j = 0; j < 16; ++j) lanes[j] += double(p[i + j]) * double(p[i + j]);
    }
    double s = 0.0;
    for (; i < len; ++i) s += double(p[i]) * double(p[i]);
    for (int j = 0; j < 16; ++j) s += lanes[j];
    partial[ch] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

void scale(float* x, int64_t n, float factor) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace tessel::kernels::cpu

namespace tessel::kernels {

float clip_factor(double total_norm, float max_norm) {
  if (!(max_norm > 0.0f)) return 1.0f;
  // torch: clamp(max_norm / (norm + 1e-6), max=1). A NaN norm propagates (NaN factor) rather than
  // silently skipping the clip, so a diverged step stays visible.
  const double coef = double(max_norm) / (total_norm + 1e-6);
  return coef >= 1.0 ? 1.0f : float(coef);
}

}  // namespace tessel::kernels
