#include "tessel/comm/communicator.h"

#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>

#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using testing::catch_error;
using testing::Caught;
using testing::contains;
using testing::kChildOk;
using testing::run_ranks;
using testing::Thrown;
using testing::touch;
using testing::wait_for_file;
using testing::what_throws;

StoreOptions store_in(const tessel::testing::TempDir& dir, int64_t generation = 0,
                      std::chrono::milliseconds timeout = 20s) {
  return testing::file_store(dir, "job-a", generation, timeout);
}

// A value every rank can compute for any rank: small integers, so float sums are exact and the
// expectation does not depend on the order of additions.
template <typename T>
T value(int rank, size_t i, int salt) {
  return T((rank + 1) * int((i * 7 + size_t(salt)) % 13) - 5);
}

template <typename T>
std::vector<T> values(int rank, size_t n, int salt) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = value<T>(rank, i, salt);
  return v;
}

template <typename T>
T sum_over_ranks(int size, size_t i, int salt) {
  T s = 0;
  for (int r = 0; r < size; ++r) s += value<T>(r, i, salt);
  return s;
}

// Index of the first element that differs from the expected sum, or n.
template <typename T>
size_t first_bad_sum(const T* got, size_t begin, size_t end, int size, int salt) {
  for (size_t i = begin; i < end; ++i) {
    if (got[i] != sum_over_ranks<T>(size, i, salt)) return i;
  }
  return end;
}

const std::vector<size_t> kLengths = {0, 1, 7, (size_t(1) << 20) + 3};

template <typename T>
int check_all_reduce(Communicator& c, int salt) {
  const int r = c.rank();
  for (size_t n : kLengths) {
    auto v = values<T>(r, n, salt);
    c.all_reduce_sum(v.data(), n);
    const size_t bad = first_bad_sum(v.data(), 0, n, c.size(), salt);
    CHILD_CHECK(bad == n, r,
                "all_reduce_sum n=" + std::to_string(n) + " wrong at " + std::to_string(bad));
  }
  return kChildOk;
}

template <typename T>
int check_reduce_scatter(Communicator& c, const std::vector<size_t>& counts, int salt) {
  const int r = c.rank();
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t(0));
  auto v = values<T>(r, total, salt);
  c.reduce_scatter_sum(v.data(), counts);
  const size_t begin = std::accumulate(counts.begin(), counts.begin() + r, size_t(0));
  const size_t end = begin + counts[r];
  const size_t bad = first_bad_sum(v.data(), begin, end, c.size(), salt);
  CHILD_CHECK(
      bad == end, r,
      "reduce_scatter_sum total=" + std::to_string(total) + " wrong at " + std::to_string(bad));
  return kChildOk;
}

template <typename T>
int check_all_gather(Communicator& c, size_t n, bool in_place, int salt) {
  const int r = c.rank();
  const int size = c.size();
  std::vector<T> out(n * size_t(size), T(99));
  auto mine = values<T>(r, n, salt);
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + ptrdiff_t(size_t(r) * n));
    c.all_gather(out.data() + size_t(r) * n, n, out.data());
  } else {
    c.all_gather(mine.data(), n, out.data());
  }
  for (int k = 0; k < size; ++k) {
    for (size_t i = 0; i < n; ++i) {
      CHILD_CHECK(out[size_t(k) * n + i] == value<T>(k, i, salt), r,
                  "all_gather n=" + std::to_string(n) + " from rank " + std::to_string(k));
    }
  }
  return kChildOk;
}

int check_all_gather_v(Communicator& c, const std::vector<size_t>& counts, bool in_place) {
  const int r = c.rank();
  std::vector<size_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  std::vector<double> out(offsets.back(), -1.0);
  auto mine = values<double>(r, counts[r], 3);
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + ptrdiff_t(offsets[r]));
    c.all_gather_v(out.data() + offsets[r], counts, out.data());
  } else {
    c.all_gather_v(mine.data(), counts, out.data());
  }
  for (int k = 0; k < c.size(); ++k) {
    for (size_t i = 0; i < counts[k]; ++i) {
      CHILD_CHECK(out[offsets[k] + i] == value<double>(k, i, 3), r,
                  "all_gather_v from rank " + std::to_string(k));
    }
  }
  return kChildOk;
}

