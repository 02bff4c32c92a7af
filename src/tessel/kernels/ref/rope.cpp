// Reference rotary embedding: every angle computed from scratch in double.
#include <cmath>
#include <cstdint>

#include "tessel/core/check.h"
#include "tessel/kernels/rope.h"

namespace tessel::kernels::ref {

namespace {

// Rotates each (x[i], x[i + D/2]) pair of every head by sign * t * theta^(-2i/D).
void rotate(float* x, int B, int T, int H, int D, int64_t stride, float theta, double sign) {
  TESSEL_CHECK(D % 2 == 0, InvalidArgumentError, "rope: head dimension {} must be even", D);
  const int half = D / 2;
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      float* token = x + (int64_t(b) * T + t) * stride;
      for (int h = 0; h < H; ++h) {
        float* head = token + int64_t(h) * D;
        for (int i = 0; i < half; ++i) {
          double inv_freq = std::pow(double(theta), -2.0 * i / D);
          double angle = sign * t * inv_freq;
          double c = std::cos(angle), s = std::sin(angle);
          double x1 = head[i], x2 = head[i + half];
          head[i] = float(x1 * c - x2 * s);
          head[i + half] = float(x2 * c + x1 * s);
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int B, int T, int H, int D, int64_t stride, float theta) {
  rotate(x, B, T, H, D, stride, theta, 1.0);
}

void rope_backward(float* dx, int B, int T, int H, int D, int64_t stride, float theta) {
  // The rotation is orthogonal, so its gradient is the inverse rotation.
  rotate(dx, B, T, H, D, stride, theta, -1.0);
}

}  // namespace tessel::kernels::ref
