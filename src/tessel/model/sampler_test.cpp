#include "tessel/model/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

using ::testing::HasSubstr;

std::vector<float> random_logits(int n, uint64_t seed, float scale = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x;
  for (int i = 0; i < n; ++i) x.push_back(normal(rng));
  return x;
}

std::vector<double> softmax(std::span<const float> logits, double temperature) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p;
  for (float l : logits) p.push_back(std::exp((l - mx) / temperature));
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x /= sum;
  return p;
}

// The generator is xoshiro256** seeded by splitmix64: its first outputs are pinned (computed by
// an independent Python transcription of the authors' C code, whose splitmix64 gives the
// published 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, ... for seed 0), so a sequence drawn with a
// seed is the same on every machine and in every later version.
TEST(SampleRng, PinnedSequence) {
  SampleRng zero(0), one(1);
  EXPECT_EQ(zero.next(), 0x99ec5f36cb75f2b4ULL);
  EXPECT_EQ(zero.next(), 0xbf6e1f784956452aULL);
  EXPECT_EQ(zero.next(), 0x1a5f849d4933e6e0ULL);
  EXPECT_EQ(one.next(), 0xb3f2af6d0fc710c5ULL);
  EXPECT_EQ(one.next(), 0x853b559647364ceaULL);
  SampleRng u(1);
  EXPECT_EQ(u.uniform(), double(0xb3f2af6d0fc710c5ULL >> 11) * 0x1p-53);
  for (int i = 0; i < 1000; ++i) {
    const double x = u.uniform();
    ASSERT_GE(x, 0.0);
    ASSERT_LT(x, 1.0);
  }
}

TEST(Sampler, GreedyPicksTheArgmaxLowestIdOnTies) {
  Sampler greedy({.temperature = 0, .top_k = 0, .top_p = 1}, 1);
  EXPECT_EQ(greedy.sample(std::vector<float>{0.1f, 2.0f, -1.0f, 1.9f}), 1);
  EXPECT_EQ(greedy.sample(std::vector<float>{-5.0f, 3.0f, 3.0f, 3.0f}), 1);
  const float ninf = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(greedy.sample(std::vector<float>{ninf, ninf, -7.0f}), 2);
  EXPECT_EQ(argmax(std::vector<float>{4.0f}), 0);
  for (uint64_t s = 0; s < 20; ++s) {
    const auto x = random_logits(300, s);
    const auto best = std::max_element(x.begin(), x.end());
    EXPECT_EQ(greedy.sample(x), int32_t(best - x.begin()));
  }
  const auto p = greedy.distribution(std::vector<float>{0.0f, 1.0f, 1.0f});
  EXPECT_EQ(p, (std::vector<double>{0.0, 1.0, 0.0}));
}

// top-k = 1 keeps one id, the argmax, at any temperature and top-p, with ties to the lowest id.
TEST(Sampler, TopK1EqualsGreedy) {
  Sampler greedy({.temperature = 0, .top_k = 0, .top_p = 1}, 3);
  Sampler k1({.temperature = 1.0, .top_k = 1, .top_p = 1}, 4);
  Sampler k1_hot({.temperature = 5.0, .top_k = 1, .top_p = 0.5}, 5);
  for (uint64_t s = 0; s < 50; ++s) {
    auto x = random_logits(100, s);
    if (s % 5 == 0) x[17] = x[60] = *std::max_element(x.begin(), x.end()) + 1;  // a tie
    const int32_t want = greedy.sample(x);
    EXPECT_EQ(k1.sample(x), want) << s;
    EXPECT_EQ(k1_hot.sample(x), want) << s;
  }
}

TEST(Sampler, TemperatureScalesTheLogits) {
  const auto x = random_logits(40, 8);
  for (double t : {0.25, 1.0, 3.0}) {
    Sampler s({.temperature = t, .top_k = 0, .top_p = 1}, 1);
    const auto got = s.distribution(x);
    const auto want = softmax(x, t);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << t << " " << i;
  }
}

