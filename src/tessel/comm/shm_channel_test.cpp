#include "tessel/comm/shm_channel.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

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
using Clock = ShmChannel::Clock;
using Role = ShmChannel::Role;

constexpr size_t kMiB = size_t(1) << 20;
constexpr size_t kRing = 64 * 1024;  // small, so that most messages wrap or stream

// One pipe per rank, made before the fork: how a test hands a channel's name to the rank that
// opens it (the Communicator uses its Gloo mesh instead).
class Mailboxes {
 public:
  explicit Mailboxes(int n) : fds_(size_t(n)) {
    for (auto& p : fds_) {
      if (pipe(p.data()) != 0) throw std::runtime_error("pipe failed");
    }
  }
  ~Mailboxes() {
    for (auto& p : fds_) {
      ::close(p[0]);
      ::close(p[1]);
    }
  }
  void put(int to, const std::string& line) {
    const std::string s = line + "\n";
    if (::write(fds_[size_t(to)][1], s.data(), s.size()) != ssize_t(s.size())) {
      throw std::runtime_error("pipe write failed");
    }
  }
  // The next line for `me`; throws when none comes within 20 s.
  std::string get(int me) {
    std::string line;
    const auto deadline = Clock::now() + 20s;
    for (;;) {
      pollfd p{fds_[size_t(me)][0], POLLIN, 100};
      if (Clock::now() > deadline) throw std::runtime_error("no line in the mailbox");
      if (poll(&p, 1, 100) <= 0) continue;
      char c = 0;
      if (::read(p.fd, &c, 1) != 1) throw std::runtime_error("pipe read failed");
      if (c == '\n') return line;
      line += c;
    }
  }

 private:
  std::vector<std::array<int, 2>> fds_;
};

// Bytes every process can regenerate: message `m` of `n` bytes.
std::vector<unsigned char> pattern(size_t n, uint64_t m) {
  std::vector<unsigned char> v(n);
  uint64_t x = 0x9e3779b97f4a7c15ull * (m + 1) + n;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = static_cast<unsigned char>(x);
  }
  return v;
}

// First differing index, or n.
size_t first_diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return i;
  return a.size() == b.size() ? n : n;
}

Clock::time_point in(std::chrono::milliseconds d) {
  return Clock::now() + d;
}

// What of a memfd channel is left in this process: mappings and descriptors of the segment.
int segments_held() {
  int held = 0;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) held += contains(line, "memfd:tessel-shm");
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && contains(target.string(), "memfd:tessel-shm")) ++held;
  }
  return held;
}

// Entries of /dev/shm that a channel could have left (none ever: the segment is a memfd).
int dev_shm_leftovers() {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
    n += contains(e.path().filename().string(), "tessel-shm");
  return n;
}

// Rank 0 creates a channel with `role` and mails its name to rank 1, which opens it.
std::unique_ptr<ShmChannel> pair_channel(Mailboxes& mail, int rank, Role creator_role,
                                         size_t capacity = kRing) {
  if (rank == 0) {
    auto ch = ShmChannel::create(creator_role, capacity, "rank 1");
    mail.put(1, ch->name());
    ch->wait_attached(in(20s));
    return ch;
  }
  return ShmChannel::open(mail.get(1), "rank 0");
}

TEST(ShmChannel, TransfersEverySizeByteExact) {
  // Sizes around the ring's capacity (a message filling it exactly, one byte short, one over),
  // and one 1024 times larger than it, streamed through.
  const size_t cap = kRing;
  const std::vector<size_t> sizes = {0, 1, 4096, cap - 1, cap, cap + 1, 64 * kMiB};
  for (Role creator : {Role::kSender, Role::kReceiver}) {
    Mailboxes mail(2);
    auto out = run_ranks(2, 120s, [&](int rank) {
      auto ch = pair_channel(mail, rank, creator);
      CHILD_CHECK(ch->capacity() == cap, rank, std::to_string(ch->capacity()));
      for (size_t m = 0; m < sizes.size(); ++m) {
        const auto expected = pattern(sizes[m], m);
        if (ch->role() == Role::kSender) {
          ch->write(expected.data(), expected.size(), in(60s));
        } else {
          std::vector<unsigned char> got(sizes[m], 0);
          ch->read(got.data(), got.size(), in(60s));
          const size_t bad = first_diff(got, expected);
          CHILD_CHECK(bad == got.size(), rank,
                      "size " + std::to_string(sizes[m]) + " differs at " + std::to_string(bad));
        }
      }
      return kChildOk;
    });
    for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
  }
}

