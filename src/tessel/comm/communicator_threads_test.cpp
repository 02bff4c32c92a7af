// Point-to-point on one Communicator from several threads at once (communicator.h, "Threads"),
// the pipeline dispatcher's pattern: on every rank one arrival thread per ring neighbour
// (prev = rank-1, next = rank+1 mod n; one thread when n = 2) posts and waits for every receive
// from that neighbour, while the main thread sends to the neighbours in a random interleaving and
// waits for its sends, after joining the arrival threads or while they still receive. Real
// processes on loopback, world sizes 2-4, over shared memory (64 KiB rings, messages up to 256 KiB,
// so large ones stream through the ring) and over TCP. Then the failures: a SIGKILLed peer and an
// abort() from the main thread must end every arrival thread's wait with PeerLostError; the
// communicators' timeouts are far beyond the parent's deadline, so only the detection can pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.h"
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
using testing::thrown_name;
using testing::touch;
using testing::wait_for_file;

constexpr size_t kRingBytes = size_t(64) << 10;
// Sizes cycle through these: empty, small (copied into the ring at once), about a ring, and up to
// four rings (streamed by the sender thread while the arrival thread drains them).
const std::vector<size_t> kSizes = {0,     1,     13,     1000,   4096,  20000,
                                    65536, 70000, 100000, 200000, 262144};
constexpr size_t kMaxBytes = size_t(256) << 10;
constexpr int kWindow = 4;  // an arrival thread posts 1..kWindow receives, then waits for them

StoreOptions store_in(const tessel::testing::TempDir& dir) {
  return testing::file_store(dir, "threads-job");
}

// The k-th message rank `from` sends rank `to`: its size, its bytes and its tag (a sequence per
// ordered pair, so a message delivered to the wrong receive shows in its size or contents).
size_t message_bytes(int from, int to, int k) {
  return kSizes[size_t(k * 7 + from * 3 + to) % kSizes.size()];
}
uint8_t message_byte(int from, int to, int k, size_t i) {
  return uint8_t(from * 131 + to * 71 + k * 29 + i * 7 + (i >> 8));
}
uint32_t message_tag(int k) {
  return uint32_t(k);
}

void fill_message(std::vector<uint8_t>& buf, int from, int to, int k) {
  buf.resize(message_bytes(from, to, k));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = message_byte(from, to, k, i);
}

// Empty when buf[0, bytes) is the k-th message from `from` to `to`, else what is wrong.
std::string check_message(const uint8_t* buf, int from, int to, int k) {
  const size_t n = message_bytes(from, to, k);
  for (size_t i = 0; i < n; ++i) {
    if (buf[i] != message_byte(from, to, k, i)) {
      return "message " + std::to_string(k) + " from rank " + std::to_string(from) + " (" +
             std::to_string(n) + " bytes) wrong at byte " + std::to_string(i);
    }
  }
  return {};
}

struct Param {
  int world;
  bool shared_memory;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << "world " << p.world << (p.shared_memory ? ", shared memory" : ", TCP");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return "world" + std::to_string(info.param.world) + (info.param.shared_memory ? "_shm" : "_tcp");
}

class ThreadsTest : public ::testing::TestWithParam<Param> {};

// The ring neighbours of `rank`, each once.
std::vector<int> neighbours(int rank, int n) {
  const int prev = (rank + n - 1) % n;
  const int next = (rank + 1) % n;
  return prev == next ? std::vector<int>{prev} : std::vector<int>{prev, next};
}

TransportOptions transport_for(bool shared_memory) {
  TransportOptions t;
  t.shared_memory = shared_memory;
  t.shm_ring_bytes = kRingBytes;
  return t;
}

// Whether the test runs on shared memory when asked to (TESSEL_SHARED_MEMORY=0 turns it off).
bool shm_expected(bool asked) {
  const char* env = std::getenv("TESSEL_SHARED_MEMORY");
  return asked && !(env != nullptr && std::string(env) == "0");
}