int check_broadcast(Communicator& c, size_t n, int root) {
  const int r = c.rank();
  std::vector<int64_t> v = r == root ? values<int64_t>(root, n, 5) : std::vector<int64_t>(n, -7);
  c.broadcast(v.data(), n, root);
  for (size_t i = 0; i < n; ++i) {
    CHILD_CHECK(v[i] == value<int64_t>(root, i, 5), r,
                "broadcast n=" + std::to_string(n) + " root=" + std::to_string(root));
  }
  return kChildOk;
}

#define RUN_CHECK(expr)                  \
  do {                                   \
    int code_ = (expr);                  \
    if (code_ != kChildOk) return code_; \
  } while (0)

int run_all_collectives(Communicator& c) {
  const int size = c.size();
  const int r = c.rank();
  RUN_CHECK(check_all_reduce<float>(c, 1));
  RUN_CHECK(check_all_reduce<double>(c, 2));
  RUN_CHECK(check_all_reduce<int64_t>(c, 3));
  RUN_CHECK(check_all_reduce<int32_t>(c, 4));

  for (size_t total : {size_t(0), size_t(1), size_t(5), (size_t(1) << 20) + 1}) {
    RUN_CHECK(check_reduce_scatter<float>(c, even_counts(total, size), 5));
  }
  std::vector<size_t> uneven(static_cast<size_t>(size));
  for (int k = 0; k < size; ++k) uneven[k] = size_t((k * 5) % 4) * 1000 + size_t(k % 2);
  uneven[0] = 0;  // a rank with nothing to receive
  RUN_CHECK(check_reduce_scatter<double>(c, uneven, 6));
  RUN_CHECK(check_reduce_scatter<int64_t>(c, even_counts(1001, size), 7));

  for (size_t n : {size_t(0), size_t(1), size_t(1000)}) {
    RUN_CHECK(check_all_gather<float>(c, n, false, 8));
    RUN_CHECK(check_all_gather<float>(c, n, true, 9));
  }
  RUN_CHECK(check_all_gather<uint8_t>(c, 3, false, 10));
  RUN_CHECK(check_all_gather<int64_t>(c, (size_t(1) << 16) + 1, false, 11));

  std::vector<size_t> counts(static_cast<size_t>(size));
  for (int k = 0; k < size; ++k) counts[k] = size_t((k * 3 + 1) % 4) * 100;
  RUN_CHECK(check_all_gather_v(c, counts, false));
  RUN_CHECK(check_all_gather_v(c, counts, true));
  RUN_CHECK(check_all_gather_v(c, std::vector<size_t>(size_t(size), 0), false));

  for (int root = 0; root < size; ++root) {
    for (size_t n : {size_t(0), size_t(1), size_t(100000)}) RUN_CHECK(check_broadcast(c, n, root));
  }
  std::string text = r == size - 1 ? "hello from the last rank" : std::string(24, '?');
  c.broadcast_bytes(text.data(), text.size(), size - 1);
  CHILD_CHECK(text == "hello from the last rank", r, "broadcast_bytes gave '" + text + "'");

  c.barrier();
  c.barrier(5s);
  CHILD_CHECK(c.failure().empty(), r, c.failure());
  return kChildOk;
}