TEST(ShmChannel, ManyMessagesArriveInOrder) {
  constexpr int kMessages = 20000;
  Mailboxes mail(2);
  auto out = run_ranks(2, 120s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kSender);
    std::vector<unsigned char> buf(3000);
    for (int m = 0; m < kMessages; ++m) {
      // A header with the sequence number and length, then a body of varying length.
      const size_t len = size_t(m * 37) % buf.size();
      uint64_t head[2] = {uint64_t(m), len};
      if (rank == 0) {
        const auto body = pattern(len, uint64_t(m));
        ch->write(head, sizeof head, in(30s));
        ch->write(body.data(), len, in(30s));
      } else {
        ch->read(head, sizeof head, in(30s));
        CHILD_CHECK(head[0] == uint64_t(m) && head[1] == len, rank,
                    "message " + std::to_string(m) + " got header " + std::to_string(head[0]));
        std::vector<unsigned char> got(len);
        ch->read(got.data(), len, in(30s));
        CHILD_CHECK(got == pattern(len, uint64_t(m)), rank, "body " + std::to_string(m));
      }
    }
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

TEST(ShmChannel, ReadWithHandsAlignedSpansOfWholeElements) {
  // A reduction reads floats in place: spans must hold whole elements, at aligned addresses, even
  // when the sender publishes in pieces of odd byte counts and the ring wraps.
  constexpr size_t kFloats = 100003;
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kReceiver);
    std::vector<float> v(kFloats);
    for (size_t i = 0; i < kFloats; ++i) v[i] = float(i % 1000);
    if (ch->role() == Role::kSender) {
      const auto* p = reinterpret_cast<const unsigned char*>(v.data());
      const size_t total = kFloats * sizeof(float);
      for (size_t off = 0, step = 1; off < total; off += step, step = step * 3 % 4093 + 1)
        ch->write(p + off, std::min(step, total - off), in(30s));
    } else {
      double sum = 0;
      size_t bad_spans = 0;
      ch->read_with(
          kFloats * sizeof(float), sizeof(float), in(30s), [&](const std::byte* p, size_t n) {
            bad_spans +=
                (n % sizeof(float) != 0) || (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0);
            const auto* f = reinterpret_cast<const float*>(p);
            for (size_t i = 0; i < n / sizeof(float); ++i) sum += f[i];
          });
      double expected = 0;
      for (float x : v) expected += x;
      CHILD_CHECK(bad_spans == 0, rank, std::to_string(bad_spans) + " misaligned spans");
      // Integers below 2^53 summed in double: exact in any order.
      CHILD_CHECK(sum == expected, rank, std::to_string(sum) + " vs " + std::to_string(expected));
    }
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// The sender dies (SIGKILL) halfway through a message larger than the ring: the receiver, whose
// deadline is far away, must get PeerLostError (noticed from the pid, not from the deadline),
// after receiving every byte that was written.
TEST(ShmChannel, SenderKilledMidTransferIsPeerLost) {
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kSender, kMiB);
    const auto data = pattern(64 * kMiB, 7);
    if (rank == 0) {
      ch->write(data.data(), 8 * kMiB, in(30s));
      raise(SIGKILL);
    }
    std::vector<unsigned char> got(data.size(), 0);
    const auto start = Clock::now();
    const Caught c = catch_error(rank, [&] { ch->read(got.data(), got.size(), in(30s)); });
    std::fprintf(
        stderr, "[rank 1] noticed the death after %lld ms\n",
        (long long)std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start)
            .count());
    CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind) + (": " + c.what));
    CHILD_CHECK(contains(c.what, "rank 0") && contains(c.what, "died") &&
                    contains(c.what, std::to_string(64 * kMiB)),
                rank, c.what);
    CHILD_CHECK(std::equal(got.begin(), got.begin() + 8 * kMiB, data.begin()), rank,
                "the bytes written before the death differ");
    // Broken for good: a later call fails at once with the same kind.
    CHILD_CHECK(
        catch_error(rank, [&] { ch->read(got.data(), 1, in(30s)); }).kind == Thrown::kPeerLost,
        rank, "second read");
    return kChildOk;
  });
  EXPECT_EQ(out[0].signal, SIGKILL) << testing::describe(out);
  EXPECT_TRUE(out[1].ok()) << testing::describe(out);
}