// What one arrival thread saw: the error that ended it (if any), the first bad message (if any),
// and how many messages arrived intact.
struct Arrivals {
  Caught error;
  std::string bad;
  int received = 0;
};

// An arrival thread's body: receives messages [begin, end) from `peer`, posting 1..kWindow
// receives at a time (random) and then waiting for them in order, checking each.
void receive_from(Communicator& c, int peer, int begin, int end, uint32_t seed, Arrivals& a) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> bufs(kWindow, std::vector<uint8_t>(kMaxBytes));
  a.error = catch_error(c.rank(), [&] {
    for (int k = begin; k < end && a.bad.empty();) {
      const int batch = std::min<int>(end - k, 1 + int(rng() % kWindow));
      std::vector<Request> pending;
      pending.reserve(size_t(batch));
      for (int i = 0; i < batch; ++i) {
        pending.push_back(c.recv(bufs[size_t(i)].data(), message_bytes(peer, c.rank(), k + i), peer,
                                 message_tag(k + i)));
      }
      for (int i = 0; i < batch; ++i) {
        pending[size_t(i)].wait();
        std::string bad = check_message(bufs[size_t(i)].data(), peer, c.rank(), k + i);
        if (!bad.empty() && a.bad.empty()) a.bad = bad;
        ++a.received;
      }
      k += batch;
    }
  });
}

// The main thread's part of one batch: sends messages [begin, end) to every neighbour, the
// neighbours interleaved at random (each neighbour's messages in order), with a short sleep now
// and then. `storage` holds the payloads until the returned Requests are waited for.
std::vector<Request> send_batch(Communicator& c, const std::vector<int>& peers, int begin, int end,
                                std::mt19937& rng, std::vector<std::vector<uint8_t>>& storage) {
  std::vector<int> order;
  for (size_t p = 0; p < peers.size(); ++p) order.insert(order.end(), size_t(end - begin), int(p));
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int> next_k(peers.size(), begin);
  storage.assign(order.size(), {});
  std::vector<Request> sends;
  sends.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const int peer = peers[size_t(order[i])];
    const int k = next_k[size_t(order[i])]++;
    fill_message(storage[i], c.rank(), peer, k);
    if (rng() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
    sends.push_back(c.send(storage[i].data(), storage[i].size(), peer, message_tag(k)));
  }
  return sends;
}

