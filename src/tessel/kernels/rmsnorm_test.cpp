#include "tessel/kernels/rmsnorm.h"

#include <gtest/gtest.h>

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

TEST(Rmsnorm, CpuMatchesReference) {
  // 64 x 768 crosses the kernels' parallel threshold; the others stay single-threaded.
  for (auto [N, C] : {Rows{1, 1}, Rows{7, 3}, Rows{33, 67}, Rows{5, 768}, Rows{64, 768}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const size_t NC = size_t(N) * C;
    auto inp = random_normal(NC, 1);
    auto weight = random_normal(C, 2);
    std::vector<float> out_r(NC), rstd_r(N), out_c(NC), rstd_c(N);
    ref::rmsnorm_forward(out_r.data(), rstd_r.data(), inp.data(), weight.data(), N, C, kEps);
    cpu::rmsnorm_forward(out_c.data(), rstd_c.data(), inp.data(), weight.data(), N, C, kEps);
    // The float sum of squares (C positive terms, product and adds) is off by gamma(C)
    // relatively, / C and + eps by two more roundings: v = mean(x^2) + eps by
    // nu = gamma(C + 2), and rstd = fl(1 / fl(sqrt(v))) by rel_s = (1 - nu)^(-1/2) (1+u)/(1-u) - 1.
    // out = fl(fl(x rstd) w) adds two roundings, of one sign of terms (no cancellation). The
    // reference rounds rstd and out to float once each; its float64 error is gamma64(C + 6)
    // relatively.
    const double rel_s = (1 + u) / (1 - u) / std::sqrt(1 - gamma(C + 2)) - 1;
    const double rel_out = (1 + rel_s) * (1 + gamma(2)) - 1 + u + gamma64(C + 6);
    std::vector<double> out_bound(NC), rstd_bound(N);
    for (int n = 0; n < N; ++n) {
      double ms = 0;
      for (int c = 0; c < C; ++c) ms += double(inp[size_t(n) * C + c]) * inp[size_t(n) * C + c];
      const double rstd = 1 / std::sqrt(ms / C + double(kEps));
      rstd_bound[n] = rstd * (rel_s + u + gamma64(C + 6));
      for (int c = 0; c < C; ++c) {
        const size_t i = size_t(n) * C + c;
        out_bound[i] = rel_out * std::fabs(double(inp[i]) * rstd * weight[c]);
      }
    }
    EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "out"));
    EXPECT_TRUE(within_bounds(rstd_c, rstd_r, rstd_bound, "rstd"));

    // Pre-filled gradients: backward accumulates.
    auto dout = random_normal(NC, 4);
    auto dinp_r = random_normal(NC, 5), dw_r = random_normal(C, 6);
    auto dinp_c = dinp_r, dw_c = dw_r;
    const auto dinp_init = dinp_r, dw_init = dw_r;
    ref::rmsnorm_backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    cpu::rmsnorm_backward(dinp_c.data(), dw_c.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    // Both get the same rstd s. Per row, dot = sum d w x (two products and C - 1 adds per term)
    // is off by gamma(C + 1) G, G = sum |d w x|, and coef = s s s dot / C by four more roundings:
    // gamma(C + 5) s^3 G / C (the reference: gamma64(C + 8) of the same). dx += d w s - coef x
    // rounds each term at most four times (two products, the subtraction, the add into the
    // buffer; coef x three) and the reference twice more (its float rounding and add): gamma(7).
    // dweight sums N terms of two roundings into a float accumulator and adds it once: gamma(N +
    // 2), and the reference's rounding, add and float64 sum: gamma(N + 5).
    std::vector<double> dinp_bound(NC), dw_mag(C);
    for (int c = 0; c < C; ++c) dw_mag[c] = std::fabs(dw_init[c]);
    for (int n = 0; n < N; ++n) {
      const double s = rstd_r[n];
      double G = 0;
      for (int c = 0; c < C; ++c) {
        const size_t i = size_t(n) * C + c;
        G += std::fabs(double(dout[i]) * weight[c] * inp[i]);
        dw_mag[c] += std::fabs(double(inp[i]) * s * dout[i]);
      }
      const double coef = s * s * s * G / C;  // bounds |coef|
      const double coef_err = coef * ((1 + gamma(C + 5)) * (1 + gamma(3)) - 1 + gamma64(C + 8));
      for (int c = 0; c < C; ++c) {
        const size_t i = size_t(n) * C + c;
        const double x = std::fabs(inp[i]), dws = std::fabs(double(dout[i]) * weight[c] * s);
        dinp_bound[i] = x * coef_err + gamma(7) * (dws + coef * x + std::fabs(dinp_init[i]));
      }
    }
    std::vector<double> dw_bound(C);
    for (int c = 0; c < C; ++c) dw_bound[c] = gamma(N + 5) * dw_mag[c];
    EXPECT_TRUE(within_bounds(dinp_c, dinp_r, dinp_bound, "dinp"));
    EXPECT_TRUE(within_bounds(dw_c, dw_r, dw_bound, "dweight"));
  }
}

TEST(Rmsnorm, BackwardAccumulatesIntoGradients) {
  const int N = 9, C = 67;
  const size_t NC = size_t(N) * C;
  auto inp = random_normal(NC, 11);
  auto weight = random_normal(C, 12);
  auto dout = random_normal(NC, 13);
  std::vector<float> out(NC), rstd(N);
  ref::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
  auto pre_dinp = random_normal(NC, 14), pre_dw = random_normal(C, 15);
  for (auto backward : {ref::rmsnorm_backward, cpu::rmsnorm_backward}) {
    std::vector<float> dinp0(NC, 0.0f), dw0(C, 0.0f);
    backward(dinp0.data(), dw0.data(), dout.data(), inp.data(), weight.data(), rstd.data(), N, C);
    auto dinp = pre_dinp, dw = pre_dw;
    backward(dinp.data(), dw.data(), dout.data(), inp.data(), weight.data(), rstd.data(), N, C);
    // The kernels add each gradient into the buffer once (an FMA may fuse dinp's last product).
    EXPECT_TRUE(testing::accumulated_within_bound(dinp, pre_dinp, dinp0, "dinp"));
    EXPECT_TRUE(testing::accumulated_within_bound(dw, pre_dw, dw0, "dweight"));
  }
}

TEST(Rmsnorm, ReferenceBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : {Rows{3, 5}, Rows{2, 1}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const size_t NC = size_t(N) * C;
    auto inp = random_normal(NC, 21);
    auto weight = random_normal(C, 22);
    auto w = random_normal(NC, 24);  // loss = sum(out * w), so dout = w
    std::vector<float> out(NC), rstd(N);
    auto loss = [&] {
      ref::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, kEps);
      return testing::dot(out, w);
    };
    loss();
    std::vector<float> dinp(NC, 0.0f), dw(C, 0.0f);
    ref::rmsnorm_backward(dinp.data(), dw.data(), w.data(), inp.data(), weight.data(), rstd.data(),
                          N, C);
    testing::GradcheckOptions opt;
    opt.h = 1e-3f;
    testing::expect_gradient_matches("dinp", inp, dinp, loss, opt);
    testing::expect_gradient_matches("dweight", weight, dw, loss, opt);
  }
}

}  // namespace
}  // namespace tessel::kernels
