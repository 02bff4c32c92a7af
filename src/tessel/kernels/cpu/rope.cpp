// Fast rotary embedding: the cos/sin table for (T, D, theta) is built once in double precision and
// cached per calling thread (forward and backward of every layer share it); the rotation itself
// is a vectorised pass over each head, parallel over tokens.
#include <cmath>
#include <cstdint>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/rope.h"

namespace tessel::kernels::cpu {

namespace {

struct RopeTable {
  int T = -1;  // positions covered
  int D = -1;
  float theta = 0.0f;
  std::vector<float> cos;  // [T, D/2]
  std::vector<float> sin;  // [T, D/2]
};

const RopeTable& rope_table(int T, int D, float theta) {
  thread_local RopeTable table;
  // Angles depend only on the position, so a table built for more tokens serves fewer.
  if (table.T >= T && table.D == D && table.theta == theta) return table;
  const int half = D / 2;
  table.cos.resize(size_t(T) * half);
  table.sin.resize(size_t(T) * half);
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(double(theta), -2.0 * i / D);
  float* cs = table.cos.data();
  float* sn = table.sin.data();
#pragma omp parallel for schedule(static) if (int64_t(T) * half > 4096)
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      double angle = t * inv_freq[i];
      cs[int64_t(t) * half + i] = float(std::cos(angle));
      sn[int64_t(t) * half + i] = float(std::sin(angle));
    }
  }
  table.T = T;
  table.D = D;
  table.theta = theta;
  return table;
}

// sign = +1 rotates forward, -1 applies the inverse rotation (the backward pass).
void rotate(float* x, int B, int T, int H, int D, int64_t stride, float theta, float sign) {
  TESSEL_CHECK(D % 2 == 0, InvalidArgumentError, "rope: head dimension {} must be even", D);
  if (B <= 0 || T <= 0 || H <= 0 || D <= 0) return;
  const RopeTable& table = rope_table(T, D, theta);
  const int half = D / 2;
  const float* cos_tab = table.cos.data();
  const float* sin_tab = table.sin.data();
#pragma omp parallel for collapse(2) schedule(static) if (int64_t(B) * T * H * D > 16384)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      float* token = x + (int64_t(b) * T + t) * stride;
      const float* c = cos_tab + int64_t(t) * half;
      const float* s = sin_tab + int64_t(t) * half;
      for (int h = 0; h < H; ++h) {
        float* x1 = token + int64_t(h) * D;
        float* x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; ++i) {
          float a = x1[i], b2 = x2[i], si = sign * s[i];
          x1[i] = a * c[i] - b2 * si;
          x2[i] = b2 * c[i] + a * si;
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int B, int T, int H, int D, int64_t stride, float theta) {
  rotate(x, B, T, H, D, stride, theta, 1.0f);
}

void rope_backward(float* dx, int B, int T, int H, int D, int64_t stride, float theta) {
  rotate(dx, B, T, H, D, stride, theta, -1.0f);
}

}  // namespace tessel::kernels::cpu
