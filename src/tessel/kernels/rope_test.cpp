#include "tessel/kernels/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <utility>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/attention_bounds.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::dot;
using testing::expect_gradient_matches;
using testing::max_abs_error;
using testing::random_normal;

using testing::within_bounds;

using testing::rope_component_bound;
using testing::rope_rotation_error;
using testing::RopeAngle;

struct Config {
  int B, T, H, D;
  int64_t stride;  // floats between tokens; > H*D leaves a gap the kernel must not touch
  float theta;
};

TEST(Rope, CpuMatchesReference) {
  uint64_t seed = 1;
  // Consecutive calls also exercise the cpu kernel's cached table: a shorter T after a longer
  // one reuses it, a new D or theta rebuilds it.
  const Config configs[] = {{2, 64, 3, 16, 3 * 16, 10000.0f},  {2, 13, 3, 16, 3 * 16 + 5, 10000.0f},
                            {1, 1, 2, 8, 16, 10000.0f},        {3, 13, 4, 2, 8, 500000.0f},
                            {2, 64, 2, 64, 3 * 128, 10000.0f}, {1, 300, 1, 128, 128, 10000.0f}};
  for (const Config& c : configs) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " H=" << c.H << " D=" << c.D
                                      << " stride=" << c.stride);
    const auto x = random_normal(size_t(c.B) * c.T * c.stride, seed++);
    for (auto [ref_fn, cpu_fn] : {std::pair{&ref::rope_forward, &cpu::rope_forward},
                                  std::pair{&ref::rope_backward, &cpu::rope_backward}}) {
      auto a = x, b = x;
      ref_fn(a.data(), c.B, c.T, c.H, c.D, c.stride, c.theta);
      cpu_fn(b.data(), c.B, c.T, c.H, c.D, c.stride, c.theta);
      const auto bound = testing::rope_bounds(x, c.B, c.T, c.H, c.D, c.stride, c.theta);
      EXPECT_TRUE(within_bounds(b, a, bound, "rotated"));
      // Entries between the heads of one token and the next are untouched.
      for (int64_t n = 0; n < int64_t(c.B) * c.T; ++n) {
        for (int64_t i = int64_t(c.H) * c.D; i < c.stride; ++i)
          ASSERT_EQ(b[n * c.stride + i], x[n * c.stride + i]);
      }
    }
  }
}

TEST(Rope, BackwardUndoesForward) {
  const int B = 2, T = 50, H = 3, D = 32;
  const auto x = random_normal(size_t(B) * T * H * D, 7);
  for (auto [fwd, bwd] : {std::pair{&ref::rope_forward, &ref::rope_backward},
                          std::pair{&cpu::rope_forward, &cpu::rope_backward}}) {
    auto y = x;
    fwd(y.data(), B, T, H, D, H * D, 10000.0f);
    EXPECT_GT(max_abs_error(y, x), 0.1);  // it did rotate
    bwd(y.data(), B, T, H, D, H * D, 10000.0f);
    // Forward gives y = R x + e (|e| <= rope_rotation_error), backward z = R^T y + e'; R^T R = I
    // for the exact cos and sin, so z - x = R^T e + e': |c| e1 + |s| e2 + rope_rotation_error of y.
    std::vector<double> bound(x.size());
    for (int64_t n = 0; n < int64_t(B) * T; ++n) {
      for (int h = 0; h < H; ++h) {
        for (int i = 0; i < D / 2; ++i) {
          const size_t i1 = size_t((n * H + h) * D + i), i2 = i1 + D / 2;
          const RopeAngle ang(int(n % T), i, D, 10000.0);
          const double x1 = x[i1], x2 = x[i2];
          const double e1 = rope_rotation_error(x1, x2, ang), e2 = rope_rotation_error(x2, x1, ang);
          // |y| bounds for the backward's own rounding.
          const double y1 = std::fabs(x1 * ang.c - x2 * ang.s) + e1;
          const double y2 = std::fabs(x2 * ang.c + x1 * ang.s) + e2;
          bound[i1] =
              std::fabs(ang.c) * e1 + std::fabs(ang.s) * e2 + rope_rotation_error(y1, y2, ang);
          bound[i2] =
              std::fabs(ang.c) * e2 + std::fabs(ang.s) * e1 + rope_rotation_error(y2, y1, ang);
        }
      }
    }
    EXPECT_TRUE(within_bounds(y, x, bound, "round trip"));
  }
}

TEST(Rope, MatchesComplexRotation) {
  // Pair (x[i], x[i + D/2]) as the complex number x[i] + i x[i + D/2]; rope multiplies it by
  // e^{i t theta^(-2i/D)}.
  const int B = 1, T = 257, H = 2, D = 16;
  const double theta = 10000.0;
  const auto x = random_normal(size_t(B) * T * H * D, 9);
  for (auto fwd : {&ref::rope_forward, &cpu::rope_forward}) {
    auto y = x;
    fwd(y.data(), B, T, H, D, H * D, float(theta));
    for (int t : {0, 1, 7, 256}) {
      for (int h = 0; h < H; ++h) {
        for (int i : {0, 3, D / 2 - 1}) {
          const size_t base = (size_t(t) * H + h) * D;
          const std::complex<double> z(x[base + i], x[base + i + D / 2]);
          const std::complex<double> r = z * std::polar(1.0, t * std::pow(theta, -2.0 * i / D));
          // The cpu kernel's rope_rotation_error (the reference's double rotation rounded once is
          // within it), plus this double evaluation's own: rope_component_bound covers both.
          const RopeAngle ang(t, i, D, theta);
          const double x1 = z.real(), x2 = z.imag();
          EXPECT_TRUE(testing::within_bound(y[base + i], r.real(),
                                            rope_component_bound(x1, x2, ang), "real"))
              << "t=" << t << " h=" << h << " i=" << i;
          EXPECT_TRUE(testing::within_bound(y[base + i + D / 2], r.imag(),
                                            rope_component_bound(x2, x1, ang), "imag"))
              << "t=" << t << " h=" << h << " i=" << i;
        }
      }
    }
  }
}

TEST(Rope, ReferenceBackwardMatchesFiniteDifferences) {
  const int B = 2, T = 4, H = 2, D = 6;
  const int64_t stride = H * D + 2;
  auto x = random_normal(size_t(B) * T * stride, 11);
  const auto w = random_normal(x.size(), 12);  // loss = sum(rope(x) * w)
  auto loss = [&] {
    auto y = x;
    ref::rope_forward(y.data(), B, T, H, D, stride, 10000.0f);
    return dot(y, w);
  };
  // dL/dx = R^T w: backward rotates the gradient w in place. Gaps between tokens pass through
  // rope unchanged, so their gradient is w itself.
  auto grad = w;
  ref::rope_backward(grad.data(), B, T, H, D, stride, 10000.0f);
  testing::GradcheckOptions opt;
  opt.samples = int(x.size());
  expect_gradient_matches("dx", x, grad, loss, opt);
}

TEST(Rope, OddHeadDimensionThrows) {
  std::vector<float> x(12);
  EXPECT_THROW(ref::rope_forward(x.data(), 1, 1, 4, 3, 12, 10000.0f), InvalidArgumentError);
  EXPECT_THROW(cpu::rope_backward(x.data(), 1, 1, 4, 3, 12, 10000.0f), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::kernels
