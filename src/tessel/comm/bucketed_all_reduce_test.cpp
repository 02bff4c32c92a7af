// BucketedAllReduce on real processes: whatever offsets the backward reports and whatever the
// bucket size, every buffer ends as the sum over ranks, the same as one plain all-reduce.
#include "tessel/comm/bucketed_all_reduce.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using comm::testing::run_ranks;

// Small integers: float sums are exact in any order.
float value(int rank, int buffer, size_t i) {
  return float((rank + 1) * int((i * 7 + size_t(buffer) * 3) % 11) - 4);
}

struct Params {
  int ranks;
  int64_t bucket;
};

class BucketedAllReduceTest : public ::testing::TestWithParam<Params> {};

TEST_P(BucketedAllReduceTest, EqualsOneAllReduce) {
  const auto [size, bucket] = GetParam();
  tessel::testing::TempDir dir;
  comm::StoreOptions store;
  store.path = (dir.path() / "rendezvous").string();
  store.job_id = "buckets";
  store.timeout = 20s;
  auto outcomes = run_ranks(size, 40s, [&](int rank) {
    auto c = comm::Communicator::connect(store, "dp", rank, size, 20s);
    BucketedAllReduce reduce(*c, bucket);
    const std::vector<int64_t> sizes = {1000, 1, 0, 4097};
    std::vector<std::vector<float>> bufs;
    for (size_t b = 0; b < sizes.size(); ++b) {
      bufs.emplace_back(size_t(sizes[b]));
      reduce.add_buffer(bufs.back().data(), sizes[b]);
    }
    // Three steps, each reporting a different (decreasing) sequence of ready offsets, the same on
    // every rank, and some buffers not at all (finish() takes them).
    for (int step = 0; step < 3; ++step) {
      for (size_t b = 0; b < bufs.size(); ++b)
        for (size_t i = 0; i < bufs[b].size(); ++i) bufs[b][i] = value(rank, int(b) + step, i);
      for (int64_t from : {int64_t(3000), int64_t(999), int64_t(500), int64_t(0)})
        reduce.ready_from(int(step % 2 == 0 ? 0 : 3), from);
      reduce.ready_from(3, 4097);  // nothing complete yet: no bucket
      reduce.finish();
      for (size_t b = 0; b < bufs.size(); ++b) {
        for (size_t i = 0; i < bufs[b].size(); ++i) {
          float want = 0;
          for (int r = 0; r < size; ++r) want += value(r, int(b) + step, i);
          if (bufs[b][i] != want) {
            std::fprintf(stderr, "rank %d step %d buffer %zu element %zu: %g, want %g\n", rank,
                         step, b, i, bufs[b][i], want);
            return 1;
          }
        }
      }
    }
    return 0;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << comm::testing::describe(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Sizes, BucketedAllReduceTest,
                         ::testing::Values(Params{1, 100}, Params{2, 7}, Params{2, 333},
                                           Params{3, 100}, Params{4, 1 << 20}),
                         [](const auto& info) {
                           return std::to_string(info.param.ranks) + "ranks_bucket" +
                                  std::to_string(info.param.bucket);
                         });

// A peer that vanishes mid-step surfaces from finish() as an error, not a hang.
TEST(BucketedAllReduce, LostPeerIsRethrownByFinish) {
  tessel::testing::TempDir dir;
  comm::StoreOptions store;
  store.path = (dir.path() / "rendezvous").string();
  store.job_id = "lost";
  store.timeout = 20s;
  auto outcomes = run_ranks(2, 40s, [&](int rank) {
    auto c = comm::Communicator::connect(store, "dp", rank, 2, 2s);
    if (rank == 1) _exit(0);
    BucketedAllReduce reduce(*c, 64);
    std::vector<float> buf(1000, 1.0f);
    reduce.add_buffer(buf.data(), int64_t(buf.size()));
    reduce.ready_from(0, 0);
    try {
      reduce.finish();
    } catch (const PeerLostError&) {
      return 0;
    } catch (const TimeoutError&) {
      return 0;
    }
    return 1;
  });
  EXPECT_TRUE(outcomes[0].ok()) << comm::testing::describe(outcomes);
}

}  // namespace
}  // namespace tessel::comm
