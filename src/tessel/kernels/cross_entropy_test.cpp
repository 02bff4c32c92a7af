#include "tessel/kernels/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/cross_entropy_test_data.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using test_data::kIgnore;
using test_data::make_logits;
using test_data::make_targets;
using testing::max_rel_error;
using testing::random_normal;

struct Dims {
  int N, V, Vp;
};

TEST(CrossEntropy, CpuMatchesReference) {
  for (auto [N, V, Vp] : {Dims{1, 1, 1}, Dims{7, 3, 8}, Dims{33, 67, 67}, Dims{5, 1000, 1003},
                          Dims{3, 50257, 50304}}) {
    for (float grad_scale : {1.0f, 0.37f}) {
      SCOPED_TRACE(::testing::Message()
                   << "N=" << N << " V=" << V << " Vp=" << Vp << " scale=" << grad_scale);
      auto logits = make_logits(N, V, Vp, 1);
      auto targets = make_targets(N, V, 2);
      const size_t NV = size_t(N) * Vp;
      // dlogits is overwritten, so start both from garbage.
      std::vector<float> dl_r(NV, 7.0f), dl_c(NV, -7.0f), loss_r(N, 5.0f), loss_c(N, -5.0f);
      auto res_r = ref::cross_entropy(dl_r.data(), loss_r.data(), logits.data(), targets.data(), N,
                                      V, Vp, kIgnore, grad_scale);
      auto res_c = cpu::cross_entropy(dl_c.data(), loss_c.data(), logits.data(), targets.data(), N,
                                      V, Vp, kIgnore, grad_scale);
      EXPECT_EQ(res_c.valid, res_r.valid);
      EXPECT_NEAR(res_c.loss_sum, res_r.loss_sum, 1e-6 * std::max(1.0, res_r.loss_sum));
      EXPECT_LE(max_rel_error(loss_c, loss_r), 1e-6);
      // Probabilities are compared against the scale of the largest one.
      EXPECT_LE(max_rel_error(dl_c, dl_r, 1e-3 * grad_scale), 2e-6);

      // Without dlogits only the losses are produced, and they are the same.
      std::vector<float> loss_only(N);
      auto res_nograd = cpu::cross_entropy(nullptr, loss_only.data(), logits.data(), targets.data(),
                                           N, V, Vp, kIgnore, grad_scale);
      EXPECT_EQ(loss_only, loss_c);
      EXPECT_EQ(res_nograd.loss_sum, res_c.loss_sum);
    }
  }
}

TEST(CrossEntropy, IgnoredRowsAndPaddingColumns) {
  const int N = 6, V = 10, Vp = 16;
  auto logits = make_logits(N, V, Vp, 11);
  std::vector<int32_t> targets = {3, kIgnore, 0, 9, kIgnore, kIgnore};
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    auto ce = use_cpu ? cpu::cross_entropy : ref::cross_entropy;
    std::vector<float> dl(size_t(N) * Vp, 3.0f), losses(N, 3.0f);
    auto res = ce(dl.data(), losses.data(), logits.data(), targets.data(), N, V, Vp, kIgnore, 1.0f);
    EXPECT_EQ(res.valid, 3);
    double sum = 0;
    for (int n = 0; n < N; ++n) {
      const float* row = dl.data() + size_t(n) * Vp;
      if (targets[n] == kIgnore) {
        EXPECT_EQ(losses[n], 0.0f);
        for (int v = 0; v < Vp; ++v) EXPECT_EQ(row[v], 0.0f) << "ignored row " << n;
        continue;
      }
      // Softmax over the V real columns only: the loss is -log p[target] computed here directly,
      // the gradient row sums to zero over V, and the padding columns are exactly zero.
      double mx = -INFINITY, z = 0, gsum = 0;
      for (int v = 0; v < V; ++v) mx = std::max(mx, double(logits[size_t(n) * Vp + v]));
      for (int v = 0; v < V; ++v) z += std::exp(logits[size_t(n) * Vp + v] - mx);
      const double expected = std::log(z) + mx - logits[size_t(n) * Vp + targets[n]];
      EXPECT_NEAR(losses[n], expected, 1e-5);
      sum += losses[n];
      for (int v = 0; v < V; ++v) gsum += row[v];
      EXPECT_NEAR(gsum, 0.0, 1e-6);
      for (int v = V; v < Vp; ++v) EXPECT_EQ(row[v], 0.0f) << "padding column " << v;
    }
    EXPECT_NEAR(res.loss_sum, sum, 1e-5);
  }
}