// K = 200 messages each way between ring neighbours, in 4 steps of 50. Each step starts one
// arrival thread per neighbour; the main thread sends, then on even steps joins the arrival
// threads before waiting for its sends (the dispatcher's order) and on odd steps waits for its
// sends while they still receive (a failing step's order). Every message must arrive intact, and
// a barrier at the end shows the communicator is still whole for collectives.
TEST_P(ThreadsTest, ArrivalThreadsReceiveWhileTheMainThreadSends) {
  const auto [n, shm] = GetParam();
  constexpr int kMessages = 200;
  constexpr int kSteps = 4;
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(n, 60s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, n, 30s, transport_for(shm));
    const auto peers = neighbours(rank, n);
    for (int p : peers) {
      CHILD_CHECK(c->shares_memory_with(p) == shm_expected(shm), rank,
                  "transport with rank " + std::to_string(p));
    }
    std::mt19937 rng(uint32_t(1000 + rank));
    for (int step = 0; step < kSteps; ++step) {
      const int begin = step * kMessages / kSteps;
      const int end = (step + 1) * kMessages / kSteps;
      std::vector<Arrivals> arrivals(peers.size());
      std::vector<std::thread> threads;
      for (size_t p = 0; p < peers.size(); ++p) {
        threads.emplace_back([&, p] {
          receive_from(*c, peers[p], begin, end, uint32_t(rank * 100 + step * 10 + int(p)),
                       arrivals[p]);
        });
      }
      std::vector<std::vector<uint8_t>> storage;
      std::vector<Request> sends;
      const Caught sent = catch_error(rank, [&] {
        sends = send_batch(*c, peers, begin, end, rng, storage);
        if (step % 2 == 1) {
          for (auto& s : sends) s.wait();
        }
      });
      for (auto& t : threads) t.join();
      const Caught waited = catch_error(rank, [&] {
        for (auto& s : sends) s.wait();
      });
      CHILD_CHECK(sent.kind == Thrown::kNothing, rank, "sending: " + sent.what);
      CHILD_CHECK(waited.kind == Thrown::kNothing, rank, "waiting for sends: " + waited.what);
      for (size_t p = 0; p < peers.size(); ++p) {
        const auto& a = arrivals[p];
        const std::string who = "from rank " + std::to_string(peers[p]) + ": ";
        CHILD_CHECK(a.error.kind == Thrown::kNothing, rank, who + a.error.what);
        CHILD_CHECK(a.bad.empty(), rank, who + a.bad);
        CHILD_CHECK(a.received == end - begin, rank, who + std::to_string(a.received));
      }
    }
    c->barrier();
    CHILD_CHECK(c->failure().empty(), rank, c->failure());
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

// The last rank is SIGKILLed while traffic flows as above (the main thread waiting for each batch
// of sends while the arrival threads receive). On every survivor, every arrival thread and the
// main thread must end with PeerLostError. The communicators' timeout is 60 s and the parent's
// deadline 25 s, so only the detection of the loss (directly, or through a neighbour that failed
// and closed its connections) can end the waits in time. Survivors keep their communicators until
// every survivor has failed, so each learns of the loss from the communicators alone.
TEST_P(ThreadsTest, KilledPeerFailsEveryArrivalThreadWithPeerLost) {
  const auto [n, shm] = GetParam();
  const int victim = n - 1;
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(n, 25s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, n, 60s, transport_for(shm));
    const auto peers = neighbours(rank, n);
    if (rank == victim) {
      std::thread([] {
        std::this_thread::sleep_for(150ms);
        std::raise(SIGKILL);
      }).detach();
    }
    constexpr int kEndless = 1 << 30;
    std::vector<Arrivals> arrivals(peers.size());
    std::vector<std::thread> threads;
    for (size_t p = 0; p < peers.size(); ++p) {
      threads.emplace_back([&, p] {
        receive_from(*c, peers[p], 0, kEndless, uint32_t(rank * 100 + int(p)), arrivals[p]);
      });
    }
    std::mt19937 rng(uint32_t(2000 + rank));
    std::vector<std::vector<uint8_t>> storage;
    const Caught sent = catch_error(rank, [&] {
      for (int k = 0; k < kEndless; k += 8) {
        auto sends = send_batch(*c, peers, k, k + 8, rng, storage);
        for (auto& s : sends) s.wait();
      }
    });
    for (auto& t : threads) t.join();
    touch(dir, "failed." + std::to_string(rank));
    for (int p = 0; p < n; ++p) {
      if (p != victim) wait_for_file(dir, "failed." + std::to_string(p));
    }
    CHILD_CHECK(sent.kind == Thrown::kPeerLost, rank,
                std::string("main thread: ") + thrown_name(sent.kind) + ": " + sent.what);
    for (size_t p = 0; p < peers.size(); ++p) {
      const auto& a = arrivals[p];
      const std::string who = "arrival thread for rank " + std::to_string(peers[p]) + ": ";
      CHILD_CHECK(a.bad.empty(), rank, who + a.bad);
      CHILD_CHECK(a.error.kind == Thrown::kPeerLost, rank,
                  who + thrown_name(a.error.kind) + ": " + a.error.what);
    }
    return kChildOk;
  });
  for (int r = 0; r < n; ++r) {
    if (r == victim) {
      EXPECT_EQ(outcomes[size_t(r)].signal, SIGKILL) << testing::describe(outcomes);
    } else {
      EXPECT_TRUE(outcomes[size_t(r)].ok()) << testing::describe(outcomes);
    }
  }
}

