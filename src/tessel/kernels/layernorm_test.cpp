#include "tessel/kernels/layernorm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

constexpr float kEps = 1e-5f;

using testing::gamma;
using testing::gamma64;
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

// Bounds for the float kernel's forward against the exact (float64) statistics of one row.
//   mean: the float sum of C terms and the division, gamma(C) of A = sum |x| / C.
//   d_c = fl(x_c - mean) is off by that error D (the same for every c) and by u |d_c|. Because the
//   exact d_c sum to zero, D enters sum d^2 only squared: sum fl(d)^2 is within
//   (2u + u^2) sum d^2 + (1 + u)^2 C D^2 of sum d^2, and its float sum adds gamma(C) relatively
//   (positive terms); / C and + eps round twice: v = sum d^2 / C + eps is off by
//   nu <= gamma(C + 4) + (1 + gamma(C + 3)) D^2 / v relatively, and rstd = fl(1 / fl(sqrt(v)))
//   by rel_s = (1 - nu)^(-1/2) (1 + u) / (1 - u) - 1.
struct RowStats {
  double mean, rstd, A, D, rel_s;
};

RowStats row_stats(const float* x, int C, float eps) {
  double m = 0, a = 0;
  for (int c = 0; c < C; ++c) m += x[c], a += std::fabs(x[c]);
  m /= C;
  a /= C;
  double ss = 0;
  for (int c = 0; c < C; ++c) ss += (x[c] - m) * (x[c] - m);
  const double v = ss / C + double(eps);
  const double D = gamma(C) * a;
  const double nu = gamma(C + 4) + (1 + gamma(C + 3)) * D * D / v;
  return {m, 1 / std::sqrt(v), a, D, (1 + u) / (1 - u) / std::sqrt(1 - nu) - 1};
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
      std::vector<double> out_bound(NC), self_bound(NC), mean_bound(N), rstd_bound(N);
      std::vector<float> out_self(NC);
      for (int n = 0; n < N; ++n) {
        const float* x = inp.data() + size_t(n) * C;
        const RowStats st = row_stats(x, C, kEps);
        // The reference's float64 statistics are off by gamma64(2C + 8) of the same terms, and
        // it rounds mean, rstd and out to float once.
        mean_bound[n] = st.D + u * std::fabs(st.mean) + gamma64(C + 2) * st.A;
        rstd_bound[n] = st.rstd * (st.rel_s + u + gamma64(2 * C + 8));
        for (int c = 0; c < C; ++c) {
          const size_t i = size_t(n) * C + c;
          const double d = x[c] - st.mean, w = std::fabs(weight[c]);
          const double bias_c = with_bias ? std::fabs(bias[c]) : 0.0;
          // out = fl(fl(fl(d) rstd) w) + b: the product carries d's error D + u|d|, rstd's rel_s
          // and two roundings (R); the bias add rounds once more.
          const double R = (1 + u) * (1 + st.rel_s) * (1 + gamma(2)) - 1;
          const double product_err = st.rstd * w * (st.D * (1 + R) + std::fabs(d) * R);
          const double out = d * st.rstd * weight[c] + (with_bias ? bias[c] : 0.0f);
          out_bound[i] = product_err + u * (std::fabs(out) + product_err) + u * std::fabs(out) +
                         gamma64(2 * C + 16) * (st.rstd * w * (std::fabs(d) + st.A) + bias_c);
          // The output from the kernel's own statistics: x - mean, * rstd, * w, + b round once
          // each (an FMA fuses two): gamma(4) of |(x - mean) rstd w| + |b|.
          const double p = (double(x[c]) - mean_c[n]) * rstd_c[n] * weight[c];
          out_self[i] = float(p + (with_bias ? bias[c] : 0.0f));
          self_bound[i] = gamma(4) * (std::fabs(p) + bias_c) + u * std::fabs(out_self[i]);
        }
      }
      // The float sums of C terms that give the statistics are bounded for the worst order of
      // C roundings; the mean of the offset rows (A ~ 5) then allows ~gamma(C) 5 ~ 2e-4 in every
      // output of a row. The output's own arithmetic is checked sharply from the kernel's
      // statistics (out_self: out_self is that value rounded to float, hence + u |out_self|).
      EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "out"));
      EXPECT_TRUE(within_bounds(out_c, out_self, self_bound, "out from stats"));
      EXPECT_TRUE(within_bounds(mean_c, mean_r, mean_bound, "mean"));
      EXPECT_TRUE(within_bounds(rstd_c, rstd_r, rstd_bound, "rstd"));

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
      // Both get the same mean and rstd. Per row, with norm_c = (x_c - mean) rstd (two roundings)
      // and G1 = sum |w d| / C, G2 = sum |w d norm| / C: dnorm_mean (C products, C - 1 adds, / C)
      // is off by gamma(C + 1) G1 and dnorm_norm_mean (four roundings per term) by
      // gamma(C + 4) G2, plus gamma64 of the same for the reference. Then
      // dx += (w d - dm - norm dnm) rstd rounds each term at most six times (norm's two, the
      // product, two subtractions, * rstd, += into the buffer): gamma(6), and the reference rounds
      // its value and the add: gamma(8) of |w d| rstd + G1 rstd + |norm| G2 rstd + |init|, plus
      // gamma(9) for the float64 terms' own error.
      std::vector<double> dinp_bound(NC), dw_mag(C), db_mag(C);
      for (int c = 0; c < C; ++c) {
        dw_mag[c] = std::fabs(dw_init[c]);
        db_mag[c] = std::fabs(db_init[c]);
      }
      for (int n = 0; n < N; ++n) {
        const double m = mean_r[n], st = rstd_r[n];
        double g1 = 0, g2 = 0;
        for (int c = 0; c < C; ++c) {
          const size_t i = size_t(n) * C + c;
          const double norm = (inp[i] - m) * st, wd = std::fabs(double(weight[c]) * dout[i]);
          g1 += wd;
          g2 += wd * std::fabs(norm);
          dw_mag[c] += std::fabs(norm * dout[i]);
          db_mag[c] += std::fabs(dout[i]);
        }
        g1 /= C;
        g2 /= C;
        const double dm_err = (gamma(C + 1) + gamma64(C + 1)) * g1;
        const double dnm_err = (gamma(C + 4) + gamma64(C + 4)) * g2;
        for (int c = 0; c < C; ++c) {
          const size_t i = size_t(n) * C + c;
          const double norm = std::fabs((inp[i] - m) * st);
          const double wd = std::fabs(double(weight[c]) * dout[i]);
          const double magnitude = st * (wd + g1 + norm * g2) + std::fabs(dinp_init[i]);
          dinp_bound[i] = st * (dm_err + norm * dnm_err) * (1 + gamma(6)) + gamma(9) * magnitude;
        }
      }
      // dweight sums N terms of three roundings each into a float accumulator and adds it to the
      // buffer: gamma(N + 3); dbias gamma(N); the reference rounds and adds (2u) and has its
      // float64 error (below u): + 3 each.
      std::vector<double> dw_bound(C), db_bound(C);
      for (int c = 0; c < C; ++c) {
        dw_bound[c] = gamma(N + 6) * dw_mag[c];
        db_bound[c] = gamma(N + 3) * db_mag[c];
      }
      EXPECT_TRUE(within_bounds(dinp_c, dinp_r, dinp_bound, "dinp"));
      EXPECT_TRUE(within_bounds(dw_c, dw_r, dw_bound, "dweight"));
      EXPECT_TRUE(within_bounds(db_c, db_r, db_bound, "dbias"));
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
