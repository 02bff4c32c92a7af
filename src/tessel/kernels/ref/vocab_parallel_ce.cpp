// Reference vocabulary-parallel cross-entropy steps: obvious loops in double, the oracle for the
// fast kernel. Each row is read fully before dlogits is written, so dlogits may alias logits.
#include <algorithm>
#include <cmath>

#include "tessel/core/check.h"
#include "tessel/kernels/vocab_parallel_ce.h"

namespace tessel::kernels::ref {

namespace {

// Columns of the shard that are real classes (the rest is vocabulary padding).
int real_columns(int V, int vocab_start, int rows) {
  return std::clamp(V - vocab_start, 0, rows);
}

}  // namespace

void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,
                     int vocab_start, int rows, int ignore_index) {
  check_targets("vocab-parallel cross_entropy", targets, N, V, ignore_index);
  const int real = real_columns(V, vocab_start, rows);
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    float mx = -INFINITY;
    if (targets[n] != ignore_index) {
      for (int v = 0; v < real; ++v) mx = std::fmax(mx, x[v]);
    }
    row_max[n] = mx;
  }
}

void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                      const int32_t* targets, int N, int V, int vocab_start, int rows,
                      int ignore_index) {
  const int real = real_columns(V, vocab_start, rows);
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    double sum = 0;
    float target_logit = 0.0f;
    if (targets[n] != ignore_index) {
      for (int v = 0; v < real; ++v) sum += std::exp(double(x[v]) - double(row_max[n]));
      const int local = targets[n] - vocab_start;
      if (local >= 0 && local < real) target_logit = x[local];
    }
    sums[n] = float(sum);
    sums[N + n] = target_logit;
  }
}

CrossEntropyResult vp_ce_finish(float* dlogits, float* losses, const float* logits,
                                const float* row_max, const float* sums, const int32_t* targets,
                                int N, int V, int vocab_start, int rows, int ignore_index,
                                float grad_scale) {
  const int real = real_columns(V, vocab_start, rows);
  CrossEntropyResult result;
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    float* dx = dlogits != nullptr ? dlogits + int64_t(n) * rows : nullptr;
    if (targets[n] == ignore_index) {
      losses[n] = 0.0f;
      if (dx != nullptr) {
        for (int v = 0; v < rows; ++v) dx[v] = 0.0f;
      }
      continue;
    }
    const double mx = row_max[n], sum = sums[n];
    const double loss = std::log(sum) + mx - double(sums[N + n]);
    losses[n] = float(loss);
    result.loss_sum += loss;
    result.valid += 1;
    if (dx != nullptr) {
      const int local_target = targets[n] - vocab_start;
      for (int v = 0; v < real; ++v) {
        const double p = std::exp(double(x[v]) - mx) / sum;
        dx[v] = float((p - (v == local_target ? 1.0 : 0.0)) * grad_scale);
      }
      for (int v = real; v < rows; ++v) dx[v] = 0.0f;
    }
  }
  return result;
}

}  // namespace tessel::kernels::ref
