// The Communicator over shared memory (shm_transport.h): which pairs use it, the collectives'
// results against the TCP path, point-to-point matching and progress, and no allocation per
// message. Failures on shared memory (a killed peer, abort, timeouts) are covered by
// communicator_test.cpp and connect_abort_test.cpp, which run on it by default; the tests here
// that fail a rank check the shared-memory path explicitly.
#include "tessel/comm/shm_transport.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/testing/testing.h"

// Allocations made by the calling thread while `counting` is set: the steady-state test below.
namespace {
thread_local bool t_counting = false;
thread_local size_t t_allocations = 0;
}  // namespace

// Out of line so that the compiler does not pair an inlined malloc/free with new/delete.
__attribute__((noinline)) void* operator new(std::size_t n) {
  if (t_counting) ++t_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept {
  std::free(p);
}
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using testing::catch_error;
using testing::Caught;
using testing::contains;
using testing::kChildOk;
using testing::run_ranks;
using testing::Thrown;
using testing::thrown_name;

StoreOptions store_in(const tessel::testing::TempDir& dir) {
  return testing::file_store(dir, "shm-job");
}

TransportOptions tcp_only() {
  TransportOptions t;
  t.shared_memory = false;
  return t;
}

uint64_t fnv(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

TEST(ShmTransport, HostIdNamesThisKernelAndNamespaces) {
  const std::string id = detail::shm_host_id();
  ASSERT_FALSE(id.empty());
  EXPECT_TRUE(contains(id, "pid:[") && contains(id, "net:[")) << id;
  EXPECT_EQ(id, detail::shm_host_id());
}

TEST(ShmTransport, ReusedQueueKeepsOrderAcrossGrowthAndWraps) {
  detail::ReusedQueue<int> q;
  int next_in = 0, next_out = 0;
  for (int round = 0; round < 50; ++round) {
    for (int i = 0; i < round % 13 + 1; ++i) q.push_back(next_in++);
    for (int i = 0; i < round % 7 + 1 && !q.empty(); ++i) {
      ASSERT_EQ(q.front(), next_out++);
      q.pop_front();
    }
    for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(q[i], next_out + int(i));
  }
}

// Every pair of ranks shares memory by default; a rank that turns it off talks TCP with
// everyone, the others keep it among themselves, and the collectives (which need every pair)
// go over TCP, with the same results.
TEST(ShmTransport, PairsShareMemoryUnlessOneSideTurnsItOff) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(3, 60s, [&](int rank) {
    auto all = Communicator::connect(store, "all", rank, 3, 20s);
    for (int p = 0; p < 3; ++p)
      CHILD_CHECK(all->shares_memory_with(p) == (p != rank), rank,
                  "all: peer " + std::to_string(p));
    CHILD_CHECK(all->collectives_share_memory(), rank, "all: collectives");
    auto mixed = Communicator::connect(store, "mixed", rank, 3, 20s,
                                       rank == 2 ? tcp_only() : TransportOptions{});
    for (int p = 0; p < 3; ++p) {
      const bool expected = p != rank && p != 2 && rank != 2;
      CHILD_CHECK(mixed->shares_memory_with(p) == expected, rank,
                  "mixed: peer " + std::to_string(p));
    }
    CHILD_CHECK(!mixed->collectives_share_memory(), rank, "mixed: collectives");
    std::vector<float> v(1000, float(rank + 1));
    mixed->all_reduce_sum(v.data(), v.size());
    CHILD_CHECK(v[0] == 6.f && v[999] == 6.f, rank, std::to_string(v[0]));
    // Point-to-point in a ring: 0->1 on shared memory, 1->2 and 2->0 on TCP.
    std::vector<int> got(5000, -1), mine(5000, rank);
    auto r = mixed->recv(got.data(), got.size() * sizeof(int), (rank + 2) % 3, 4);
    auto s = mixed->send(mine.data(), mine.size() * sizeof(int), (rank + 1) % 3, 4);
    r.wait();
    s.wait();
    CHILD_CHECK(got[0] == (rank + 2) % 3 && got[4999] == (rank + 2) % 3, rank, "ring message");
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// A rank that cannot make its segments (here: a file-size limit below the ring's size, as a full
// or too small shared-memory filesystem would refuse them) keeps the whole group on TCP, which
// then works; it is not an error.
TEST(ShmTransport, ARankThatCannotMakeItsSegmentsKeepsTheGroupOnTcp) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(3, 60s, [&](int rank) {
    if (rank == 1) {
      std::signal(SIGXFSZ, SIG_IGN);
      rlimit limit{64 * 1024, 64 * 1024};
      CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0, rank, "setrlimit");
    }
    TransportOptions big;
    big.shm_ring_bytes = size_t(1) << 20;
    auto c = Communicator::connect(store, "limited", rank, 3, 20s, big);
    for (int p = 0; p < 3; ++p)
      CHILD_CHECK(!c->shares_memory_with(p), rank, "peer " + std::to_string(p));
    CHILD_CHECK(!c->collectives_share_memory(), rank, "collectives");
    std::vector<float> v(100000, float(rank + 1));
    c->all_reduce_sum(v.data(), v.size());
    CHILD_CHECK(v[0] == 6.f && v[99999] == 6.f, rank, std::to_string(v[0]));
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// The collectives over shared memory give exactly the TCP path's bits (the same ring, the same
// order of additions), on every rank, for values whose sums do round.
class ShmCollectives : public ::testing::TestWithParam<int> {};

TEST_P(ShmCollectives, BitIdenticalToTcpOnEveryRank) {
  const int n = GetParam();
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(n, 90s, [&](int rank) {
    auto shm = Communicator::connect(store, "shm", rank, n, 20s);
    auto tcp = Communicator::connect(store, "tcp", rank, n, 20s, tcp_only());
    CHILD_CHECK(shm->collectives_share_memory() && !tcp->collectives_share_memory(), rank,
                "transports");
    std::mt19937 gen(uint32_t(1234 + rank));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t count : {size_t(0), size_t(1), size_t(7), (size_t(1) << 20) + 3, size_t(5) << 20}) {
      std::vector<float> a(count);
      for (auto& x : a) x = normal(gen) * 1e3f;
      std::vector<float> b = a;
      shm->all_reduce_sum(a.data(), a.size());
      tcp->all_reduce_sum(b.data(), b.size());
      CHILD_CHECK(count == 0 || std::memcmp(a.data(), b.data(), count * sizeof(float)) == 0, rank,
                  "all_reduce_sum of " + std::to_string(count) + " differs from TCP");
      // And the same bits on every rank.
      const uint64_t h = fnv(a.data(), count * sizeof(float));
      std::vector<uint64_t> hs(static_cast<size_t>(n));
      tcp->all_gather(reinterpret_cast<const int64_t*>(&h), 1,
                      reinterpret_cast<int64_t*>(hs.data()));
      for (uint64_t x : hs) CHILD_CHECK(x == h, rank, "ranks disagree");
    }
    // Reduce-scatter with uneven chunks (one empty), doubles.
    std::vector<size_t> counts(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) counts[size_t(r)] = r == 1 ? 0 : size_t(300001 + 17 * r);
    size_t total = 0;
    for (size_t c : counts) total += c;
    std::vector<double> a(total);
    for (auto& x : a) x = double(normal(gen)) / 3.0;
    std::vector<double> b = a;
    shm->reduce_scatter_sum(a.data(), counts);
    tcp->reduce_scatter_sum(b.data(), counts);
    size_t off = 0;
    for (int r = 0; r < rank; ++r) off += counts[size_t(r)];
    CHILD_CHECK(std::memcmp(a.data() + off, b.data() + off, counts[size_t(rank)] * 8) == 0, rank,
                "reduce_scatter_sum differs from TCP");
    // Uneven all-gather of bytes, and an even one of int64.
    std::vector<size_t> gcounts(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) gcounts[size_t(r)] = size_t(r * 100003 % 7919);
    size_t gtotal = 0;
    for (size_t c : gcounts) gtotal += c;
    std::vector<uint8_t> mine(gcounts[size_t(rank)], uint8_t(rank * 31 + 1)), all(gtotal, 0);
    shm->all_gather_v(mine.data(), gcounts, all.data());
    size_t at = 0;
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < gcounts[size_t(r)]; ++i, ++at)
        CHILD_CHECK(all[at] == uint8_t(r * 31 + 1), rank, "all_gather_v at " + std::to_string(at));
    std::vector<int64_t> one(1 << 18, rank), every(size_t(n) << 18);
    shm->all_gather(one.data(), one.size(), every.data());
    for (int r = 0; r < n; ++r)
      CHILD_CHECK(every[size_t(r) << 18] == r && every[((size_t(r) + 1) << 18) - 1] == r, rank,
                  "all_gather");
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmCollectives, ::testing::Values(2, 3, 4));

// Every rank sends every other rank a message several rings long, and then waits for its sends
// before its receives: the senders' threads and the receive side taking in what arrives while
// it waits for a send keep the full rings moving.
TEST(ShmTransport, MutualLargeSendsWaitedFirstDoNotDeadlock) {
  constexpr int n = 3;
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(n, 60s, [&](int rank) {
    TransportOptions small;
    small.shm_ring_bytes = 64 << 10;
    auto c = Communicator::connect(store, "world", rank, n, 20s, small);
    const size_t bytes = 3 * (64 << 10) + 5;
    std::vector<std::vector<unsigned char>> in(n, std::vector<unsigned char>(bytes)),
        outb(n, std::vector<unsigned char>(bytes));
    std::vector<Request> recvs, sends;
    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      std::fill(outb[size_t(p)].begin(), outb[size_t(p)].end(), uint8_t(rank * 16 + p));
      recvs.push_back(c->recv(in[size_t(p)].data(), bytes, p, 3));
    }
    for (int p = 0; p < n; ++p) {
      if (p != rank) sends.push_back(c->send(outb[size_t(p)].data(), bytes, p, 3));
    }
    for (auto& s : sends) s.wait();
    for (auto& r : recvs) r.wait();
    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      const auto& v = in[size_t(p)];
      CHILD_CHECK(v.front() == uint8_t(p * 16 + rank) && v.back() == uint8_t(p * 16 + rank), rank,
                  "from " + std::to_string(p));
    }
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// Receives match sends by tag in posting order, whatever order the receiver posts and waits in,
// also when a message arrives before its receive is posted.
TEST(ShmTransport, TagsMatchWhateverTheOrderOfPostingAndWaiting) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, 20s);
    CHILD_CHECK(c->shares_memory_with(1 - rank), rank, "no shared memory");
    // Tag t carries (t + 1) * 1000 + k ints of value t * 100 + k, for the k-th message of tag t.
    auto size_of = [](int t, int k) { return size_t((t + 1) * 1000 + k); };
    if (rank == 0) {
      std::vector<std::vector<int>> bufs;
      std::vector<Request> sends;
      for (int k = 0; k < 2; ++k)
        for (int t = 0; t < 4; ++t) {
          bufs.emplace_back(size_of(t, k), t * 100 + k);
          sends.push_back(
              c->send(bufs.back().data(), bufs.back().size() * sizeof(int), 1, uint32_t(t)));
        }
      for (auto& s : sends) s.wait();
      c->barrier();
      return kChildOk;
    }
    // Tags 0 and 1 are received in reverse order of posting; messages of tags 2 and 3 arrive
    // (and some are taken aside meanwhile) before their receives are posted.
    std::vector<std::vector<int>> got;
    std::vector<Request> recvs;
    for (int t : {1, 0})
      for (int k = 0; k < 2; ++k) {
        got.emplace_back(size_of(t, k), -1);
        recvs.push_back(
            c->recv(got.back().data(), got.back().size() * sizeof(int), 0, uint32_t(t)));
      }
    for (size_t i = recvs.size(); i-- > 0;) recvs[i].wait();
    c->barrier();
    for (int t : {3, 2})
      for (int k = 0; k < 2; ++k) {
        got.emplace_back(size_of(t, k), -1);
        c->recv(got.back().data(), got.back().size() * sizeof(int), 0, uint32_t(t)).wait();
      }
    size_t i = 0;
    for (int t : {1, 0, 3, 2})
      for (int k = 0; k < 2; ++k, ++i)
        CHILD_CHECK(got[i].front() == t * 100 + k && got[i].back() == t * 100 + k, rank,
                    "tag " + std::to_string(t) + " message " + std::to_string(k));
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// After a warm-up, sending and receiving allocates nothing on the calling thread: small
// messages (copied into the ring at once) and large ones (streamed by the sender thread).
TEST(ShmTransport, SteadyStateSendRecvAllocatesNothing) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, 20s);
    CHILD_CHECK(c->shares_memory_with(1 - rank), rank, "no shared memory");
    std::vector<unsigned char> small(4096), large(3 << 20);
    std::vector<float> grads(1 << 16, 1.f);
    auto round = [&](int i) {
      auto& buf = i % 2 ? large : small;
      if (rank == 0) {
        auto s = c->send(buf.data(), buf.size(), 1, uint32_t(i % 3));
        auto r = c->recv(buf.data(), buf.size(), 1, uint32_t(i % 3));
        s.wait();
        r.wait();
      } else {
        auto r = c->recv(buf.data(), buf.size(), 0, uint32_t(i % 3));
        r.wait();
        c->send(buf.data(), buf.size(), 0, uint32_t(i % 3)).wait();
      }
    };
    for (int i = 0; i < 20; ++i) round(i);
    t_counting = true;
    for (int i = 0; i < 200; ++i) round(i);
    t_counting = false;
    CHILD_CHECK(t_allocations == 0, rank, std::to_string(t_allocations) + " allocations");
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// A peer killed while it streams a large message over shared memory: the receiver gets
// PeerLostError naming the group and the peer long before its 30 s timeout.
TEST(ShmTransport, KilledPeerIsPeerLost) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, 30s);
    CHILD_CHECK(c->shares_memory_with(1 - rank), rank, "no shared memory");
    std::vector<unsigned char> big(size_t(64) << 20, 1);
    if (rank == 0) {
      std::thread([] {
        std::this_thread::sleep_for(50ms);
        std::raise(SIGKILL);
      }).detach();
      for (;;) c->send(big.data(), big.size(), 1, 1).wait();
    }
    const Caught got = catch_error(rank, [&] {
      for (;;) c->recv(big.data(), big.size(), 0, 1).wait();
    });
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind) + (": " + got.what));
    CHILD_CHECK(contains(got.what, "recv on group 'world' (rank 1 of 2, peer rank 0)"), rank,
                got.what);
    return kChildOk;
  });
  EXPECT_EQ(out[0].signal, SIGKILL) << testing::describe(out);
  EXPECT_TRUE(out[1].ok()) << testing::describe(out);
}

