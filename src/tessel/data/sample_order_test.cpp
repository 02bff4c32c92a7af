#include "tessel/data/sample_order.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <thread>
#include <vector>

#include "tessel/core/error.h"

namespace tessel::data {
namespace {

bool is_permutation_of_range(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] != static_cast<int64_t>(i)) return false;
  return true;
}

TEST(SampleOrder, EveryEpochVisitsEverySampleOnce) {
  for (int64_t n : {1, 2, 3, 10, 97, 1000}) {
    SampleOrder order(n, 1234);
    for (int64_t epoch = 0; epoch < 4; ++epoch) {
      std::vector<int64_t> seen(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) seen[k] = order.global_sample(epoch * n + k);
      EXPECT_TRUE(is_permutation_of_range(seen)) << "n=" << n << " epoch=" << epoch;
    }
  }
}

TEST(SampleOrder, SameSeedSameOrderAcrossInstances) {
  SampleOrder a(500, 42), b(500, 42);
  std::vector<int64_t> va(1700), vb(1700);  // crosses three epoch boundaries
  a.global_samples(0, 1700, va.data());
  for (int64_t c = 0; c < 1700; ++c) vb[c] = b.global_sample(c);
  EXPECT_EQ(va, vb);
  EXPECT_EQ(epoch_permutation(500, 42, 2), *a.permutation(2));
}

TEST(SampleOrder, SeedAndEpochChangeTheOrder) {
  const auto base = epoch_permutation(1000, 42, 0);
  EXPECT_NE(base, epoch_permutation(1000, 43, 0));
  EXPECT_NE(base, epoch_permutation(1000, 42, 1));
  // A shuffle, not the identity.
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(base, identity);
}

TEST(SampleOrder, ShuffleIsUniformOverSmallPermutations) {
  // Over many (epoch) draws of a 3-element shuffle, each of the 6 permutations is equally likely
  // (Fisher-Yates with an unbiased bounded integer). Pearson chi-square, 5 dof: 20.5 is the
  // 0.1% critical value.
  const int draws = 12000;
  std::vector<int> counts(6);
  for (int e = 0; e < draws; ++e) {
    auto p = epoch_permutation(3, 7, e);
    int code = static_cast<int>(p[0] * 2 + (p[1] > p[2] ? 1 : 0));
    ++counts[static_cast<size_t>(code)];
  }
  double chi2 = 0;
  for (int c : counts) chi2 += (c - draws / 6.0) * (c - draws / 6.0) / (draws / 6.0);
  EXPECT_LT(chi2, 20.5);
}

TEST(SampleOrder, ResumeFromAnyCursorMatchesContinuing) {
  SampleOrder continuing(37, 5);
  std::vector<int64_t> all(200);
  continuing.global_samples(0, 200, all.data());
  for (int64_t cursor : {0, 1, 36, 37, 38, 100, 150}) {
    SampleOrder resumed(37, 5);  // fresh instance, empty cache
    std::vector<int64_t> rest(static_cast<size_t>(200 - cursor));
    resumed.global_samples(cursor, 200 - cursor, rest.data());
    EXPECT_TRUE(std::equal(rest.begin(), rest.end(), all.begin() + cursor)) << cursor;
  }
}

TEST(SampleOrder, ConcurrentReadersAgree) {
  SampleOrder shared(1000, 3), reference(1000, 3);
  std::vector<int64_t> expected(8000);
  reference.global_samples(0, 8000, expected.data());
  std::vector<std::vector<int64_t>> got(4, std::vector<int64_t>(8000));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Threads walk epochs in different orders, forcing cache turnover.
      for (int64_t step = 0; step < 80; ++step) {
        int64_t chunk = (t % 2 == 0) ? step : 79 - step;
        shared.global_samples(chunk * 100, 100, got[t].data() + chunk * 100);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(got[t], expected) << t;
}

TEST(SampleOrder, RejectsBadArguments) {
  EXPECT_THROW(SampleOrder(0, 1), InvalidArgumentError);
  SampleOrder order(10, 1);
  EXPECT_THROW(order.global_sample(-1), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::data
