#include "tessel/kernels/rmsnorm.h"

#include <gtest/gtest.h>

#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/norm_bounds.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

constexpr float kEps = 1e-5f;

using testing::within_bounds;

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
    const auto bound = testing::rmsnorm_forward_bounds(inp, weight, N, C, kEps);
    EXPECT_TRUE(within_bounds(out_c, out_r, bound.out, "out"));
    EXPECT_TRUE(within_bounds(rstd_c, rstd_r, bound.rstd, "rstd"));

    // Pre-filled gradients: backward accumulates.
    auto dout = random_normal(NC, 4);
    auto dinp_r = random_normal(NC, 5), dw_r = random_normal(C, 6);
    auto dinp_c = dinp_r, dw_c = dw_r;
    const auto dinp_init = dinp_r, dw_init = dw_r;
    ref::rmsnorm_backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    cpu::rmsnorm_backward(dinp_c.data(), dw_c.data(), dout.data(), inp.data(), weight.data(),
                          rstd_r.data(), N, C);
    // Both get the same rstd.
    const auto grad_bound =
        testing::rmsnorm_backward_bounds(inp, weight, dout, rstd_r, dinp_init, dw_init, N, C);
    EXPECT_TRUE(within_bounds(dinp_c, dinp_r, grad_bound.dinp, "dinp"));
    EXPECT_TRUE(within_bounds(dw_c, dw_r, grad_bound.dweight, "dweight"));
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
