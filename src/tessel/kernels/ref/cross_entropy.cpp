// Reference softmax cross-entropy in double; reads each row fully before writing dlogits, so
// dlogits may alias logits.
#include "tessel/kernels/cross_entropy.h"

#include <cmath>

#include "tessel/core/check.h"

namespace tessel::kernels::ref {

CrossEntropyResult cross_entropy(float* dlogits, float* losses, const float* logits,
                                 const int32_t* targets, int N, int V, int Vp, int ignore_index,
                                 float grad_scale) {
  CrossEntropyResult result;
  check_targets("cross_entropy", targets, N, V, ignore_index);
  for (int n = 0; n < N; ++n) {
    const float* x = logits + int64_t(n) * Vp;
    float* dx = dlogits != nullptr ? dlogits + int64_t(n) * Vp : nullptr;
    const int target = targets[n];
    if (target == ignore_index) {
      losses[n] = 0.0f;
      if (dx != nullptr) {
        for (int v = 0; v < Vp; ++v) dx[v] = 0.0f;
      }
      continue;
    }
    double mx = -INFINITY;
    for (int v = 0; v < V; ++v) mx = std::fmax(mx, double(x[v]));
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
    const double loss = std::log(sum) + mx - x[target];
    losses[n] = float(loss);
    result.loss_sum += loss;
    result.valid += 1;
    if (dx != nullptr) {
      for (int v = 0; v < V; ++v) {
        const double p = std::exp(x[v] - mx) / sum;
        dx[v] = float((p - (v == target ? 1.0 : 0.0)) * grad_scale);
      }
      for (int v = V; v < Vp; ++v) dx[v] = 0.0f;
    }
  }
  return result;
}

}  // namespace tessel::kernels::ref
