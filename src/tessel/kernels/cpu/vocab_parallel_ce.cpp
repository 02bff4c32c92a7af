// Fast vocabulary-parallel cross-entropy steps: rows in parallel, vectorised passes over a row
// like cpu::cross_entropy (max; exp and sum in L1-sized blocks; normalise). The exps are computed
// twice, in step 2 (for the sum) and step 3 (for the gradient), because the global maximum and
// sum arrive in between and the logits must stay intact for the in-place step 3; one extra pass
// over a 1/tp-th of the vocabulary.
//
// In place (dlogits == logits) is safe in step 3: element v is read before it is written, and the
// target logit comes from `sums`, not from the row.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/cpu/vec_math.h"
#include "tessel/kernels/vocab_parallel_ce.h"

namespace tessel::kernels::cpu {

namespace {

int real_columns(int V, int vocab_start, int rows) {
  return std::clamp(V - vocab_start, 0, rows);
}

bool parallel(int N, int rows) {
  return int64_t(N) * rows >= (1 << 16);
}

}  // namespace

void vp_ce_local_max(float* row_max, const float* logits, const int32_t* targets, int N, int V,
                     int vocab_start, int rows, int ignore_index) {
  check_targets("vocab-parallel cross_entropy", targets, N, V, ignore_index);
  const int real = real_columns(V, vocab_start, rows);
#pragma omp parallel for schedule(static) if (parallel(N, rows))
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    float mx = -INFINITY;
    if (targets[n] != ignore_index) {
      // A compare-select (not std::max) so that GCC vectorises the reduction to vmaxps.
#pragma omp simd reduction(max : mx)
      for (int v = 0; v < real; ++v) mx = x[v] > mx ? x[v] : mx;
    }
    row_max[n] = mx;
  }
}

void vp_ce_local_sums(float* sums, const float* logits, const float* row_max,
                      const int32_t* targets, int N, int V, int vocab_start, int rows,
                      int ignore_index) {
  const int real = real_columns(V, vocab_start, rows);
#pragma omp parallel for schedule(static) if (parallel(N, rows))
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    double sum = 0.0;
    float target_logit = 0.0f;
    if (targets[n] != ignore_index) {
      const float mx = row_max[n];
      sum = sum_exp(x, real, mx, nullptr);
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
  // Per-row losses in double, summed in row order afterwards: the total does not depend on the
  // thread count or on the order threads finish.
  std::vector<double> row_loss(size_t(N), 0.0);
#pragma omp parallel for schedule(static) if (parallel(N, rows))
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * rows;
    float* dx = dlogits != nullptr ? dlogits + int64_t(n) * rows : nullptr;
    if (targets[n] == ignore_index) {
      losses[n] = 0.0f;
      if (dx != nullptr) std::fill(dx, dx + rows, 0.0f);
      continue;
    }
    const float mx = row_max[n];
    const double loss = std::log(double(sums[n])) + double(mx) - double(sums[N + n]);
    losses[n] = float(loss);
    row_loss[size_t(n)] = loss;
    if (dx != nullptr) {
      const float norm = float(grad_scale / double(sums[n]));
#pragma omp simd
      for (int v = 0; v < real; ++v) dx[v] = fast_exp(x[v] - mx) * norm;
      const int local_target = targets[n] - vocab_start;
      if (local_target >= 0 && local_target < real) dx[local_target] -= grad_scale;
      std::fill(dx + real, dx + rows, 0.0f);
    }
  }
  CrossEntropyResult result;
  for (int n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    result.loss_sum += row_loss[size_t(n)];
    result.valid += 1;
  }
  return result;
}

}  // namespace tessel::kernels::cpu
