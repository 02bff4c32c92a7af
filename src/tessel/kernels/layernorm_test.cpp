#include "tessel/kernels/layernorm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <span>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/norm_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

constexpr float kEps = 1e-5f;

using testing::gamma;
using testing::within_bounds;
constexpr double u = testing::kUnitRoundoff;

struct Rows {
  int N, C;
};

// Random rows with a common offset, so a one-pass E[x^2] - E[x]^2 variance would show.
std::vector<float> offset_rows(int N, int C, uint64_t seed) {
  auto x = random_normal(size_t(N) * C, seed);
  for (size_t i = 0; i < x.size(); ++i) x[i] += 3.0f + float(i % 5);
  return x;
}

TEST(Layernorm, CpuMatchesReference) {
  // 64 x 768 crosses the kernels' parallel threshold; the others stay single-threaded.
  for (auto [N, C] : {Rows{1, 1}, Rows{7, 3}, Rows{33, 67}, Rows{5, 768}, Rows{64, 768}}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C << " bias=" << with_bias);
      const size_t NC = size_t(N) * C;
      auto inp = offset_rows(N, C, 1);
      auto weight = random_normal(C, 2);
      auto bias = random_normal(C, 3);
      const float* b = with_bias ? bias.data() : nullptr;
      std::vector<float> out_r(NC), mean_r(N), rstd_r(N);
      std::vector<float> out_c(NC), mean_c(N), rstd_c(N);
      ref::layernorm_forward(out_r.data(), mean_r.data(), rstd_r.data(), inp.data(), weight.data(),
                             b, N, C, kEps);
      cpu::layernorm_forward(out_c.data(), mean_c.data(), rstd_c.data(), inp.data(), weight.data(),
                             b, N, C, kEps);
      const auto bound = testing::layernorm_forward_bounds(
          inp, weight, with_bias ? std::span<const float>(bias) : std::span<const float>(), N, C,
          kEps);
      std::vector<double> self_bound(NC);
      std::vector<float> out_self(NC);
      for (int n = 0; n < N; ++n) {
        for (int c = 0; c < C; ++c) {
          const size_t i = size_t(n) * C + c;
          const double bias_c = with_bias ? std::fabs(bias[c]) : 0.0;
          // The output from the kernel's own statistics: x - mean, * rstd, * w, + b round once
          // each (an FMA fuses two): gamma(4) of |(x - mean) rstd w| + |b|.
          const double p = (double(inp[i]) - mean_c[n]) * rstd_c[n] * weight[c];
          out_self[i] = float(p + (with_bias ? bias[c] : 0.0f));
          self_bound[i] = gamma(4) * (std::fabs(p) + bias_c) + u * std::fabs(out_self[i]);
        }
      }
      // The float sums of C terms that give the statistics are bounded for the worst order of
      // C roundings; the mean of the offset rows (A ~ 5) then allows ~gamma(C) 5 ~ 2e-4 in every
      // output of a row. The output's own arithmetic is checked sharply from the kernel's
      // statistics (out_self: out_self is that value rounded to float, hence + u |out_self|).
      EXPECT_TRUE(within_bounds(out_c, out_r, bound.out, "out"));
      EXPECT_TRUE(within_bounds(out_c, out_self, self_bound, "out from stats"));
      EXPECT_TRUE(within_bounds(mean_c, mean_r, bound.mean, "mean"));
      EXPECT_TRUE(within_bounds(rstd_c, rstd_r, bound.rstd, "rstd"));

      // Pre-filled gradients: backward accumulates.
      auto dout = random_normal(NC, 4);
      auto dinp_r = random_normal(NC, 5), dw_r = random_normal(C, 6), db_r = random_normal(C, 7);
      auto dinp_c = dinp_r, dw_c = dw_r, db_c = db_r;
      const auto dinp_init = dinp_r, dw_init = dw_r, db_init = db_r;
      ref::layernorm_backward(dinp_r.data(), dw_r.data(), with_bias ? db_r.data() : nullptr,
                              dout.data(), inp.data(), weight.data(), mean_r.data(), rstd_r.data(),
                              N, C);
      cpu::layernorm_backward(dinp_c.data(), dw_c.data(), with_bias ? db_c.data() : nullptr,
                              dout.data(), inp.data(), weight.data(), mean_r.data(), rstd_r.data(),
                              N, C);
      // Both get the same mean and rstd.
      const auto grad_bound = testing::layernorm_backward_bounds(inp, weight, dout, mean_r, rstd_r,
                                                                 dinp_init, dw_init, db_init, N, C);
      EXPECT_TRUE(within_bounds(dinp_c, dinp_r, grad_bound.dinp, "dinp"));
      EXPECT_TRUE(within_bounds(dw_c, dw_r, grad_bound.dweight, "dweight"));
      EXPECT_TRUE(within_bounds(db_c, db_r, grad_bound.dbias, "dbias"));
      if (!with_bias) {
        EXPECT_EQ(db_c, random_normal(C, 7)) << "dbias must be left alone without a bias";
      }
    }
  }
}

