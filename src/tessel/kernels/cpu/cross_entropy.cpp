// Fast fused softmax + cross-entropy: rows in parallel, three vectorised passes over a row
// (max; exp and sum; normalise), each exp computed once with fast_exp. A [Vp] row is ~200 KB at
// GPT-2 sizes, so passes two and three hit the L2 cache rather than memory.
//
// In place (dlogits == logits) is safe: every pass reads element v before writing element v, and
// the target logit is read before the row is overwritten.
#include "tessel/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/cpu/vec_math.h"

namespace tessel::kernels::cpu {

CrossEntropyResult cross_entropy(float* dlogits, float* losses, const float* logits,
                                 const int32_t* targets, int N, int V, int Vp, int ignore_index,
                                 float grad_scale) {
  check_targets("cross_entropy", targets, N, V, ignore_index);
  // Per-row losses in double, summed in row order afterwards: the total does not depend on the
  // thread count or on the order threads finish.
  std::vector<double> row_loss(N, 0.0);
#pragma omp parallel for schedule(static) if (int64_t(N) * Vp >= (1 << 16))
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * Vp;
    float* dx = dlogits != nullptr ? dlogits + int64_t(n) * Vp : nullptr;
    const int target = targets[n];
    if (target == ignore_index) {
      losses[n] = 0.0f;
      if (dx != nullptr) std::fill(dx, dx + Vp, 0.0f);
      continue;
    }
    const float x_target = x[target];
    // Written as a compare-select (not std::max) so that GCC maps it to vmaxps and vectorises the
    // reduction; a NaN logit still reaches the loss through the exp pass below.
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = x[v] > mx ? x[v] : mx;
    // exp(x - max) goes straight into dlogits when it is wanted (normalised below).
    const double sum = sum_exp(x, V, mx, dx);
    if (dx != nullptr) {
      const float norm = float(grad_scale / sum);
#pragma omp simd
      for (int v = 0; v < V; ++v) dx[v] *= norm;
      dx[target] -= grad_scale;
      std::fill(dx + V, dx + Vp, 0.0f);
    }
    const double loss = std::log(sum) + double(mx) - double(x_target);
    losses[n] = float(loss);
    row_loss[n] = loss;
  }
  CrossEntropyResult result;
  for (int n = 0; n < N; ++n) {
    if (targets[n] == ignore_index) continue;
    result.loss_sum += row_loss[n];
    result.valid += 1;
  }
  return result;
}

}  // namespace tessel::kernels::cpu