TEST(CrossEntropy, InPlaceMatchesSeparateBuffers) {
  const int N = 9, V = 517, Vp = 520;
  auto logits = make_logits(N, V, Vp, 21);
  auto targets = make_targets(N, V, 22);
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    auto ce = use_cpu ? cpu::cross_entropy : ref::cross_entropy;
    std::vector<float> dl(logits.size()), losses(N), losses_inplace(N);
    auto res = ce(dl.data(), losses.data(), logits.data(), targets.data(), N, V, Vp, kIgnore, 0.5f);
    auto buffer = logits;
    auto res_inplace = ce(buffer.data(), losses_inplace.data(), buffer.data(), targets.data(), N, V,
                          Vp, kIgnore, 0.5f);
    EXPECT_EQ(buffer, dl);
    EXPECT_EQ(losses_inplace, losses);
    EXPECT_EQ(res_inplace.loss_sum, res.loss_sum);
  }
}

// Logits around 1000 overflow a naive exp; after max subtraction the loss equals that of the
// shifted logits (softmax is shift invariant).
TEST(CrossEntropy, StableForLargeLogits) {
  const int N = 4, V = 300, Vp = 304;
  auto small = make_logits(N, V, Vp, 31);
  auto large = small;
  for (auto& x : large) x += 1000.0f;
  auto targets = make_targets(N, V, 32);
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    auto ce = use_cpu ? cpu::cross_entropy : ref::cross_entropy;
    std::vector<float> dl_small(small.size()), dl_large(large.size()), l_small(N), l_large(N);
    ce(dl_small.data(), l_small.data(), small.data(), targets.data(), N, V, Vp, kIgnore, 1.0f);
    auto res =
        ce(dl_large.data(), l_large.data(), large.data(), targets.data(), N, V, Vp, kIgnore, 1.0f);
    EXPECT_TRUE(std::isfinite(res.loss_sum));
    // 1000 + x rounds x to float's spacing at 1000 (6e-5), hence the tolerances.
    for (int n = 0; n < N; ++n) EXPECT_NEAR(l_large[n], l_small[n], 2e-4);
    for (size_t i = 0; i < dl_large.size(); ++i) {
      ASSERT_TRUE(std::isfinite(dl_large[i]));
      EXPECT_NEAR(dl_large[i], dl_small[i], 2e-4);
    }
  }
}

TEST(CrossEntropy, RejectsTargetsOutsideTheVocabulary) {
  const int N = 2, V = 5, Vp = 8;
  auto logits = make_logits(N, V, Vp, 41);
  std::vector<float> dl(logits.size()), losses(N);
  for (int32_t bad : {5, 7, -1}) {  // 5..7 are padding columns, not classes
    std::vector<int32_t> targets = {0, bad};
    EXPECT_THROW(ref::cross_entropy(dl.data(), losses.data(), logits.data(), targets.data(), N, V,
                                    Vp, kIgnore, 1.0f),
                 InvalidArgumentError);
    EXPECT_THROW(cpu::cross_entropy(dl.data(), losses.data(), logits.data(), targets.data(), N, V,
                                    Vp, kIgnore, 1.0f),
                 InvalidArgumentError);
  }
}

// dlogits is the gradient of grad_scale * loss_sum, padding columns and ignored rows included
// (their finite differences are zero).
TEST(CrossEntropy, ReferenceGradientMatchesFiniteDifferences) {
  const int N = 4, V = 6, Vp = 8;
  const float grad_scale = 0.25f;
  auto logits = make_logits(N, V, Vp, 51, 1.0f);
  auto targets = make_targets(N, V, 52);
  std::vector<float> losses(N);
  auto loss = [&] {
    return grad_scale * ref::cross_entropy(nullptr, losses.data(), logits.data(), targets.data(), N,
                                           V, Vp, kIgnore, grad_scale)
                            .loss_sum;
  };
  std::vector<float> dl(logits.size());
  ref::cross_entropy(dl.data(), losses.data(), logits.data(), targets.data(), N, V, Vp, kIgnore,
                     grad_scale);
  testing::expect_gradient_matches("dlogits", logits, dl, loss);
}

}  // namespace
}  // namespace tessel::kernels