// The receiver dies while the sender waits for room in a full ring.
TEST(ShmChannel, ReceiverKilledMidTransferIsPeerLost) {
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kReceiver, kMiB);
    std::vector<unsigned char> data(64 * kMiB, 1);
    if (ch->role() == Role::kReceiver) {
      ch->read(data.data(), 3 * kMiB, in(30s));
      raise(SIGKILL);
    }
    const Caught c = catch_error(rank, [&] { ch->write(data.data(), data.size(), in(30s)); });
    CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind) + (": " + c.what));
    CHILD_CHECK(contains(c.what, "rank 0") && contains(c.what, "died"), rank, c.what);
    return kChildOk;
  });
  // Rank 0 created the channel as its receiver.
  EXPECT_EQ(out[0].signal, SIGKILL) << testing::describe(out);
  EXPECT_TRUE(out[1].ok()) << testing::describe(out);
}

// abort() from another thread ends this process's blocked wait at once: PeerLostError with the
// reason, long before the deadline.
TEST(ShmChannel, AbortEndsThisProcesssBlockedRead) {
  auto ch = ShmChannel::create(Role::kReceiver, kRing, "rank 1");
  std::thread aborter([&] {
    std::this_thread::sleep_for(100ms);
    ch->abort("the test says stop");
  });
  unsigned char b[16];
  const std::string what =
      tessel::testing::error_of<PeerLostError>([&] { ch->read(b, 16, Clock::now() + 60s); });
  aborter.join();
  EXPECT_TRUE(contains(what, "aborted by this process: the test says stop")) << what;
  EXPECT_TRUE(contains(ch->failure(), "the test says stop")) << ch->failure();
}

// ... and the peer's: a sender blocked on the full ring gets PeerLostError saying the peer
// aborted.
TEST(ShmChannel, AbortEndsThePeersBlockedWrite) {
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kReceiver);
    if (ch->role() == Role::kReceiver) {
      while (ch->readable() < ch->capacity()) std::this_thread::sleep_for(1ms);
      ch->abort("the test says stop");
      unsigned char b[4];
      const Caught c = catch_error(rank, [&] { ch->read(b, 4, in(30s)); });
      CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind) + (": " + c.what));
      return kChildOk;
    }
    std::vector<unsigned char> data(4 * kMiB, 3);
    const Caught c = catch_error(rank, [&] { ch->write(data.data(), data.size(), in(30s)); });
    CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind) + (": " + c.what));
    CHILD_CHECK(contains(c.what, "the peer aborted") &&
                    contains(c.what, std::to_string(kRing) + " of them written"),
                rank, c.what);
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

TEST(ShmChannel, AbortBeforeACallFailsItAtOnce) {
  auto ch = ShmChannel::create(Role::kSender, kRing, "nobody");
  ch->abort("early");
  ch->abort("second reason is ignored");
  const std::string what =
      tessel::testing::error_of<PeerLostError>([&] { ch->write("x", 1, Clock::now() + 30s); });
  EXPECT_TRUE(contains(what, "aborted by this process: early")) << what;
  EXPECT_FALSE(contains(what, "second")) << what;
}

