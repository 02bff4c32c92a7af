#include "tessel/kernels/rmsnorm.h"

#include <gtest/gtest.h>

#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::max_rel_error;
using testing::random_normal;

constexpr float kEps = 1e-5f;

// Outputs and gradients are O(1), so errors are measured against max(|ref|, 1): float rounding
// of O(1) terms (e.g. x - mean) is judged absolutely where a value happens to be near zero.
constexpr double kFloor = 1.0;
constexpr double kTol = 1e-5;

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
    EXPECT_LE(max_rel_error(out_c, out_r, kFloor), kTol);
    EXPECT_LE(max_rel_error(rstd_c, rstd_r), 1e-5);

    // Pre-filled gradients: backward accumulates.
    auto dout = random_normal(NC, 4);
    auto dinp_r = random_normal(NC, 5), dw_r = random_normal(C, 6);
    auto dinp_c = dinp_r, dw_c = dw_r;
    ref::rmsnorm_backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    cpu::rmsnorm_backward(dinp_c.data(), dw_c.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    EXPECT_LE(max_rel_error(dinp_c, dinp_r, kFloor), kTol);
    EXPECT_LE(max_rel_error(dw_c, dw_r, kFloor), kTol);
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
    for (size_t i = 0; i < NC; ++i) EXPECT_NEAR(dinp[i], pre_dinp[i] + dinp0[i], 1e-5);
    for (int c = 0; c < C; ++c) EXPECT_NEAR(dw[c], pre_dw[c] + dw0[c], 1e-5);
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
