#include "tessel/kernels/linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::absolute;
using testing::dot;
using testing::expect_gradient_matches;
using testing::random_normal;
using testing::within_bounds;

std::vector<float> plus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

struct Dims {
  int N, IC, OC;
};

// gamma(K + extra) times the magnitudes: the per-element bound of a result that sums K terms.
std::vector<double> sum_bounds(const std::vector<float>& magnitude, int64_t K, int extra) {
  std::vector<double> bound(magnitude.size());
  for (size_t i = 0; i < bound.size(); ++i) bound[i] = testing::gamma(K + extra) * magnitude[i];
  return bound;
}

void expect_cpu_matches_reference(Dims d, bool with_bias, uint64_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "N=" << d.N << " IC=" << d.IC << " OC=" << d.OC << " bias=" << with_bias);
  auto inp = random_normal(size_t(d.N) * d.IC, seed);
  auto weight = random_normal(size_t(d.OC) * d.IC, seed + 1, 0.2f);
  auto bias = random_normal(d.OC, seed + 2);
  const float* b = with_bias ? bias.data() : nullptr;
  const auto inp_abs = absolute(inp), weight_abs = absolute(weight), bias_abs = absolute(bias);

  // Forward overwrites: start from NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out_ref(size_t(d.N) * d.OC, nan), out_cpu(out_ref), out_mag(out_ref);
  ref::linear_forward(out_ref.data(), inp.data(), weight.data(), b, d.N, d.IC, d.OC);
  cpu::linear_forward(out_cpu.data(), inp.data(), weight.data(), b, d.N, d.IC, d.OC);
  // sum_i |x_i w_i| + |b| per output: the reference on absolute values.
  ref::linear_forward(out_mag.data(), inp_abs.data(), weight_abs.data(),
                      with_bias ? bias_abs.data() : nullptr, d.N, d.IC, d.OC);
  // The bias prefill plus a GEMM with beta = 1: IC + 1 terms, each rounded at most IC + 2 times
  // (its product, IC additions; alpha = beta = 1 are exact); the reference's rounding to float and
  // its double sum (u each), and the magnitudes' own rounding (u): gamma(IC + 5).
  EXPECT_TRUE(within_bounds(out_cpu, out_ref, sum_bounds(out_mag, d.IC, 5), "out"));

  // Backward accumulates: the result on pre-filled buffers is the prefill plus the gradient
  // computed into zeros.
  auto dout = random_normal(size_t(d.N) * d.OC, seed + 3);
  std::vector<float> dinp0(size_t(d.N) * d.IC, 0.0f), dw0(size_t(d.OC) * d.IC, 0.0f),
      db0(d.OC, 0.0f);
  ref::linear_backward(dinp0.data(), dw0.data(), with_bias ? db0.data() : nullptr, dout.data(),
                       inp.data(), weight.data(), d.N, d.IC, d.OC);
  const auto dinp_init = random_normal(dinp0.size(), seed + 4);
  const auto dw_init = random_normal(dw0.size(), seed + 5);
  const auto db_init = random_normal(db0.size(), seed + 6);
  auto dinp_ref = dinp_init, dw_ref = dw_init, db_ref = db_init;
  ref::linear_backward(dinp_ref.data(), dw_ref.data(), with_bias ? db_ref.data() : nullptr,
                       dout.data(), inp.data(), weight.data(), d.N, d.IC, d.OC);
  // The reference sums each gradient in double and adds it to the buffer as one float add, the
  // same add plus() makes: equal.
  EXPECT_EQ(dinp_ref, plus(dinp_init, dinp0));
  EXPECT_EQ(dw_ref, plus(dw_init, dw0));
  EXPECT_EQ(db_ref, plus(db_init, db0));

  auto dinp_cpu = dinp_init, dw_cpu = dw_init, db_cpu = db_init;
  cpu::linear_backward_input(dinp_cpu.data(), dout.data(), weight.data(), d.N, d.IC, d.OC);
  cpu::linear_backward_weight(dw_cpu.data(), with_bias ? db_cpu.data() : nullptr, dout.data(),
                              inp.data(), d.N, d.IC, d.OC);
  // Magnitudes |init| + sum |terms|: the reference on absolute values into |init|.
  auto dinp_mag = absolute(dinp_init), dw_mag = absolute(dw_init), db_mag = absolute(db_init);
  ref::linear_backward(dinp_mag.data(), dw_mag.data(), db_mag.data(), absolute(dout).data(),
                       inp_abs.data(), weight_abs.data(), d.N, d.IC, d.OC);
  // dinp sums OC products and dweight N products into the buffer (a GEMM with beta = 1), dbias N
  // values in a float accumulator then added: K + 1 terms each rounded at most K + 2 times
  // (K = OC for dinp, N for dweight and dbias). The reference rounds its double sum to float,
  // adds it (u each) and has its double error (below u); the magnitudes are the reference's
  // float results, two roundings: gamma(K + 7).
  EXPECT_TRUE(within_bounds(dinp_cpu, dinp_ref, sum_bounds(dinp_mag, d.OC, 7), "dinp"));
  EXPECT_TRUE(within_bounds(dw_cpu, dw_ref, sum_bounds(dw_mag, d.N, 7), "dweight"));
  EXPECT_TRUE(within_bounds(db_cpu, db_ref, sum_bounds(db_mag, d.N, 7), "dbias"));
  if (!with_bias) {
    EXPECT_EQ(db_cpu, db_init);
  }

  // The combined call equals the split ones.
  auto dinp_all = dinp_init, dw_all = dw_init, db_all = db_init;
  cpu::linear_backward(dinp_all.data(), dw_all.data(), with_bias ? db_all.data() : nullptr,
                       dout.data(), inp.data(), weight.data(), d.N, d.IC, d.OC);
  EXPECT_EQ(dinp_all, dinp_cpu);
  EXPECT_EQ(dw_all, dw_cpu);
  EXPECT_EQ(db_all, db_cpu);
}