// Hand-made: probabilities 0.15, 0.5, 0.05, 0.3 for ids 0..3 (not in order), so by mass the
// order is 1, 3, 0, 2 with running sums 0.5, 0.8, 0.95, 1.
TEST(Sampler, TopPKeepsTheSmallestSetWithEnoughMass) {
  const std::vector<float> x = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  auto kept = [&](double p, int k = 0) {
    Sampler s({.temperature = 1, .top_k = k, .top_p = p}, 1);
    const auto d = s.distribution(x);
    std::vector<int> ids;
    for (int i = 0; i < 4; ++i)
      if (d[size_t(i)] > 0) ids.push_back(i);
    return ids;
  };
  EXPECT_EQ(kept(0.3), (std::vector<int>{1}));
  EXPECT_EQ(kept(0.5 - 1e-6), (std::vector<int>{1}));
  EXPECT_EQ(kept(0.75), (std::vector<int>{1, 3}));
  EXPECT_EQ(kept(0.9), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(kept(0.96), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(kept(1.0), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(kept(1e-9), (std::vector<int>{1}));  // never empty
  // top-k first, then top-p of what it kept: 0.9 of {1, 3}'s 0.8 is 0.72, reached by both.
  EXPECT_EQ(kept(0.9, 2), (std::vector<int>{1, 3}));
  EXPECT_EQ(kept(0.6, 3), (std::vector<int>{1, 3}));
  EXPECT_EQ(kept(1.0, 3), (std::vector<int>{0, 1, 3}));
  // The kept ids share the mass in their old proportions.
  Sampler s({.temperature = 1, .top_k = 0, .top_p = 0.75}, 1);
  const auto d = s.distribution(x);
  EXPECT_NEAR(d[1], 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(d[3], 0.3 / 0.8, 1e-6);
}

// On random rows: the kept set holds at least p of the mass, dropping its least likely member
// would leave less than p, and no dropped id is more likely than a kept one.
TEST(Sampler, TopPIsMinimalOnRandomRows) {
  std::mt19937_64 rng(2);
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const auto x = random_logits(200, 100 + seed, 2.0f);
    const double p = std::uniform_real_distribution<double>(0.05, 0.99)(rng);
    const auto full = softmax(x, 1.0);
    const auto d = Sampler({.temperature = 1, .top_k = 0, .top_p = p}, 1).distribution(x);
    double mass = 0, least_kept = 1, most_dropped = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      if (d[i] > 0) {
        mass += full[i];
        least_kept = std::min(least_kept, full[i]);
      } else {
        most_dropped = std::max(most_dropped, full[i]);
      }
    }
    EXPECT_GE(mass, p - 1e-12) << seed;
    EXPECT_LT(mass - least_kept, p + 1e-12) << seed;
    EXPECT_GE(least_kept, most_dropped) << seed;
  }
}

// n draws: each id's count is Binomial(n, p_i). For a correct sampler |count - n p_i| <=
// 6 sqrt(n p_i (1 - p_i)) fails for a given id with probability below 2e-9 (the normal
// approximation's two-sided 6-sigma tail, sound here with n p_i >= 1000), so for all but a
// negligible share of seeds. The check has power: for the likeliest id (p about 0.4, n p = 80000)
// 6 sigma is 1300 draws, so a sampler whose probability is off by 2% of p_i fails; a draw outside
// the kept set (top-k, top-p) fails at once.
TEST(Sampler, DrawsFollowTheDistribution) {
  const std::vector<float> x = {1.0f, 2.5f, 0.0f, -1.0f, 2.0f, 0.5f};
  const int n = 200000;
  for (const SamplingOptions& o : {SamplingOptions{.temperature = 1, .top_k = 0, .top_p = 1},
                                   SamplingOptions{.temperature = 0.7, .top_k = 3, .top_p = 1},
                                   SamplingOptions{.temperature = 1.3, .top_k = 0, .top_p = 0.8}}) {
    Sampler s(o, 42);
    const auto p = s.distribution(x);
    std::vector<int64_t> count(x.size(), 0);
    for (int i = 0; i < n; ++i) ++count[size_t(s.sample(x))];
    for (size_t i = 0; i < x.size(); ++i) {
      const double mean = n * p[i], sigma = std::sqrt(n * p[i] * (1 - p[i]));
      if (p[i] == 0) {
        EXPECT_EQ(count[i], 0) << "id " << i << " is outside the kept set";
      } else {
        EXPECT_GE(mean, 1000.0);
        EXPECT_LE(std::fabs(double(count[i]) - mean), 6 * sigma)
            << "id " << i << " temperature " << o.temperature << " top_k " << o.top_k;
      }
    }
  }
  // Unfiltered at temperature 1 the distribution is the softmax.
  const auto p = Sampler({.temperature = 1, .top_k = 0, .top_p = 1}, 1).distribution(x);
  const auto want = softmax(x, 1.0);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(p[i], want[i], 1e-12);
}

TEST(Sampler, SameSeedSameSequence) {
  const SamplingOptions o{.temperature = 1.0, .top_k = 50, .top_p = 0.95};
  auto draw = [&](uint64_t seed) {
    Sampler s(o, seed);
    std::vector<int32_t> ids;
    for (uint64_t i = 0; i < 200; ++i) ids.push_back(s.sample(random_logits(500, i, 1.0f)));
    return ids;
  };
  const auto a = draw(7);
  EXPECT_EQ(draw(7), a);
  EXPECT_NE(draw(8), a);
}

TEST(Sampler, RejectsBadOptionsAndLogits) {
  auto what = [](SamplingOptions o) {
    return testing::error_of<InvalidArgumentError>([&] { Sampler(o, 1); });
  };
  EXPECT_THAT(what({.temperature = -1}), HasSubstr("temperature is -1"));
  EXPECT_THAT(what({.temperature = std::nan("")}), HasSubstr("temperature is nan"));
  EXPECT_THAT(what({.temperature = HUGE_VAL}), HasSubstr("temperature is inf"));
  EXPECT_THAT(what({.top_k = -2}), HasSubstr("top_k is -2"));
  EXPECT_THAT(what({.top_p = 0}), HasSubstr("top_p is 0"));
  EXPECT_THAT(what({.top_p = 1.5}), HasSubstr("top_p is 1.5"));
  Sampler s({}, 1);
  EXPECT_THROW(s.sample({}), InvalidArgumentError);
  EXPECT_THAT(testing::error_of<InvalidArgumentError>([&] {
                s.sample(std::vector<float>{0.0f, std::nanf("")});
              }),
              HasSubstr("logit 1 of 2 is nan"));
  EXPECT_THROW(s.sample(std::vector<float>{0.0f, HUGE_VALF}), InvalidArgumentError);
  Sampler greedy({.temperature = 0}, 1);
  EXPECT_THROW(greedy.sample(std::vector<float>{std::nanf(""), 1.0f}), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::model
