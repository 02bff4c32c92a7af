#include "tessel/layout/zero_split.h"

#include <gtest/gtest.h>

#include <numeric>

namespace tessel::layout {
namespace {

TEST(ZeroSplit, ContiguousAndEven) {
  for (int64_t n : {1, 7, 12, 1001}) {
    for (int64_t dp : {1, 2, 3, 4}) {
      int64_t at = 0;
      for (int64_t r = 0; r < dp; ++r) {
        const auto z = zero_split(n, dp, r);
        ASSERT_EQ(int64_t(z.counts.size()), dp);
        EXPECT_EQ(std::accumulate(z.counts.begin(), z.counts.end(), int64_t(0)), n);
        EXPECT_EQ(z.lo, at) << n << " " << dp << " " << r;
        EXPECT_EQ(z.n_own, int64_t(z.counts[size_t(r)]));
        EXPECT_LE(z.counts.front() - z.counts.back(), 1u);
        at += z.n_own;
      }
      EXPECT_EQ(at, n);
    }
  }
}

}  // namespace
}  // namespace tessel::layout
