#include "tessel/kernels/activations.h"

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "tessel/testing/activation_bounds.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

// Sizes: tiny, odd (vector tails), and above the kernels' parallel threshold.
const int64_t kSizes[] = {1, 7, 33, 1000, 100003};

using testing::activation_inputs;
using testing::within_bounds;

TEST(Gelu, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto x = activation_inputs(n, 1);
    std::vector<float> out_r(n), out_c(n);
    ref::gelu_forward(out_r.data(), x.data(), n);
    cpu::gelu_forward(out_c.data(), x.data(), n);
    auto dout = random_normal(n, 2);
    std::vector<float> dinp_r(n, 0.0f), dinp_c(n, 0.0f);
    ref::gelu_backward(dinp_r.data(), x.data(), dout.data(), n);
    cpu::gelu_backward(dinp_c.data(), x.data(), dout.data(), n);

    std::vector<double> out_bound(n), dinp_bound(n);
    for (int64_t i = 0; i < n; ++i) {
      out_bound[i] = testing::gelu_out_bound(x[i]);
      dinp_bound[i] = testing::gelu_dinp_bound(x[i], dout[i]);
    }
    EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "gelu out"));
    EXPECT_TRUE(within_bounds(dinp_c, dinp_r, dinp_bound, "gelu dinp"));
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

    auto dout = random_normal(n, 13);
    std::vector<float> dgate_r(n, 0.0f), dup_r(n, 0.0f), dgate_c(n, 0.0f), dup_c(n, 0.0f);
    ref::swiglu_backward(dgate_r.data(), dup_r.data(), dout.data(), gate.data(), up.data(), n);
    cpu::swiglu_backward(dgate_c.data(), dup_c.data(), dout.data(), gate.data(), up.data(), n);

    std::vector<double> out_bound(n), dgate_bound(n), dup_bound(n);
    for (int64_t i = 0; i < n; ++i) {
      const auto b = testing::swiglu_bounds(gate[i], up[i], dout[i]);
      out_bound[i] = b.out, dgate_bound[i] = b.dgate, dup_bound[i] = b.dup;
    }
    EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "swiglu out"));
    EXPECT_TRUE(within_bounds(dgate_c, dgate_r, dgate_bound, "swiglu dgate"));
    EXPECT_TRUE(within_bounds(dup_c, dup_r, dup_bound, "swiglu dup"));
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
    // Not bit-exact: the kernel may fuse its last product into the add (FMA); the test's
    // pre + z is one float add.
    EXPECT_TRUE(testing::accumulated_within_bound(a1, pre1, z1, "gradient 1")) << name;
    EXPECT_TRUE(testing::accumulated_within_bound(a2, pre2, z2, "gradient 2")) << name;
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