TEST(Linear, CpuMatchesReferenceOnOddSizes) {
  uint64_t seed = 10;
  for (int N : {1, 3, 17}) {
    for (int IC : {1, 5, 67}) {
      for (int OC : {1, 5, 67}) {
        expect_cpu_matches_reference({N, IC, OC}, true, seed += 7);
        expect_cpu_matches_reference({N, IC, OC}, false, seed += 7);
      }
    }
  }
}

TEST(Linear, CpuMatchesReferenceOnLargerSizes) {
  // Wide enough for several dbias column blocks and for the providers' blocked paths.
  expect_cpu_matches_reference({130, 96, 300}, true, 3);
  expect_cpu_matches_reference({64, 257, 129}, false, 4);
}

TEST(Linear, ReferenceComputesKnownValues) {
  // out = inp · W^T + b with inp = [1 2], W = [[1 0], [0 1], [1 1]], b = [0.5 0 -1].
  const float inp[] = {1, 2}, weight[] = {1, 0, 0, 1, 1, 1}, bias[] = {0.5f, 0, -1};
  float out[3];
  ref::linear_forward(out, inp, weight, bias, 1, 2, 3);
  EXPECT_EQ(std::vector<float>(out, out + 3), (std::vector<float>{1.5f, 2, 2}));
}

TEST(Linear, ReferenceBackwardMatchesFiniteDifferences) {
  for (bool with_bias : {true, false}) {
    const int N = 3, IC = 5, OC = 4;
    auto inp = random_normal(size_t(N) * IC, 21);
    auto weight = random_normal(size_t(OC) * IC, 22);
    auto bias = random_normal(OC, 23);
    auto w = random_normal(size_t(N) * OC, 24);  // loss = sum(out * w), so dout = w
    std::vector<float> out(size_t(N) * OC);
    auto loss = [&] {
      ref::linear_forward(out.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr,
                          N, IC, OC);
      return dot(out, w);
    };
    std::vector<float> dinp(inp.size(), 0.0f), dweight(weight.size(), 0.0f), dbias(OC, 0.0f);
    ref::linear_backward(dinp.data(), dweight.data(), with_bias ? dbias.data() : nullptr, w.data(),
                         inp.data(), weight.data(), N, IC, OC);
    expect_gradient_matches("dinp", inp, dinp, loss);
    expect_gradient_matches("dweight", weight, dweight, loss);
    if (with_bias) {
      expect_gradient_matches("dbias", bias, dbias, loss);
    }
  }
}

}  // namespace
}  // namespace tessel::kernels