// Without a peer every wait ends at its deadline with TimeoutError naming the peer and the bytes.
TEST(ShmChannel, NoPeerTimesOutAtTheDeadline) {
  std::string what = tessel::testing::error_of<TimeoutError>([&] {
    ShmChannel::create(Role::kSender, kRing, "rank 9")->wait_attached(Clock::now() + 200ms);
  });
  EXPECT_TRUE(contains(what, "rank 9") && contains(what, "no peer opened")) << what;
  // Writes fill the ring without a reader, then time out with what they managed.
  auto sender = ShmChannel::create(Role::kSender, kRing, "rank 9");
  std::vector<unsigned char> data(kRing + 100, 1);
  what = tessel::testing::error_of<TimeoutError>(
      [&] { sender->write(data.data(), data.size(), Clock::now() + 200ms); });
  EXPECT_TRUE(contains(what, "rank 9") && contains(what, std::to_string(data.size())) &&
              contains(what, std::to_string(kRing) + " of them written") &&
              contains(what, "no peer has opened"))
      << what;

  auto receiver = ShmChannel::create(Role::kReceiver, kRing, "rank 8");
  what = tessel::testing::error_of<TimeoutError>(
      [&] { receiver->read(data.data(), 5, Clock::now() + 200ms); });
  EXPECT_TRUE(contains(what, "rank 8") && contains(what, "read of 5 bytes") &&
              contains(what, "0 of them read"))
      << what;
}

// A peer that is alive and attached but sends nothing: TimeoutError, not PeerLostError.
TEST(ShmChannel, SilentPeerTimesOut) {
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kSender);
    unsigned char b[8] = {};
    if (rank == 0) {
      ch->write(b, 3, in(30s));
      mail.get(0);  // until the peer is done
      return kChildOk;
    }
    const Caught c = catch_error(rank, [&] { ch->read(b, 8, in(300ms)); });
    mail.put(0, "done");
    CHILD_CHECK(c.kind == Thrown::kTimeout, rank, thrown_name(c.kind) + (": " + c.what));
    CHILD_CHECK(contains(c.what, "rank 0") && contains(c.what, "3 of them read"), rank, c.what);
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

// A sender that closes (or exits) after writing: the receiver still gets every byte, then a wait
// for more is PeerLostError.
TEST(ShmChannel, DataWrittenBeforeACloseIsDelivered) {
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    auto ch = pair_channel(mail, rank, Role::kSender);
    const auto data = pattern(10000, 1);
    if (rank == 0) {
      ch->write(data.data(), data.size(), in(30s));
      ch.reset();
      return kChildOk;  // exits: the segment stays mapped by the receiver
    }
    std::this_thread::sleep_for(100ms);
    std::vector<unsigned char> got(data.size());
    ch->read(got.data(), got.size(), in(30s));
    CHILD_CHECK(got == data, rank, "bytes differ");
    const Caught c = catch_error(rank, [&] { ch->read(got.data(), 1, in(30s)); });
    CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind) + (": " + c.what));
    CHILD_CHECK(contains(c.what, "closed") || contains(c.what, "died"), rank, c.what);
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

TEST(ShmChannel, RefusesBadNames) {
  EXPECT_THROW(ShmChannel::open("not a name", "p"), InvalidArgumentError);
  EXPECT_THROW(ShmChannel::open("12:3:abc trailing", "p"), InvalidArgumentError);
  EXPECT_THROW(ShmChannel::create(Role::kSender, 0, "p"), InvalidArgumentError);

  auto ch = ShmChannel::create(Role::kSender, kRing, "p");
  // The right pid and fd with another nonce: a recycled fd must not be mapped.
  const std::string name = ch->name();
  const std::string wrong_nonce = name.substr(0, name.rfind(':') + 1) + "0123456789abcdef";
  std::string what =
      tessel::testing::error_of<PeerLostError>([&] { ShmChannel::open(wrong_nonce, "p"); });
  EXPECT_TRUE(contains(what, "another segment")) << what;
  // An fd of this process that is not a channel (stdin's, whatever it is).
  what = tessel::testing::error_of<PeerLostError>(
      [&] { ShmChannel::open(std::to_string(getpid()) + ":0:0123456789abcdef", "p"); });
  EXPECT_TRUE(contains(what, "no longer holds the segment")) << what;
  // A process that is gone.
  pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  what = tessel::testing::error_of<PeerLostError>(
      [&] { ShmChannel::open(std::to_string(child) + ":5:0123456789abcdef", "p"); });
  EXPECT_TRUE(contains(what, "is gone")) << what;
  // Only one process may open a channel.
  auto first = ShmChannel::open(name, "p");
  EXPECT_EQ(first->role(), Role::kReceiver);
  what = tessel::testing::error_of<IoError>([&] { ShmChannel::open(name, "p"); });
  EXPECT_TRUE(contains(what, "already opened")) << what;
}

