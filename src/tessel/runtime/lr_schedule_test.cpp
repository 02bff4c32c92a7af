#include "tessel/runtime/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tessel::runtime {
namespace {

TEST(LrSchedule, WarmupThenCosineToMinimum) {
  LrSchedule s{1.0, 0.1, 4, 14};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);  // decay starts at the peak
  // Step 8 is 4 of the 9 decay steps in: cosine interpolation between 1.0 and 0.1.
  EXPECT_NEAR(s.at(8), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 4.0 / 9.0)), 1e-12);
  EXPECT_DOUBLE_EQ(s.at(13), 0.1);  // the last step reaches min_lr
  for (int64_t i = 4; i < 13; ++i) EXPECT_GT(s.at(i), s.at(i + 1));
}

TEST(LrSchedule, NoWarmup) {
  LrSchedule s{2.0, 0.0, 0, 3};
  EXPECT_DOUBLE_EQ(s.at(0), 2.0);
  EXPECT_DOUBLE_EQ(s.at(1), 1.0);
  EXPECT_DOUBLE_EQ(s.at(2), 0.0);
}

}  // namespace
}  // namespace tessel::runtime
