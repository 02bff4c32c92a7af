// Reference AdamW and gradient-norm helpers, evaluated in double.
#include "tessel/kernels/optimizer.h"

#include <cmath>

namespace tessel::kernels::ref {

void adamw_update(float* param, float* grad, float* m, float* v, int64_t n,
                  const AdamWConfig& cfg) {
  const double b1 = cfg.beta1, b2 = cfg.beta2, lr = cfg.lr;
  const double bias1 = 1.0 - std::pow(b1, double(cfg.step));
  const double bias2 = 1.0 - std::pow(b2, double(cfg.step));
  for (int64_t i = 0; i < n; ++i) {
    // The scale is a float multiply, exactly as a separate scale() pass would apply it.
    const double g = grad[i] * cfg.grad_scale;
    if (cfg.zero_grad) grad[i] = 0.0f;
    const double mi = b1 * m[i] + (1.0 - b1) * g;
    const double vi = b2 * v[i] + (1.0 - b2) * g * g;
    const double p = param[i];
    const double update = (mi / bias1) / (std::sqrt(vi / bias2) + double(cfg.eps));
    param[i] = float(p - lr * (update + double(cfg.weight_decay) * p));
    m[i] = float(mi);
    v[i] = float(vi);
  }
}

double sum_of_squares(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return s;
}

void scale(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace tessel::kernels::ref