// Every rank exchanges a few messages as above, then its arrival threads wait for a message
// nobody sends. Rank 0's main thread aborts its communicator: its arrival threads must end at once
// with PeerLostError naming the reason, a receive posted afterwards must throw at once, and every
// other rank's arrival threads must end with PeerLostError too (rank 0's closed connections fail
// its neighbours, whose own failure reaches the rest). Timeouts are 60 s, the deadline 25 s, and
// rank 0 stays alive until every other rank has failed.
TEST_P(ThreadsTest, AbortFromTheMainThreadWakesArrivalThreads) {
  const auto [n, shm] = GetParam();
  const std::string reason = "the dispatcher gave up on step 3";
  constexpr uint32_t kNeverSent = 1u << 30;
  tessel::testing::TempDir dir;
  const auto store = store_in(dir);
  auto outcomes = run_ranks(n, 25s, [&](int rank) {
    auto c = Communicator::connect(store, "world", rank, n, 60s, transport_for(shm));
    const auto peers = neighbours(rank, n);
    constexpr int kWarmUp = 10;
    std::vector<Arrivals> arrivals(peers.size());
    std::vector<Caught> blocked(peers.size());
    std::atomic<size_t> warm{0};
    std::vector<std::thread> threads;
    for (size_t p = 0; p < peers.size(); ++p) {
      threads.emplace_back([&, p] {
        receive_from(*c, peers[p], 0, kWarmUp, uint32_t(rank * 100 + int(p)), arrivals[p]);
        ++warm;
        if (arrivals[p].error.kind != Thrown::kNothing) return;
        uint8_t x = 0;
        blocked[p] = catch_error(rank, [&] { c->recv(&x, 1, peers[p], kNeverSent).wait(); });
      });
    }
    std::mt19937 rng(uint32_t(3000 + rank));
    std::vector<std::vector<uint8_t>> storage;
    const Caught sent = catch_error(rank, [&] {
      auto sends = send_batch(*c, peers, 0, kWarmUp, rng, storage);
      for (auto& s : sends) s.wait();
    });
    // The abort must not cut a warm-up message short (it discards what is in flight): every
    // rank says when all its warm-up messages arrived.
    while (warm < peers.size()) std::this_thread::sleep_for(1ms);
    touch(dir, "warm." + std::to_string(rank));
    if (rank == 0) {
      for (int p = 1; p < n; ++p) wait_for_file(dir, "warm." + std::to_string(p));
      std::this_thread::sleep_for(100ms);  // the arrival threads are in their waits by now
      c->abort(reason);
    }
    for (auto& t : threads) t.join();
    CHILD_CHECK(sent.kind == Thrown::kNothing, rank, "warm-up sends: " + sent.what);
    for (size_t p = 0; p < peers.size(); ++p) {
      const std::string who = "arrival thread for rank " + std::to_string(peers[p]) + ": ";
      CHILD_CHECK(arrivals[p].error.kind == Thrown::kNothing, rank, who + arrivals[p].error.what);
      CHILD_CHECK(arrivals[p].bad.empty(), rank, who + arrivals[p].bad);
      CHILD_CHECK(blocked[p].kind == Thrown::kPeerLost, rank,
                  who + thrown_name(blocked[p].kind) + ": " + blocked[p].what);
      if (rank == 0) CHILD_CHECK(contains(blocked[p].what, reason), rank, who + blocked[p].what);
    }
    if (rank != 0) {
      touch(dir, "failed." + std::to_string(rank));
      return kChildOk;
    }
    uint8_t x = 0;
    const Caught later = catch_error(rank, [&] { c->recv(&x, 1, peers[0], kNeverSent).wait(); });
    CHILD_CHECK(later.kind == Thrown::kPeerLost && contains(later.what, reason), rank, later.what);
    for (int p = 1; p < n; ++p) wait_for_file(dir, "failed." + std::to_string(p));
    return kChildOk;
  });
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ThreadsTest,
                         ::testing::Values(Param{2, true}, Param{2, false}, Param{3, true},
                                           Param{3, false}, Param{4, true}, Param{4, false}),
                         param_name);

}  // namespace
}  // namespace tessel::comm