TEST(CommunicatorTest, SizeOneGroupWorksWithoutPeers) {
  tessel::testing::TempDir dir;
  auto c = Communicator::connect(store_in(dir), "solo", 0, 1);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(run_all_collectives(*c), kChildOk);
  EXPECT_THROW(c->send(nullptr, 0, 0, 1), InvalidArgumentError);
  EXPECT_THROW(c->recv(nullptr, 0, 0, 1), InvalidArgumentError);
  EXPECT_THROW(c->broadcast<float>(nullptr, 0, 1), InvalidArgumentError);
  EXPECT_THROW(c->reduce_scatter_sum<float>(nullptr, {1, 2}), InvalidArgumentError);
  EXPECT_THROW(c->all_reduce_sum<float>(nullptr, 0, 0ms), InvalidArgumentError);
}

TEST(CommunicatorTest, ConnectRejectsBadArguments) {
  tessel::testing::TempDir dir;
  EXPECT_THROW(Communicator::connect(store_in(dir), "g", 2, 2), ConfigError);
  EXPECT_THROW(Communicator::connect(store_in(dir), "g", -1, 2), ConfigError);
  EXPECT_THROW(Communicator::connect(store_in(dir), "g", 0, 0), ConfigError);
  EXPECT_THROW(Communicator::connect(store_in(dir), "a/b", 0, 1), ConfigError);
  EXPECT_THROW(Communicator::connect(store_in(dir), "g", 0, 1, 0ms), ConfigError);
  auto bad = store_in(dir);
  bad.job_id = "";
  EXPECT_THROW(Communicator::connect(bad, "g", 0, 1), ConfigError);
}