// Nothing of a channel outlives it: no mapping, no descriptor, nothing in /dev/shm -- also when
// the peer was killed, and on the side that created it.
TEST(ShmChannel, LeavesNothingBehind) {
  const int dev_shm_before = dev_shm_leftovers();
  Mailboxes mail(2);
  auto out = run_ranks(2, 60s, [&](int rank) {
    {
      auto ch = pair_channel(mail, rank, Role::kSender);
      CHILD_CHECK(segments_held() == 1, rank, std::to_string(segments_held()));  // the mapping
      unsigned char b[4] = {1, 2, 3, 4};
      if (rank == 0) {
        ch->write(b, 4, in(30s));
        mail.get(0);
        raise(SIGKILL);
      }
      ch->read(b, 4, in(30s));
      mail.put(0, "kill yourself");
      const Caught c = catch_error(rank, [&] { ch->read(b, 4, in(30s)); });
      CHILD_CHECK(c.kind == Thrown::kPeerLost, rank, thrown_name(c.kind));
    }
    CHILD_CHECK(segments_held() == 0, rank, std::to_string(segments_held()));
    return kChildOk;
  });
  EXPECT_EQ(out[0].signal, SIGKILL) << testing::describe(out);
  EXPECT_TRUE(out[1].ok()) << testing::describe(out);
  {
    auto unattached = ShmChannel::create(Role::kReceiver, kRing, "nobody");
    EXPECT_EQ(segments_held(), 2);  // the mapping and the descriptor the peer would open
  }
  EXPECT_EQ(segments_held(), 0);
  EXPECT_EQ(dev_shm_leftovers(), dev_shm_before);
}

// A ring of channels over n processes (rank r sends to r+1), as the Communicator's ring
// all-reduce builds it: a token passed around the ring, then every rank sending to its right
// neighbour while it receives from its left one (the sends on a thread of their own, since each
// message is larger than the ring).
class ShmChannelRing : public ::testing::TestWithParam<int> {};

TEST_P(ShmChannelRing, TokenAndExchangeAroundTheRing) {
  const int n = GetParam();
  Mailboxes mail(n);
  auto out = run_ranks(n, 120s, [&](int rank) {
    const int right = (rank + 1) % n;
    const int left = (rank + n - 1) % n;
    auto to_right = ShmChannel::create(Role::kSender, kRing, "rank " + std::to_string(right));
    mail.put(right, to_right->name());
    auto from_left = ShmChannel::open(mail.get(rank), "rank " + std::to_string(left));
    to_right->wait_attached(in(20s));

    const size_t bytes = 3 * kMiB + 5;
    auto token = pattern(bytes, 42);
    std::vector<unsigned char> got(bytes, 0);
    if (rank == 0) {
      to_right->write(token.data(), bytes, in(60s));
      from_left->read(got.data(), bytes, in(60s));
    } else {
      from_left->read(got.data(), bytes, in(60s));
      to_right->write(got.data(), bytes, in(60s));
    }
    CHILD_CHECK(got == token, rank, "token changed on its way around");

    const auto mine = pattern(bytes, uint64_t(rank));
    std::thread sender([&] { to_right->write(mine.data(), bytes, in(60s)); });
    from_left->read(got.data(), bytes, in(60s));
    sender.join();
    CHILD_CHECK(got == pattern(bytes, uint64_t(left)), rank, "left neighbour's message differs");
    return kChildOk;
  });
  for (const auto& o : out) EXPECT_TRUE(o.ok()) << testing::describe(out);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmChannelRing, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace tessel::comm
