// Reference activations, evaluated in double with libm's tanh and exp.
#include "tessel/kernels/activations.h"

#include <cmath>

namespace tessel::kernels::ref {

namespace {
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluCube = 0.044715;

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = inp[i];
    out[i] = float(0.5 * x * (1.0 + std::tanh(kGeluScale * (x + kGeluCube * x * x * x))));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = inp[i];
    const double th = std::tanh(kGeluScale * (x + kGeluCube * x * x * x));
    const double sech2 = 1.0 - th * th;
    const double grad =
        0.5 * (1.0 + th) + 0.5 * x * sech2 * kGeluScale * (1.0 + 3.0 * kGeluCube * x * x);
    dinp[i] += float(grad * dout[i]);
  }
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    out[i] = float(g * sigmoid(g) * up[i]);
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], s = sigmoid(g), d = dout[i];
    dgate[i] += float(d * up[i] * s * (1.0 + g * (1.0 - s)));
    dup[i] += float(d * g * s);
  }
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void residual_backward(float* da, float* db, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

}  // namespace tessel::kernels::ref