TEST(CommunicatorTest, EvenCountsSplitsRemainderToFirstRanks) {
  EXPECT_EQ(even_counts(10, 4), (std::vector<size_t>{3, 3, 2, 2}));
  EXPECT_EQ(even_counts(0, 3), (std::vector<size_t>{0, 0, 0}));
  EXPECT_EQ(even_counts(2, 3), (std::vector<size_t>{1, 1, 0}));
  EXPECT_THROW(even_counts(1, 0), InvalidArgumentError);
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, MatchLocalExpectations) {
  const int size = GetParam();
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(size, 40s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, size, 20s);
    CHILD_CHECK(c->rank() == rank && c->size() == size, rank, "rank/size");
    return run_all_collectives(*c);
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

TEST_P(CollectivesTest, SendRecvRingAndTags) {
  const int size = GetParam();
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(size, 40s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, size, 20s);
    const int right = (rank + 1) % size;
    const int left = (rank + size - 1) % size;

    // A ring: everyone sends to the right and receives from the left at once.
    auto mine = values<float>(rank, 100000, 1);
    std::vector<float> got(mine.size(), 0.f);
    auto rq = c->recv(got.data(), got.size() * sizeof(float), left, 7);
    auto sq = c->send(mine.data(), mine.size() * sizeof(float), right, 7);
    sq.wait();
    rq.wait(5s);
    CHILD_CHECK(rq.completed() && sq.completed(), rank, "requests not completed");
    CHILD_CHECK(got == values<float>(left, mine.size(), 1), rank, "ring payload");

    // Tags separate transfers: receives posted in the opposite order of the sends.
    std::vector<int32_t> a(3), b(5);
    std::vector<int32_t> a_out{rank, 1, 2}, b_out{rank, 3, 4, 5, 6};
    auto rb = c->recv(b.data(), b.size() * sizeof(int32_t), left, 20);
    auto ra = c->recv(a.data(), a.size() * sizeof(int32_t), left, 10);
    auto sa = c->send(a_out.data(), a_out.size() * sizeof(int32_t), right, 10);
    auto sb = c->send(b_out.data(), b_out.size() * sizeof(int32_t), right, 20);
    ra.wait();
    rb.wait();
    sa.wait();
    sb.wait();
    CHILD_CHECK(a == (std::vector<int32_t>{left, 1, 2}), rank, "tag 10 payload");
    CHILD_CHECK(b == (std::vector<int32_t>{left, 3, 4, 5, 6}), rank, "tag 20 payload");

    // Zero-length messages complete too.
    auto rz = c->recv(nullptr, 0, left, 30);
    auto sz = c->send(nullptr, 0, right, 30);
    rz.wait();
    sz.wait();

    // Everyone to everyone, several messages with the same tag arriving in posting order.
    std::vector<Request> pending;
    std::vector<std::array<int64_t, 2>> inbox(size_t(size) * 2);
    std::vector<std::array<int64_t, 2>> outbox(size_t(size) * 2);
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      for (int m = 0; m < 2; ++m) {
        auto& box = inbox[size_t(p) * 2 + size_t(m)];
        pending.push_back(c->recv(box.data(), sizeof(box), p, 40));
      }
    }
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      for (int m = 0; m < 2; ++m) {
        auto& box = outbox[size_t(p) * 2 + size_t(m)];
        box = {rank, m};
        pending.push_back(c->send(box.data(), sizeof(box), p, 40));
      }
    }
    for (auto& q : pending) q.wait();
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      for (int m = 0; m < 2; ++m) {
        const auto& box = inbox[size_t(p) * 2 + size_t(m)];
        CHILD_CHECK(box[0] == p && box[1] == m, rank, "all-to-all message order");
      }
    }

    // Collectives still work after point-to-point traffic.
    return check_all_reduce<float>(*c, 12);
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(CommunicatorTest, GenerationsOfOneJobDoNotClash) {
  tessel::testing::TempDir dir;
  for (auto [generation, size] : {std::pair<int64_t, int>{0, 2}, {1, 3}, {2, 2}}) {
    const auto store = store_in(dir, generation);
    auto outcomes = run_ranks(size, 30s, [&](int rank) {
      auto c = Communicator::connect(store, "world", rank, size, 20s);
      auto v = values<float>(rank, 1000, 1);
      c->all_reduce_sum(v.data(), v.size());
      CHILD_CHECK(first_bad_sum(v.data(), 0, v.size(), size, 1) == v.size(), rank, "sum");
      return kChildOk;
    });
    for (const auto& o : outcomes) {
      EXPECT_TRUE(o.ok()) << "generation " << generation << "\n" << testing::describe(outcomes);
    }
  }
  // Re-using a generation whose keys are already in the directory is refused, not mis-wired.
  const auto reused = store_in(dir, 1, 2s);
  auto outcomes = run_ranks(1, 20s, [&](int) {
    try {
      Communicator::connect(reused, "world", 0, 3, 20s);
    } catch (const ConfigError& e) {
      std::fprintf(stderr, "expected ConfigError: %s\n", e.what());
      return kChildOk;
    }
    return testing::kChildCheckFailed;
  });
  EXPECT_TRUE(outcomes[0].ok()) << testing::describe(outcomes);
}

TEST(CommunicatorTest, RendezvousTimesOutWhenPeersNeverArrive) {
  tessel::testing::TempDir dir;
  const auto store = store_in(dir, 0, 50ms);
  auto outcomes = run_ranks(1, 20s, [&](int rank) {
    Thrown t = what_throws(rank, [&] { Communicator::connect(store, "world", 0, 2, 20s); });
    CHILD_CHECK(t == Thrown::kTimeout, rank, thrown_name(t));
    return kChildOk;
  });
  EXPECT_TRUE(outcomes[0].ok()) << testing::describe(outcomes);
}