// dweight/dbias sum over rows in a fixed order per channel block, so any thread count gives
// bit-identical gradients (a reduction across threads would not).
TEST(Layernorm, CpuBackwardDoesNotDependOnThreadCount) {
  const int N = 96, C = 768;
  const size_t NC = size_t(N) * C;
  auto inp = offset_rows(N, C, 31);
  auto weight = random_normal(C, 32);
  auto dout = random_normal(NC, 33);
  std::vector<float> out(NC), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), nullptr,
                         N, C, kEps);
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    std::vector<float> grads(NC + 2 * C, 0.0f);
    cpu::layernorm_backward(grads.data(), grads.data() + NC, grads.data() + NC + C, dout.data(),
                            inp.data(), weight.data(), mean.data(), rstd.data(), N, C);
    return grads;
  };
  const int saved = omp_get_max_threads();
  const auto one = run(1);
  for (int threads : {2, 3, 5}) EXPECT_EQ(run(threads), one) << threads << " threads";
  omp_set_num_threads(saved);
}

TEST(Layernorm, BackwardAccumulatesIntoGradients) {
  const int N = 9, C = 67;
  const size_t NC = size_t(N) * C;
  auto inp = offset_rows(N, C, 11);
  auto weight = random_normal(C, 12);
  auto dout = random_normal(NC, 13);
  std::vector<float> out(NC), mean(N), rstd(N);
  ref::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), nullptr,
                         N, C, kEps);
  auto pre_dinp = random_normal(NC, 14), pre_dw = random_normal(C, 15),
       pre_db = random_normal(C, 16);
  for (auto backward : {ref::layernorm_backward, cpu::layernorm_backward}) {
    std::vector<float> dinp0(NC, 0.0f), dw0(C, 0.0f), db0(C, 0.0f);
    backward(dinp0.data(), dw0.data(), db0.data(), dout.data(), inp.data(), weight.data(),
             mean.data(), rstd.data(), N, C);
    auto dinp = pre_dinp, dw = pre_dw, db = pre_db;
    backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), mean.data(),
             rstd.data(), N, C);
    // The kernels add each gradient into the buffer once (an FMA may fuse dinp's last product).
    EXPECT_TRUE(testing::accumulated_within_bound(dinp, pre_dinp, dinp0, "dinp"));
    EXPECT_TRUE(testing::accumulated_within_bound(dw, pre_dw, dw0, "dweight"));
    EXPECT_TRUE(testing::accumulated_within_bound(db, pre_db, db0, "dbias"));
  }
}

TEST(Layernorm, ReferenceBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : {Rows{3, 5}, Rows{2, 1}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const size_t NC = size_t(N) * C;
    auto inp = random_normal(NC, 21);
    auto weight = random_normal(C, 22);
    auto bias = random_normal(C, 23);
    auto w = random_normal(NC, 24);  // loss = sum(out * w), so dout = w
    std::vector<float> out(NC), mean(N), rstd(N);
    auto loss = [&] {
      ref::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                             bias.data(), N, C, kEps);
      return testing::dot(out, w);
    };
    loss();
    std::vector<float> dinp(NC, 0.0f), dw(C, 0.0f), db(C, 0.0f);
    ref::layernorm_backward(dinp.data(), dw.data(), db.data(), w.data(), inp.data(), weight.data(),
                            mean.data(), rstd.data(), N, C);
    // A smaller step: the normalisation curves sharply for rows of a handful of values.
    testing::GradcheckOptions opt;
    opt.h = 1e-3f;
    testing::expect_gradient_matches("dinp", inp, dinp, loss, opt);
    testing::expect_gradient_matches("dweight", weight, dw, loss, opt);
    testing::expect_gradient_matches("dbias", bias, db, loss, opt);
  }
}

}  // namespace
}  // namespace tessel::kernels
