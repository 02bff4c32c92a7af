#include "tessel/model/local_tp_group_test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tessel/core/error.h"

namespace tessel::model {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// Rank-dependent values whose float sum depends on the summation order (mixed magnitudes), so
// that a rank summing in another order would produce other bits.
float value(int rank, size_t i, int round) {
  return float(std::sin(double(i) * 0.7 + rank * 1.3 + round)) * (rank % 2 ? 1e4f : 1e-3f) +
         float(rank);
}

TEST(LocalTpGroup, SumAndMaxAreExactAndIdenticalOnEveryRank) {
  for (int size = 1; size <= 4; ++size) {
    SCOPED_TRACE(size);
    const size_t n = 37;
    const int rounds = 20;
    std::vector<std::vector<float>> sums(static_cast<size_t>(size)),
        maxes(static_cast<size_t>(size));
    LocalTpGroup::run(size, [&](TpGroup& g) {
      EXPECT_EQ(g.size(), size);
      std::vector<float>& my_sums = sums[size_t(g.rank())];
      std::vector<float>& my_maxes = maxes[size_t(g.rank())];
      // Many rounds with changing sizes: the rendezvous must be reusable back to back.
      for (int round = 0; round < rounds; ++round) {
        const size_t len = n + size_t(round % 3);
        std::vector<float> s(len), m(len);
        for (size_t i = 0; i < len; ++i) {
          s[i] = value(g.rank(), i, round);
          m[i] = g.rank() == 1 && i == 0 ? -INFINITY : value(g.rank(), i, round);
        }
        g.all_reduce_sum(s.data(), len);
        g.all_reduce_max(m.data(), len);
        my_sums.insert(my_sums.end(), s.begin(), s.end());
        my_maxes.insert(my_maxes.end(), m.begin(), m.end());
      }
    });
    // Expected: the rank-order float sum and the max, computed here.
    std::vector<float> want_sum, want_max;
    for (int round = 0; round < rounds; ++round) {
      const size_t len = n + size_t(round % 3);
      for (size_t i = 0; i < len; ++i) {
        float s = value(0, i, round), m = value(0, i, round);
        for (int r = 1; r < size; ++r) {
          s += value(r, i, round);
          const float x = r == 1 && i == 0 ? -INFINITY : value(r, i, round);
          m = std::max(m, x);
        }
        want_sum.push_back(s);
        want_max.push_back(m);
      }
    }
    for (int r = 0; r < size; ++r) {
      ASSERT_EQ(sums[size_t(r)].size(), want_sum.size());
      EXPECT_EQ(std::memcmp(sums[size_t(r)].data(), want_sum.data(), want_sum.size() * 4), 0) << r;
      EXPECT_EQ(maxes[size_t(r)], want_max) << r;
    }
  }
}

TEST(LocalTpGroup, AllPaddingMaxStaysMinusInfinity) {
  LocalTpGroup::run(2, [](TpGroup& g) {
    float x[2] = {-INFINITY, g.rank() == 0 ? -INFINITY : 3.0f};
    g.all_reduce_max(x, 2);
    EXPECT_EQ(x[0], -INFINITY);
    EXPECT_EQ(x[1], 3.0f);
  });
}

TEST(LocalTpGroup, MismatchedCollectivesThrowOnEveryRank) {
  std::vector<int> threw(2, 0);
  EXPECT_THROW(LocalTpGroup::run(2,
                                 [&](TpGroup& g) {
                                   std::vector<float> x(4, 1.0f);
                                   try {
                                     g.all_reduce_sum(x.data(), g.rank() == 0 ? 3 : 4);
                                   } catch (const InvalidArgumentError&) {
                                     threw[size_t(g.rank())] = 1;
                                     throw;
                                   }
                                 }),
               InvalidArgumentError);
  EXPECT_EQ(threw, (std::vector<int>{1, 1}));
  // A sum against a max is a mismatch too.
  EXPECT_THROW(LocalTpGroup::run(2,
                                 [](TpGroup& g) {
                                   float x = 1.0f;
                                   if (g.rank() == 0) {
                                     g.all_reduce_sum(&x, 1);
                                   } else {
                                     g.all_reduce_max(&x, 1);
                                   }
                                 }),
               InvalidArgumentError);
}

TEST(LocalTpGroup, MissingRankTimesOutNamingIt) {
  auto groups = LocalTpGroup::create(3, 50ms);
  // Rank 0 and 1 call, rank 2 never does (run on this thread, rank 1 on another).
  std::exception_ptr other;
  std::thread t([&] {
    try {
      float x = 1.0f;
      groups[1]->all_reduce_sum(&x, 1);
    } catch (...) {
      other = std::current_exception();
    }
  });
  float x = 1.0f;
  try {
    groups[0]->all_reduce_sum(&x, 1);
    ADD_FAILURE() << "expected a timeout";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank(s) 2"));
  } catch (const PeerLostError&) {
    // Rank 1 timed out first and broke the group.
  }
  t.join();
  ASSERT_TRUE(other);
  // The group is broken for good: every later call fails at once.
  EXPECT_THROW(groups[2]->all_reduce_sum(&x, 1), PeerLostError);
  EXPECT_THROW(groups[0]->all_reduce_max(&x, 1), PeerLostError);
}

TEST(LocalTpGroup, ThrowingRankAbortsItsPeersInsteadOfHangingThem) {
  // The timeout is long: the peers must be woken by the abort, not by the timeout. (The test does
  // not time anything; with a broken abort it would still pass, after 10 minutes, which CTest's
  // timeout reports.)
  try {
    LocalTpGroup::run(
        3,
        [](TpGroup& g) {
          if (g.rank() == 1) throw std::runtime_error("boom on rank 1");
          float x = 1.0f;
          g.all_reduce_sum(&x, 1);
        },
        std::chrono::milliseconds(600000));
    ADD_FAILURE() << "expected the rank's exception";
  } catch (const std::runtime_error& e) {
    // The original failure is rethrown, not the peers' PeerLostError.
    EXPECT_STREQ(e.what(), "boom on rank 1");
  }
}

TEST(LocalTpGroup, SizeOneIsANoOpAndBadArgumentsThrow) {
  auto one = LocalTpGroup::create(1);
  float x[3] = {1, 2, 3};
  one[0]->all_reduce_sum(x, 3);
  one[0]->all_reduce_max(x, 3);
  EXPECT_EQ(x[2], 3.0f);
  EXPECT_EQ(one[0]->rank(), 0);
  EXPECT_EQ(one[0]->size(), 1);
  EXPECT_THROW(LocalTpGroup::create(0), InvalidArgumentError);
  EXPECT_THROW(LocalTpGroup::create(2, 0ms), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::model
