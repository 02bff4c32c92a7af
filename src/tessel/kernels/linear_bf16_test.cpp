#include "tessel/kernels/linear_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tessel/kernels/linear.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::absolute;
using testing::random_normal;
using testing::within_bounds;

struct Dims {
  int N, IC, OC;
};

std::vector<bf16> rounded(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  ref::to_bf16(out.data(), x.data(), int64_t(x.size()));
  return out;
}

// The rounded values, widened back: what both sides multiply.
std::vector<float> widened(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return out;
}

// gamma(K + extra) times the magnitudes, plus what flushing subnormals can lose: native bf16
// instructions flush subnormal inputs and results to zero, each of an element's K + 2 operations
// up to 2^-126 (random normal data has no subnormal operands; a partial sum could be one).
std::vector<double> sum_bounds(const std::vector<float>& magnitude, int64_t K, int extra) {
  std::vector<double> bound(magnitude.size());
  for (size_t i = 0; i < bound.size(); ++i)
    bound[i] = testing::gamma(K + extra) * magnitude[i] + double(K + 2) * 0x1p-126;
  return bound;
}

// The derivations are the float linear layer's (linear_test.cpp): every product of two bf16s is
// exact in float (8 + 8 significant bits in 24), so cpu:: is a float sum of exact products and
// ref:: a double one of the same products; the rounding to bf16 is the same round-to-nearest-even
// on both sides. Magnitudes are the float reference on the absolute rounded operands.
void expect_cpu_matches_reference(Dims d, bool with_bias, uint64_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "N=" << d.N << " IC=" << d.IC << " OC=" << d.OC << " bias=" << with_bias);
  const auto inp = random_normal(size_t(d.N) * d.IC, seed);
  const auto weight = random_normal(size_t(d.OC) * d.IC, seed + 1, 0.2f);
  const auto bias = random_normal(d.OC, seed + 2);
  const auto w16 = rounded(weight);
  std::vector<bf16> w16_cpu(weight.size());
  cpu::to_bf16(w16_cpu.data(), weight.data(), int64_t(weight.size()));
  for (size_t i = 0; i < w16.size(); ++i) ASSERT_EQ(w16_cpu[i].bits, w16[i].bits) << i;
  const float* b = with_bias ? bias.data() : nullptr;
  const auto inp_abs = absolute(widened(inp)), w_abs = absolute(widened(weight));
  const auto bias_abs = absolute(bias);

  // Forward overwrites: start from NaN. IC + 1 terms (the bias prefill), gamma(IC + 5).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out_ref(size_t(d.N) * d.OC, nan), out_cpu(out_ref), out_mag(out_ref);
  ref::linear_forward_bf16(out_ref.data(), inp.data(), w16.data(), b, d.N, d.IC, d.OC);
  cpu::linear_forward_bf16(out_cpu.data(), inp.data(), w16.data(), b, d.N, d.IC, d.OC);
  ref::linear_forward(out_mag.data(), inp_abs.data(), w_abs.data(),
                      with_bias ? bias_abs.data() : nullptr, d.N, d.IC, d.OC);
  EXPECT_TRUE(within_bounds(out_cpu, out_ref, sum_bounds(out_mag, d.IC, 5), "out"));
  // And the reference is the float layer on the rounded operands, up to the same rounding.
  std::vector<float> out_f32(out_ref.size());
  ref::linear_forward(out_f32.data(), widened(inp).data(), widened(weight).data(), b, d.N, d.IC,
                      d.OC);
  EXPECT_EQ(out_f32, out_ref);

  // Backward accumulates into pre-filled buffers; gamma(K + 7) as for the float layer.
  const auto dout = random_normal(size_t(d.N) * d.OC, seed + 3);
  const auto dinp_init = random_normal(size_t(d.N) * d.IC, seed + 4);
  const auto dw_init = random_normal(weight.size(), seed + 5);
  const auto db_init = random_normal(d.OC, seed + 6);
  auto dinp_ref = dinp_init, dw_ref = dw_init, db_ref = db_init;
  ref::linear_backward_input_bf16(dinp_ref.data(), dout.data(), w16.data(), d.N, d.IC, d.OC);
  ref::linear_backward_weight_bf16(dw_ref.data(), with_bias ? db_ref.data() : nullptr, dout.data(),
                                   inp.data(), d.N, d.IC, d.OC);
  auto dinp_cpu = dinp_init, dw_cpu = dw_init, db_cpu = db_init;
  cpu::linear_backward_input_bf16(dinp_cpu.data(), dout.data(), w16.data(), d.N, d.IC, d.OC);
  cpu::linear_backward_weight_bf16(dw_cpu.data(), with_bias ? db_cpu.data() : nullptr, dout.data(),
                                   inp.data(), d.N, d.IC, d.OC);
  auto dinp_mag = absolute(dinp_init), dw_mag = absolute(dw_init), db_mag = absolute(db_init);
  // The bias gradient sums the float dout, unrounded (as autocast): the float layer's magnitude.
  ref::linear_backward(dinp_mag.data(), dw_mag.data(), nullptr, absolute(widened(dout)).data(),
                       inp_abs.data(), w_abs.data(), d.N, d.IC, d.OC);
  ref::linear_backward_weight(std::vector<float>(dw_mag.size()).data(), db_mag.data(),
                              absolute(dout).data(), inp_abs.data(), d.N, d.IC, d.OC);
  EXPECT_TRUE(within_bounds(dinp_cpu, dinp_ref, sum_bounds(dinp_mag, d.OC, 7), "dinp"));
  EXPECT_TRUE(within_bounds(dw_cpu, dw_ref, sum_bounds(dw_mag, d.N, 7), "dweight"));
  EXPECT_TRUE(within_bounds(db_cpu, db_ref, sum_bounds(db_mag, d.N, 7), "dbias"));
  if (!with_bias) {
    EXPECT_EQ(db_cpu, db_init);
  }
}