// Rank 0 waits for a message that never comes, with a 10 ms timeout; rank 1 waits (20 s) for a
// message from rank 0. The deadline (10 s) is far below rank 1's timeout, so the test also proves
// that rank 0's failure reaches rank 1 as a lost peer instead of leaving it to time out.
TEST(CommunicatorTest, TenMillisecondTimeoutFires) {
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(2, 10s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, rank == 0 ? 10ms : 20s);
    int64_t x = 0;
    if (rank == 0) {
      auto q = c->recv(&x, sizeof(x), 1, 5);
      Thrown t = what_throws(rank, [&] { q.wait(); });
      CHILD_CHECK(t == Thrown::kTimeout, rank, thrown_name(t));
      // The communicator stays broken and says so with the same kind of error.
      t = what_throws(rank, [&] { c->barrier(); });
      CHILD_CHECK(t == Thrown::kTimeout, rank, thrown_name(t));
      CHILD_CHECK(!c->failure().empty(), rank, "failure() is empty");
    } else {
      auto q = c->recv(&x, sizeof(x), 0, 6);
      Thrown t = what_throws(rank, [&] { q.wait(); });
      CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
    }
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

// A per-call timeout overrides the communicator's (60 s here): ranks 0 and 1 all-reduce with
// 10 ms while rank 2 never joins. The rank that waits on rank 2 times out; its neighbours may
// see that as a lost peer. Exit codes: 10 = TimeoutError, 11 = PeerLostError.
TEST(CommunicatorTest, PerCallTimeoutOverridesDefault) {
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(3, 10s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 3, 60s);
    Thrown t;
    if (rank == 2) {
      int64_t x = 0;
      auto q = c->recv(&x, sizeof(x), 0, 1);
      t = what_throws(rank, [&] { q.wait(30s); });
      CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
      return kChildOk;
    }
    std::vector<float> v(1 << 16, 1.f);
    t = what_throws(rank, [&] { c->all_reduce_sum(v.data(), v.size(), 10ms); });
    CHILD_CHECK(t == Thrown::kTimeout || t == Thrown::kPeerLost, rank, thrown_name(t));
    return t == Thrown::kTimeout ? 10 : 11;
  });
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_TRUE(outcomes[2].ok()) << testing::describe(outcomes);
  int timeouts = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(outcomes[r].signal == 0 &&
                (outcomes[r].exit_code == 10 || outcomes[r].exit_code == 11))
        << testing::describe(outcomes);
    timeouts += outcomes[r].exit_code == 10;
  }
  EXPECT_GE(timeouts, 1) << testing::describe(outcomes);
}

// A peer dies while a large message to or from it is half transferred. Gloo does not wake such a
// transfer when the connection breaks (only queued ones); the watchdog must, long before the
// 30 s timeout.
class KillMidMessageTest : public ::testing::TestWithParam<bool> {};

TEST_P(KillMidMessageTest, PartnerSeesPeerLost) {
  const bool victim_sends = GetParam();
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(2, 15s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, 30s);
    std::vector<char> buf(size_t(64) << 20, 1);
    const bool victim = rank == 0;
    if (victim) {
      std::thread([] {
        std::this_thread::sleep_for(30ms);
        std::raise(SIGKILL);
      }).detach();
    }
    const bool sender = victim == victim_sends;
    Thrown t = what_throws(rank, [&] {
      for (int i = 0; i < 100000; ++i) {
        auto q = sender ? c->send(buf.data(), buf.size(), 1 - rank, 1)
                        : c->recv(buf.data(), buf.size(), 1 - rank, 1);
        q.wait();
      }
    });
    CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
    return kChildOk;
  });
  EXPECT_EQ(outcomes[0].signal, SIGKILL) << testing::describe(outcomes);
  EXPECT_TRUE(outcomes[1].ok()) << testing::describe(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Directions, KillMidMessageTest, ::testing::Bool(), [](const auto& info) {
  return std::string(info.param ? "VictimSends" : "VictimReceives");
});

