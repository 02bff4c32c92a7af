#include "tessel/kernels/cpu/vec_math.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::kernels {
namespace {

// testing::kFastExpError is derived from fast_exp's code (testing/rounding.h); this checks the
// derivation against exp in double on every 127th float of [-87.33654, 88] (17 million values,
// every binade and every reduced argument r densely), and that results stay normal there.
TEST(FastExp, RelativeErrorWithinTheDerivedBound) {
  double worst = 0;
  float worst_x = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    const float limit = sign != 0 ? 87.33654f : 88.0f;
    for (uint32_t bits = 0; bits <= std::bit_cast<uint32_t>(limit); bits += 127) {
      const float x = std::bit_cast<float>(bits | sign);
      const float e = cpu::fast_exp(x);
      ASSERT_GE(e, std::numeric_limits<float>::min()) << x;
      const double err = std::fabs(double(e) / std::exp(double(x)) - 1);
      if (err > worst) worst = err, worst_x = x;
    }
  }
  EXPECT_LE(worst, testing::kFastExpError)
      << "at x = " << worst_x << ": " << worst / testing::kUnitRoundoff << " u";
  // And the range's ends: 0 below -87.33654 (no subnormals), exp(88) above 88.
  EXPECT_EQ(cpu::fast_exp(-87.34f), 0.0f);
  EXPECT_EQ(cpu::fast_exp(-1e30f), 0.0f);
  EXPECT_EQ(cpu::fast_exp(1e30f), cpu::fast_exp(88.0f));
  EXPECT_EQ(cpu::fast_exp(0.0f), 1.0f);  // attention's one-key rows rely on this being exact
}

}  // namespace
}  // namespace tessel::kernels
