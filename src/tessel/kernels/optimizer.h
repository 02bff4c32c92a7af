// AdamW (decoupled weight decay, bias correction) and global gradient-norm clipping.
//
// adamw_update, for step t >= 1, with g = grad * grad_scale:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p -= lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + weight_decay * p )
// (torch.optim.AdamW's order: decay uses p before the update.)
//
// Clipping: the global norm is sqrt of the sum of squares over all gradients (summed in double,
// across buffers and, later, across ranks); when it exceeds max_norm every gradient is scaled by
// max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_ does.
#pragma once

#include <cstdint>

namespace tessel::kernels {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;  // 1-based, for bias correction
  // Gradient-clipping factor applied to every gradient as it is read (g = grad * grad_scale):
  // the same float multiply as a separate scale() pass, without the extra pass over memory.
  float grad_scale = 1.0f;
  // Write 0 to each gradient after reading it, leaving the gradients zeroed for the next step
  // (again saving a separate pass: the gradient lines are in cache at that moment).
  bool zero_grad = false;
};

#define TESSEL_OPTIMIZER_SIGNATURES                                           \
  void adamw_update(float* param, float* grad, float* m, float* v, int64_t n, \
                    const AdamWConfig& cfg);                                  \
  double sum_of_squares(const float* x, int64_t n);                           \
  void scale(float* x, int64_t n, float factor);

namespace ref {
TESSEL_OPTIMIZER_SIGNATURES
}
namespace cpu {
TESSEL_OPTIMIZER_SIGNATURES
}

// The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by:
// min(1, max_norm / (total_norm + 1e-6)); 1 when max_norm <= 0 (clipping disabled); NaN for a
// NaN norm, so a diverged step stays visible.
float clip_factor(double total_norm, float max_norm);

}  // namespace tessel::kernels
