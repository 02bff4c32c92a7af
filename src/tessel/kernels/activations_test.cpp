#include "tessel/kernels/activations.h"

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::max_rel_error;
using testing::random_normal;

// Sizes: tiny, odd (vector tails), and above the kernels' parallel threshold.
const int64_t kSizes[] = {1, 7, 33, 1000, 100003};

// Local derivatives are sums of O(1) terms that cancel to zero at points (gelu' at x = -0.75,
// silu' at -1.28), so gradients are compared against max(|ref|, 1): absolutely near zero.
constexpr double kGradFloor = 1.0;

// N(0, 3) values followed by a dense grid over [-12, 12], which covers both saturated tails.
std::vector<float> activation_inputs(int64_t n, uint64_t seed) {
  auto x = random_normal(size_t(n), seed, 3.0f);
  if (n >= 1000) {
    const int64_t grid = n / 2;
    for (int64_t i = 0; i < grid; ++i) x[size_t(i)] = -12.0f + 24.0f * float(i) / float(grid);
  }
  return x;
}

TEST(Gelu, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto x = activation_inputs(n, 1);
    std::vector<float> out_r(n), out_c(n);
    ref::gelu_forward(out_r.data(), x.data(), n);
    cpu::gelu_forward(out_c.data(), x.data(), n);
    // The fast path (x * sigmoid(2u), polynomial exp, u formed in double) stays within ~6e-7
    // relative even in the negative tail, where gelu amplifies errors in u ~15-fold.
    EXPECT_LE(max_rel_error(out_c, out_r, 1e-6), 1e-6);

    auto dout = random_normal(n, 2);
    std::vector<float> dinp_r(n, 0.0f), dinp_c(n, 0.0f);
    ref::gelu_backward(dinp_r.data(), x.data(), dout.data(), n);
    cpu::gelu_backward(dinp_c.data(), x.data(), dout.data(), n);
    EXPECT_LE(max_rel_error(dinp_c, dinp_r, kGradFloor), 1e-6);
  }
}

TEST(Swiglu, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto gate = activation_inputs(n, 11);
    auto up = random_normal(n, 12);
    std::vector<float> out_r(n), out_c(n);
    ref::swiglu_forward(out_r.data(), gate.data(), up.data(), n);
    cpu::swiglu_forward(out_c.data(), gate.data(), up.data(), n);
    EXPECT_LE(max_rel_error(out_c, out_r, 1e-6), 1e-6);

    auto dout = random_normal(n, 13);
    std::vector<float> dgate_r(n, 0.0f), dup_r(n, 0.0f), dgate_c(n, 0.0f), dup_c(n, 0.0f);
    ref::swiglu_backward(dgate_r.data(), dup_r.data(), dout.data(), gate.data(), up.data(), n);
    cpu::swiglu_backward(dgate_c.data(), dup_c.data(), dout.data(), gate.data(), up.data(), n);
    EXPECT_LE(max_rel_error(dgate_c, dgate_r, kGradFloor), 1e-6);
    EXPECT_LE(max_rel_error(dup_c, dup_r, kGradFloor), 1e-6);
  }
}

TEST(Residual, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto a = random_normal(n, 21), b = random_normal(n, 22);
    std::vector<float> out_r(n), out_c(n);
    ref::residual_forward(out_r.data(), a.data(), b.data(), n);
    cpu::residual_forward(out_c.data(), a.data(), b.data(), n);
    EXPECT_EQ(out_c, out_r);
    auto dout = random_normal(n, 23);
    auto da_r = random_normal(n, 24), db_r = random_normal(n, 25);
    auto da_c = da_r, db_c = db_r;
    ref::residual_backward(da_r.data(), db_r.data(), dout.data(), n);
    cpu::residual_backward(da_c.data(), db_c.data(), dout.data(), n);
    EXPECT_EQ(da_c, da_r);
    EXPECT_EQ(db_c, db_r);
  }
}

// Every backward adds into its gradient buffers: from pre-filled buffers the result is the
// pre-filled values plus what a zeroed run produces.
TEST(Activations, BackwardAccumulatesIntoGradients) {
  const int64_t n = 37;
  auto x = random_normal(n, 31), y = random_normal(n, 32), dout = random_normal(n, 33);
  auto pre1 = random_normal(n, 34), pre2 = random_normal(n, 35);
  using TwoGrad = std::function<void(float*, float*)>;
  const std::vector<std::pair<const char*, TwoGrad>> ops = {
      {"ref gelu", [&](float* g1, float*) { ref::gelu_backward(g1, x.data(), dout.data(), n); }},
      {"cpu gelu", [&](float* g1, float*) { cpu::gelu_backward(g1, x.data(), dout.data(), n); }},
      {"ref swiglu",
       [&](float* g1, float* g2) {
         ref::swiglu_backward(g1, g2, dout.data(), x.data(), y.data(), n);
       }},
      {"cpu swiglu",
       [&](float* g1, float* g2) {
         cpu::swiglu_backward(g1, g2, dout.data(), x.data(), y.data(), n);
       }},
      {"ref residual",
       [&](float* g1, float* g2) { ref::residual_backward(g1, g2, dout.data(), n); }},
      {"cpu residual",
       [&](float* g1, float* g2) { cpu::residual_backward(g1, g2, dout.data(), n); }},
  };
  for (const auto& [name, backward] : ops) {
    std::vector<float> z1(n, 0.0f), z2(n, 0.0f);
    backward(z1.data(), z2.data());
    auto a1 = pre1, a2 = pre2;
    backward(a1.data(), a2.data());
    for (int64_t i = 0; i < n; ++i) {
      // Not bit-exact: the kernel may fuse its product into the add (FMA).
      EXPECT_NEAR(a1[i], pre1[i] + z1[i], 1e-6) << name;
      EXPECT_NEAR(a2[i], pre2[i] + z2[i], 1e-6) << name;
    }
  }
}

TEST(Activations, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t n = 41;
  auto x = random_normal(n, 41, 2.0f), y = random_normal(n, 42, 2.0f);
  auto w = random_normal(n, 43);  // loss = sum(out * w), so dout = w
  std::vector<float> out(n);

  auto gelu_loss = [&] {
    ref::gelu_forward(out.data(), x.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> dx(n, 0.0f);
  ref::gelu_backward(dx.data(), x.data(), w.data(), n);
  testing::expect_gradient_matches("gelu dinp", x, dx, gelu_loss);

  auto swiglu_loss = [&] {
    ref::swiglu_forward(out.data(), x.data(), y.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> dgate(n, 0.0f), dup(n, 0.0f);
  ref::swiglu_backward(dgate.data(), dup.data(), w.data(), x.data(), y.data(), n);
  testing::expect_gradient_matches("swiglu dgate", x, dgate, swiglu_loss);
  testing::expect_gradient_matches("swiglu dup", y, dup, swiglu_loss);

  auto residual_loss = [&] {
    ref::residual_forward(out.data(), x.data(), y.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> da(n, 0.0f), db(n, 0.0f);
  ref::residual_backward(da.data(), db.data(), w.data(), n);
  testing::expect_gradient_matches("residual da", x, da, residual_loss);
  testing::expect_gradient_matches("residual db", y, db, residual_loss);
}

}  // namespace
}  // namespace tessel::kernels
