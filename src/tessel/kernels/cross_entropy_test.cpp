#include "tessel/kernels/cross_entropy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/cross_entropy_test_data.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using test_data::kIgnore;
using test_data::make_logits;
using test_data::make_targets;
using testing::random_normal;

using testing::cross_entropy_row_bound;
using testing::CrossEntropyRowBound;
using testing::within_bound;
using testing::within_bounds;
constexpr double u = testing::kUnitRoundoff;

struct Dims {
  int N, V, Vp;
};

// How far cpu::cross_entropy and ref::cross_entropy may be from each other, from each one's bound
// against the exact values of the float logits (testing::cross_entropy_row_bound: the cpu kernel
// with fast_exp, the reference with libm, both summing in double).
struct CeComparison {
  std::vector<double> dlogits;  // per element; 0 in ignored rows and padding (exact zeros)
  std::vector<double> losses;   // per row, between the float losses
  double loss_sum = 0;          // between the double sums
};

CeComparison compare_cpu_ref(const std::vector<float>& logits, const std::vector<int32_t>& targets,
                             int N, int V, int Vp, float grad_scale) {
  CeComparison c;
  c.dlogits.assign(size_t(N) * Vp, 0.0);
  c.losses.assign(size_t(N), 0.0);
  double loss_magnitude = 0;
  for (int n = 0; n < N; ++n) {
    if (targets[n] == kIgnore) continue;
    const float* x = logits.data() + size_t(n) * Vp;
    const CrossEntropyRowBound fast =
        cross_entropy_row_bound(x, V, targets[n], grad_scale, true, 0);
    const CrossEntropyRowBound libm =
        cross_entropy_row_bound(x, V, targets[n], grad_scale, false, 0);
    for (int v = 0; v < V; ++v)
      c.dlogits[size_t(n) * Vp + v] = fast.dlogit_error[v] + libm.dlogit_error[v];
    // Each side's double loss, then each rounded to float (u of it).
    const double both = fast.loss_error + libm.loss_error;
    c.losses[n] = both + u * (2 * std::fabs(fast.loss) + both);
    c.loss_sum += both;
    loss_magnitude += std::fabs(fast.loss) + both;
  }
  // Both sum the rows' double losses in row order: gamma64(N) each.
  c.loss_sum += 2 * testing::gamma64(N) * loss_magnitude;
  return c;
}

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
      const CeComparison bound = compare_cpu_ref(logits, targets, N, V, Vp, grad_scale);
      EXPECT_TRUE(within_bound(res_c.loss_sum, res_r.loss_sum, bound.loss_sum, "loss_sum"));
      EXPECT_TRUE(within_bounds(loss_c, loss_r, bound.losses, "losses"));
      EXPECT_TRUE(within_bounds(dl_c, dl_r, bound.dlogits, "dlogits"));

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
    double sum = 0, sum_bound = 0;
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
      // The kernel against the exact value (cross_entropy_row_bound, then its rounding to
      // float), and this double evaluation's own error: log z within gamma64(V + 4) (z's sum and
      // exps, log's ulp) and two more roundings of |log z| and |expected|.
      const CrossEntropyRowBound b =
          cross_entropy_row_bound(logits.data() + size_t(n) * Vp, V, targets[n], 1.0f, use_cpu, 0);
      const double here = testing::gamma64(V + 6) * (1 + std::log(z) + std::fabs(expected));
      EXPECT_TRUE(within_bound(losses[n], expected,
                               b.loss_error + u * (std::fabs(b.loss) + b.loss_error) + here,
                               "loss"));
      sum += losses[n];
      // The exact gradient row sums to zero; each element is within its bound of it, and this
      // double sum of V terms adds gamma64(V) of their magnitudes.
      double gsum_bound = 0;
      for (int v = 0; v < V; ++v) {
        gsum += row[v];
        gsum_bound += b.dlogit_error[v] + testing::gamma64(V) * std::fabs(row[v]);
      }
      EXPECT_TRUE(within_bound(gsum, 0.0, gsum_bound, "gradient row sum"));
      for (int v = V; v < Vp; ++v) EXPECT_EQ(row[v], 0.0f) << "padding column " << v;
      sum_bound += u * (std::fabs(b.loss) + b.loss_error) + testing::gamma64(N) * std::fabs(b.loss);
    }
    // loss_sum adds the double losses; sum adds the same losses rounded to float (u each).
    EXPECT_TRUE(within_bound(res.loss_sum, sum, sum_bound, "loss_sum"));
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
    for (size_t i = 0; i < dl_large.size(); ++i) ASSERT_TRUE(std::isfinite(dl_large[i]));
    // 1000 + x rounds x to float's spacing at 1000: large = small + 1000 + r, |r| <= 2^-15, with
    // r computed exactly here per logit. The loss log sum exp(x) - x_t moves by a p-weighted mean
    // of r minus r_t, so by at most max(r_max - r_t, r_t - r_min); p_v by a factor within
    // exp(+-(r_max - r_min)). Plus each run's own error (cross_entropy_row_bound).
    std::vector<double> loss_bound(N), dl_bound(dl_large.size(), 0.0);
    for (int n = 0; n < N; ++n) {
      if (targets[n] == kIgnore) continue;
      const float* xs = small.data() + size_t(n) * Vp;
      const float* xl = large.data() + size_t(n) * Vp;
      double r_min = INFINITY, r_max = -INFINITY;
      for (int v = 0; v < V; ++v) {
        const double r = double(xl[v]) - 1000.0 - double(xs[v]);  // exact in double
        r_min = std::min(r_min, r), r_max = std::max(r_max, r);
      }
      const double r_t = double(xl[targets[n]]) - 1000.0 - double(xs[targets[n]]);
      const CrossEntropyRowBound bs = cross_entropy_row_bound(xs, V, targets[n], 1.0f, use_cpu, 0);
      const CrossEntropyRowBound bl = cross_entropy_row_bound(xl, V, targets[n], 1.0f, use_cpu, 0);
      const double shift = std::max(r_max - r_t, r_t - r_min);
      const double runs = bs.loss_error + bl.loss_error;
      loss_bound[n] = shift + runs + u * (2 * std::fabs(bs.loss) + shift + runs);
      for (int v = 0; v < V; ++v) {
        dl_bound[size_t(n) * Vp + v] =
            bs.p[v] * std::expm1(r_max - r_min) + bs.dlogit_error[v] + bl.dlogit_error[v];
      }
    }
    EXPECT_TRUE(within_bounds(l_large, l_small, loss_bound, "losses"));
    EXPECT_TRUE(within_bounds(dl_large, dl_small, dl_bound, "dlogits"));
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