// Rank 2 dies while rank 0 is busy outside the communicator ("computing") and rank 1 waits for a
// message from rank 0. Rank 0's communicator is marked broken without any call (failure() says
// so) and its next call fails with PeerLostError and closes its connections, which ends rank 1's
// wait with PeerLostError too, long before rank 1's 30 s timeout.
TEST(CommunicatorTest, PeerLossWhileIdleFailsTheNextCall) {
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(3, 10s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 3, 30s);
    if (rank == 2) std::raise(SIGKILL);
    if (rank == 1) {
      int64_t x = 0;
      // Posting may already fail (the watchdog may have seen rank 2 go by then), or the wait.
      Thrown t = what_throws(rank, [&] {
        auto q = c->recv(&x, sizeof(x), 0, 9);
        q.wait();
      });
      CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
      return kChildOk;
    }
    const auto give_up = std::chrono::steady_clock::now() + 5s;
    while (c->failure().empty() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(1ms);
    }
    CHILD_CHECK(!c->failure().empty(), rank, "failure() stayed empty after the peer died");
    Thrown t = what_throws(rank, [&] { c->barrier(); });
    CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
    return kChildOk;
  });
  EXPECT_TRUE(outcomes[0].ok()) << testing::describe(outcomes);
  EXPECT_TRUE(outcomes[1].ok()) << testing::describe(outcomes);
  EXPECT_EQ(outcomes[2].signal, SIGKILL) << testing::describe(outcomes);
}