// A peer that is alive but sends nothing: TimeoutError at the wait's timeout; the rank that timed
// out breaks its channels, so its peer, waiting on it with a 30 s timeout, fails at once with
// PeerLostError.
TEST(ShmTransport, SilentPeerTimesOutAndItsPeerFailsFast) {
  tessel::testing::TempDir dir;
  auto store = store_in(dir);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, 2, 30s);
    CHILD_CHECK(c->shares_memory_with(1 - rank), rank, "no shared memory");
    int x = 0;
    if (rank == 1) {
      const Caught got = catch_error(rank, [&] { c->recv(&x, sizeof x, 0, 5).wait(200ms); });
      CHILD_CHECK(got.kind == Thrown::kTimeout, rank, thrown_name(got.kind) + (": " + got.what));
      CHILD_CHECK(contains(got.what,
                           "recv on group 'world' (rank 1 of 2, peer rank 0) timed out "
                           "after 200 ms"),
                  rank, got.what);
      return kChildOk;
    }
    const Caught got = catch_error(rank, [&] { c->recv(&x, sizeof x, 1, 6).wait(); });
    CHILD_CHECK(got.kind == Thrown::kPeerLost, rank, thrown_name(got.kind) + (": " + got.what));
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

}  // namespace
}  // namespace tessel::comm