TEST(LinearBf16, CpuMatchesReferenceOnOddSizes) {
  uint64_t seed = 20;
  for (int N : {1, 3, 17}) {
    for (int IC : {1, 5, 67}) {
      for (int OC : {1, 5, 67}) {
        expect_cpu_matches_reference({N, IC, OC}, true, seed += 7);
        expect_cpu_matches_reference({N, IC, OC}, false, seed += 7);
      }
    }
  }
}

TEST(LinearBf16, CpuMatchesReferenceOnLargerSizes) {
  // Large enough for oneDNN's blocked bf16 kernels (AMX tiles where present).
  expect_cpu_matches_reference({130, 96, 300}, true, 3);
  expect_cpu_matches_reference({256, 768, 512}, false, 4);
}

// Rounding to bf16: to nearest, ties to even, NaN kept; the float layer on the rounded operands
// is what the bf16 layer computes, so its gradient is the float layer's with respect to them
// (checked by the float layer's own finite differences).
TEST(LinearBf16, RoundsToNearestEven) {
  const std::vector<float> x = {1.0f,
                                1.0f + 0x1p-8f,
                                1.0f + 0x1p-8f + 0x1p-20f,
                                1.0f + 3 * 0x1p-8f,
                                -2.5f,
                                std::numeric_limits<float>::quiet_NaN()};
  std::vector<bf16> y(x.size());
  cpu::to_bf16(y.data(), x.data(), int64_t(x.size()));
  EXPECT_EQ(bf16_to_f32(y[0]), 1.0f);
  EXPECT_EQ(bf16_to_f32(y[1]), 1.0f);                // a tie: to the even neighbour
  EXPECT_EQ(bf16_to_f32(y[2]), 1.0f + 0x1p-7f);      // above the tie: up
  EXPECT_EQ(bf16_to_f32(y[3]), 1.0f + 4 * 0x1p-8f);  // a tie: up to the even one
  EXPECT_EQ(bf16_to_f32(y[4]), -2.5f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(y[5])));
}

}  // namespace
}  // namespace tessel::kernels