// A peer that finished the last collective and exited must not fail the others' completion of
// that collective: the watchdog only aborts waits on the lost peer. In a tree broadcast the root
// is done once its sends are out and exits at once, while rank 3 still waits for rank 1 to
// forward the 64 MiB; rank 3 must get the data, not a PeerLostError.
TEST(CommunicatorTest, PeersLeavingAfterTheLastCollectiveDoNotFailIt) {
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(4, 20s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 4, 20s);
    std::vector<float> v(1000, 1.f);
    c->all_reduce_sum(v.data(), v.size());
    CHILD_CHECK(v[999] == 4.f, rank, "sum");
    std::vector<int32_t> big(size_t(16) << 20, rank == 0 ? 7 : 0);
    c->broadcast(big.data(), big.size(), 0);
    CHILD_CHECK(big.front() == 7 && big.back() == 7, rank, "broadcast payload");
    return kChildOk;  // exits (closing its connections) as soon as its part is done
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

enum class KillDuring { kAllReduce, kReduceScatter, kSendRecv };

class SigkillTest : public ::testing::TestWithParam<KillDuring> {};

// One of four workers is SIGKILLed while all of them loop over a collective. With a 30 s timeout
// and a 15 s deadline, the survivors can only pass by detecting the lost peer (the parent's
// deadline bounds the wait for the other survivors).
TEST_P(SigkillTest, SurvivorsEndWithPeerLost) {
  const KillDuring op = GetParam();
  constexpr int kSize = 4;
  constexpr int kVictim = 2;
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(kSize, 15s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, kSize, 30s);
    if (rank == kVictim) {
      std::thread([] {
        std::this_thread::sleep_for(150ms);
        std::raise(SIGKILL);
      }).detach();
    }
    std::vector<float> v(size_t(1) << 18, 1.f);
    std::vector<float> in(v.size(), 0.f);
    const int right = (rank + 1) % kSize;
    const int left = (rank + kSize - 1) % kSize;
    Thrown t = what_throws(rank, [&] {
      for (int step = 0; step < 1000000; ++step) {
        switch (op) {
          case KillDuring::kAllReduce:
            c->all_reduce_sum(v.data(), v.size());
            std::fill(v.begin(), v.end(), 1.f);
            break;
          case KillDuring::kReduceScatter:
            c->reduce_scatter_sum(v.data(), even_counts(v.size(), kSize));
            break;
          case KillDuring::kSendRecv: {
            auto rq = c->recv(in.data(), in.size() * sizeof(float), left, 1);
            auto sq = c->send(v.data(), v.size() * sizeof(float), right, 1);
            sq.wait();
            rq.wait();
            break;
          }
        }
      }
    });
    // Stay alive (communicator included) until every survivor has failed: a survivor that is not
    // next to the victim must learn of the loss from the communicators of live neighbours, not
    // from their processes exiting.
    touch(dir, "failed." + std::to_string(rank));
    for (int p = 0; p < kSize; ++p) {
      if (p != kVictim) wait_for_file(dir, "failed." + std::to_string(p));
    }
    CHILD_CHECK(t == Thrown::kPeerLost, rank, thrown_name(t));
    return kChildOk;
  });
  for (int r = 0; r < kSize; ++r) {
    if (r == kVictim) {
      EXPECT_EQ(outcomes[r].signal, SIGKILL) << testing::describe(outcomes);
      EXPECT_FALSE(outcomes[r].killed_at_deadline) << testing::describe(outcomes);
    } else {
      EXPECT_TRUE(outcomes[r].ok()) << testing::describe(outcomes);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, SigkillTest,
                         ::testing::Values(KillDuring::kAllReduce, KillDuring::kReduceScatter,
                                           KillDuring::kSendRecv),
                         [](const auto& info) {
                           switch (info.param) {
                             case KillDuring::kAllReduce:
                               return std::string("AllReduce");
                             case KillDuring::kReduceScatter:
                               return std::string("ReduceScatter");
                             default:
                               return std::string("SendRecv");
                           }
                         });

// Rank 0 waits for a message rank 1 never sends while another of its threads aborts the
// communicator: the wait must end with PeerLostError naming the reason. Rank 1 (in an all-reduce
// that needs rank 0) and rank 2 (in a receive from rank 0) must fail with PeerLostError too.
// Every timeout is 30 s and the parent's deadline 20 s, and rank 0 stays alive (communicator
// included) until the others have failed, so only the abort (its closed connections) can end
// their waits: a missing abort shows as a hung rank or a TimeoutError, not as a slow pass.
class AbortTest : public ::testing::TestWithParam<int> {};

// The peers' side: rank 1 in an all-reduce that needs rank 0, the others in a receive from it;
// each must fail with PeerLostError, and leaves a file saying it did.
int wait_on_aborting_rank0(Communicator& c, int rank, const tessel::testing::TempDir& dir) {
  std::vector<float> v(1000, 1.f);
  int64_t x = 0;
  Caught got = catch_error(rank, [&] {
    if (rank == 1) {
      c.all_reduce_sum(v.data(), v.size());
    } else {
      auto q = c.recv(&x, sizeof(x), 0, 3);
      q.wait();
    }
  });
  touch(dir, "failed." + std::to_string(rank));
  CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
  return kChildOk;
}

TEST_P(AbortTest, AbortFromAnotherThreadEndsTheWaitAndFailsPeersFast) {
  const int size = GetParam();
  const std::string reason = "step 17 lost a peer on group 'tp.0'";
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(size, 20s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, size, 30s);
    if (rank != 0) return wait_on_aborting_rank0(*c, rank, dir);

    int64_t x = 0, y = 7, z = 0;
    // Transfers still pending at the abort, never waited for: their destructors (at the end of
    // this scope) and waits must not block.
    auto pending_recv = c->recv(&z, sizeof(z), 1, 4);
    auto pending_send = c->send(&y, sizeof(y), 1, 5);
    auto q = c->recv(&x, sizeof(x), 1, 3);  // rank 1 never sends this
    std::thread aborter([&] {
      std::this_thread::sleep_for(50ms);
      c->abort(reason);
    });
    Caught got = catch_error(rank, [&] { q.wait(); });
    aborter.join();
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
    CHILD_CHECK(contains(got.what, reason), rank, got.what);
    CHILD_CHECK(contains(got.what, "group 'world' (rank 0 of " + std::to_string(size)), rank,
                got.what);

    // Broken for good: later calls and waits throw at once, naming the reason; abort is
    // idempotent and keeps the first reason.
    c->abort("a second reason");
    std::vector<float> v(1000, 1.f);
    got = catch_error(rank, [&] { c->all_reduce_sum(v.data(), v.size()); });
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
    CHILD_CHECK(contains(got.what, reason) && !contains(got.what, "a second reason"), rank,
                got.what);
    CHILD_CHECK(contains(got.what, "all_reduce_sum on group 'world'"), rank, got.what);
    got = catch_error(rank, [&] { pending_send.wait(); });
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
    got = catch_error(rank, [&] { c->recv(&z, sizeof(z), 1, 6); });
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
    CHILD_CHECK(contains(c->failure(), reason), rank, c->failure());

    for (int p = 1; p < size; ++p) wait_for_file(dir, "failed." + std::to_string(p));
    return kChildOk;  // pending_recv is destroyed here, unwaited
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

// The background-thread pattern of the runtime: rank 0's second thread all-reduces in a loop (as
// the gradient all-reduce does) while its main thread aborts, so the abort lands at an arbitrary
// point of an operation (posting, waiting, between calls). Every rank's loop must end with
// PeerLostError; rank 0's names the reason. (This is also the test that can catch an abort
// landing between a call's health check and its wait: the wait must not block then either.)
TEST_P(AbortTest, AbortBreaksABusyCommunicatorUsedByAnotherThread) {
  const int size = GetParam();
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(size, 20s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, size, 30s);
    auto loop = [&] {
      return catch_error(rank, [&] {
        std::vector<float> v(size_t(1) << 16, 1.f);
        for (int step = 0; step < 1000000; ++step) c->all_reduce_sum(v.data(), v.size());
      });
    };
    if (rank != 0) {
      Caught got = loop();
      touch(dir, "failed." + std::to_string(rank));
      CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
      return kChildOk;
    }
    Caught got;
    std::thread worker([&] { got = loop(); });
    std::this_thread::sleep_for(100ms);
    c->abort("shutting down");
    worker.join();
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind));
    CHILD_CHECK(contains(got.what, "shutting down"), rank, got.what);
    for (int p = 1; p < size; ++p) wait_for_file(dir, "failed." + std::to_string(p));
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

// Rank 0 aborts while no call runs on its communicator and then leaves it alone until the peers
// have failed: only abort's own closing of the connections can tell them (a failing call would
// close them too, and so would rank 0's exit).
TEST_P(AbortTest, AbortWhileIdleFailsPeersFast) {
  const int size = GetParam();
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(size, 20s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, size, 30s);
    if (rank != 0) return wait_on_aborting_rank0(*c, rank, dir);
    std::this_thread::sleep_for(50ms);
    c->abort("idle abort");
    for (int p = 1; p < size; ++p) wait_for_file(dir, "failed." + std::to_string(p));
    Caught got = catch_error(rank, [&] { c->barrier(); });
    CHILD_CHECK(got.kind == Thrown::kPeerLost && contains(got.what, "idle abort"), rank, got.what);
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AbortTest, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// A size-1 group has no peers to notify, but is broken all the same, so every group of an aborted
// process behaves alike.
TEST(CommunicatorTest, AbortBreaksSizeOneGroupsToo) {
  tessel::testing::TempDir dir;
  auto c = Communicator::connect(store_in(dir), "solo", 0, 1);
  std::vector<double> v(4, 1.0);
  c->all_reduce_sum(v.data(), v.size());
  EXPECT_TRUE(c->failure().empty());
  c->abort("the job is being resized");
  for (int i = 0; i < 2; ++i) {  // the first call records the failure, the second repeats it
    try {
      c->all_reduce_sum(v.data(), v.size());
      ADD_FAILURE() << "all_reduce_sum after abort did not throw";
    } catch (const PeerLostError& e) {
      EXPECT_TRUE(contains(e.what(), "the job is being resized")) << e.what();
      EXPECT_TRUE(contains(e.what(), "group 'solo'")) << e.what();
    }
  }
  EXPECT_THROW(c->barrier(), PeerLostError);
  EXPECT_THROW(c->broadcast(v.data(), v.size(), 0), PeerLostError);
  EXPECT_TRUE(contains(c->failure(), "the job is being resized")) << c->failure();
}

}  // namespace
}  // namespace tessel::comm
