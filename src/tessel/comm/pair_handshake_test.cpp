// Only the job's members take part in a group (StoreOptions::secret): real processes on loopback
// connect through a FileStore or the control store (a StoreServer in the parent, which the
// forked ranks reach over HTTP). With the same secret everything works as without one; a rank with
// another secret makes every rank's connect fail with MembershipError, and a rank without any
// fails bounded by the store timeout -- never a hang.
#include "tessel/comm/pair_handshake.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tessel/comm/abort_signal.h"
#include "tessel/comm/communicator.h"
#include "tessel/comm/memory_store.h"
#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/comm/signed_store.h"
#include "tessel/comm/store_server.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using testing::contains;
using Clock = std::chrono::steady_clock;
using testing::kChildOk;
using testing::run_ranks;

constexpr auto kStoreTimeout = 20s;
constexpr auto kDeadline = 60s;  // the parent's bound on every test's children
const std::string kSecret = "the-job-secret-0123456789";
const std::string kOtherSecret = "another-secret-9876543210";

enum class StoreKind { kFile, kControl };

std::string store_name(StoreKind kind) {
  return kind == StoreKind::kFile ? "FileStore" : "ControlStore";
}

// Failure messages show the store's name, not the enum's bytes.
void PrintTo(StoreKind kind, std::ostream* os) {
  *os << store_name(kind);
}

// The rendezvous store of a test: a directory, or the control store a StoreServer in the parent
// serves (the ranks are forked after it started).
class TestStore {
 public:
  explicit TestStore(StoreKind kind) : kind_(kind) {
    if (kind == StoreKind::kControl) server_ = std::make_unique<StoreServer>(memory_);
  }
  StoreOptions options(const std::string& secret,
                       std::chrono::milliseconds timeout = kStoreTimeout) const {
    StoreOptions o;
    if (kind_ == StoreKind::kFile) {
      o.path = (dir_.path() / "rendezvous").string();
    } else {
      o.control_endpoint = server_->endpoint();
    }
    o.job_id = "pair-job";
    o.timeout = timeout;
    o.secret = secret;
    return o;
  }
  // The control store's rendezvous entries as stored (nothing for a FileStore).
  std::vector<KeyValue> entries() const { return memory_->list("/tessel/pair-job/rendezvous/"); }

 private:
  StoreKind kind_;
  tessel::testing::TempDir dir_;
  std::shared_ptr<MemoryStore> memory_ = std::make_shared<MemoryStore>();
  std::unique_ptr<StoreServer> server_;
};

// Connects and checks one all-reduce: every rank adds rank + 1 into each of a few elements.
int connect_and_all_reduce(const StoreOptions& o, int rank, int size) {
  auto comm = Communicator::connect(o, "world", rank, size, 10s);
  std::vector<int64_t> v(1000, rank + 1);
  comm->all_reduce_sum(v.data(), v.size());
  const int64_t expected = int64_t(size) * (size + 1) / 2;
  for (int64_t x : v) CHILD_CHECK(x == expected, rank, std::to_string(x));
  return kChildOk;
}

// What connect threw when it was a MembershipError, else "" (and says what it was instead).
std::string membership_refusal(const StoreOptions& o, int rank, int size) {
  try {
    Communicator::connect(o, "world", rank, size, 10s);
    std::fprintf(stderr, "[rank %d] connect succeeded\n", rank);
  } catch (const MembershipError& e) {
    std::fprintf(stderr, "[rank %d] MembershipError: %s\n", rank, e.what());
    return e.what();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] not a MembershipError: %s\n", rank, e.what());
  }
  return "";
}

void expect_all_ok(const std::vector<testing::RankOutcome>& outcomes) {
  for (const auto& o : outcomes) EXPECT_TRUE(o.ok()) << testing::describe(outcomes);
}

using SizeAndStore = std::tuple<int, StoreKind>;

std::string size_and_store_name(const ::testing::TestParamInfo<SizeAndStore>& info) {
  return "world" + std::to_string(std::get<0>(info.param)) + "_" +
         store_name(std::get<1>(info.param));
}

std::string store_kind_name(const ::testing::TestParamInfo<StoreKind>& info) {
  return store_name(info.param);
}

// ---------------------------------------------------------------------------------------------
// The proof itself.

TEST(PairProof, BindsBothRanksTheReceiversNonceAndTheGroup) {
  const std::string nonce(16, 'n');
  const auto proof = detail::pair_proof(kSecret, "/tessel/j/rendezvous/0/world", 0, 1, nonce);
  EXPECT_EQ(proof.size(), 32u);
  EXPECT_EQ(proof, detail::pair_proof(kSecret, "/tessel/j/rendezvous/0/world", 0, 1, nonce));
  // Reflected back to its sender, replayed with another nonce, in another group or generation,
  // or made with another secret: another proof.
  EXPECT_NE(proof, detail::pair_proof(kSecret, "/tessel/j/rendezvous/0/world", 1, 0, nonce));
  EXPECT_NE(proof, detail::pair_proof(kSecret, "/tessel/j/rendezvous/0/world", 0, 1,
                                      std::string(16, 'm')));
  EXPECT_NE(proof, detail::pair_proof(kSecret, "/tessel/j/rendezvous/1/world", 0, 1, nonce));
  EXPECT_NE(proof, detail::pair_proof(kSecret, "/tessel/j/rendezvous/0/dp.0", 0, 1, nonce));
  EXPECT_NE(proof, detail::pair_proof(kOtherSecret, "/tessel/j/rendezvous/0/world", 0, 1, nonce));
}

// ---------------------------------------------------------------------------------------------
// The same secret everywhere: connect and compute as without one.

class SameSecretTest : public ::testing::TestWithParam<SizeAndStore> {};

TEST_P(SameSecretTest, EveryRankConnectsAndAllReduces) {
  const int size = std::get<0>(GetParam());
  const StoreKind kind = std::get<1>(GetParam());
  TestStore store(kind);
  const auto outcomes = run_ranks(size, kDeadline, [&](int rank) {
    return connect_and_all_reduce(store.options(kSecret), rank, size);
  });
  expect_all_ok(outcomes);
  if (kind == StoreKind::kControl) {
    // The secret reached the control store: every rank's entry is signed.
    const auto entries = store.entries();
    EXPECT_EQ(entries.size(), size_t(size));
    for (const auto& kv : entries) EXPECT_TRUE(looks_signed(kv.value)) << kv.key;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, SameSecretTest,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(StoreKind::kFile,
                                                              StoreKind::kControl)),
                         size_and_store_name);

// ---------------------------------------------------------------------------------------------
// No secret anywhere: today's behaviour, entries stored as they are.

class NoSecretTest : public ::testing::TestWithParam<StoreKind> {};

TEST_P(NoSecretTest, EveryRankConnectsAndAllReducesAsBefore) {
  TestStore store(GetParam());
  const auto outcomes = run_ranks(
      3, kDeadline, [&](int rank) { return connect_and_all_reduce(store.options(""), rank, 3); });
  expect_all_ok(outcomes);
  for (const auto& kv : store.entries()) EXPECT_FALSE(looks_signed(kv.value)) << kv.key;
}

INSTANTIATE_TEST_SUITE_P(Stores, NoSecretTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kControl), store_kind_name);

// ---------------------------------------------------------------------------------------------
// Rank 2 holds another secret: every rank fails with MembershipError, at once. Through a
// FileStore the pair handshake catches it (naming the peer's address); through the control store
// the signed rendezvous entries do, before any pair to rank 2 connects.

class AnotherSecretTest : public ::testing::TestWithParam<StoreKind> {};

TEST_P(AnotherSecretTest, EveryRanksConnectFailsWithMembershipErrorWithinTheTimeout) {
  const StoreKind kind = GetParam();
  TestStore store(kind);
  const auto outcomes = run_ranks(3, kDeadline, [&](int rank) {
    const auto start = Clock::now();
    const std::string what =
        membership_refusal(store.options(rank == 2 ? kOtherSecret : kSecret), rank, 3);
    CHILD_CHECK(!what.empty(), rank, "connect did not throw MembershipError");
    CHILD_CHECK(Clock::now() - start < kStoreTimeout, rank, "failed only at the timeout");
    CHILD_CHECK(contains(what, "connect on group 'world' (rank " + std::to_string(rank) + " of 3)"),
                rank, what);
    CHILD_CHECK(contains(what, "--token-file"), rank, what);
    if (rank < 2) {
      CHILD_CHECK(contains(what, "rank 2"), rank, what);
    } else {
      CHILD_CHECK(contains(what, "rank 0") || contains(what, "rank 1"), rank, what);
    }
    if (kind == StoreKind::kFile) {
      // The handshake names the peer's address.
      CHILD_CHECK(contains(what, "pair handshake"), rank, what);
      CHILD_CHECK(contains(what, "listening at") && contains(what, "127.0.0.1"), rank, what);
    } else {
      CHILD_CHECK(contains(what, "rendezvous entry is refused"), rank, what);
      CHILD_CHECK(contains(what, "job pair-job"), rank, what);
    }
    return kChildOk;
  });
  expect_all_ok(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Stores, AnotherSecretTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kControl), store_kind_name);

// ---------------------------------------------------------------------------------------------
// A rank started without the secret.

// Through the control store both sides can tell: the member sees an unsigned entry, the other
// process a signed one it cannot read.
TEST(PairHandshake, AProcessWithoutTheSecretIsToldSoThroughTheControlStore) {
  TestStore store(StoreKind::kControl);
  const auto outcomes = run_ranks(2, kDeadline, [&](int rank) {
    const std::string what = membership_refusal(store.options(rank == 0 ? kSecret : ""), rank, 2);
    CHILD_CHECK(!what.empty(), rank, "connect did not throw MembershipError");
    if (rank == 0) {
      CHILD_CHECK(contains(what, "rank 1's rendezvous entry"), rank, what);
      CHILD_CHECK(contains(what, "without a signature"), rank, what);
    } else {
      CHILD_CHECK(contains(what, "rank 0's rendezvous entry is signed"), rank, what);
      CHILD_CHECK(contains(what, "--token-file"), rank, what);
    }
    return kChildOk;
  });
  expect_all_ok(outcomes);
}

// Through a FileStore the member waits for a proof that never comes: bounded by the store
// timeout, and the timeout says why it may have happened. The other side fails as its peer
// leaves.
TEST(PairHandshake, AProcessWithoutTheSecretEndsInABoundedTimeoutThatSaysWhy) {
  TestStore store(StoreKind::kFile);
  const auto outcomes = run_ranks(2, kDeadline, [&](int rank) {
    // The outsider waits longer than the member: had it given up first, its exit would close the
    // connection and the member would see a lost peer instead of its handshake's timeout.
    const auto got = testing::catch_error(rank, [&] {
      Communicator::connect(store.options(rank == 0 ? kSecret : "", rank == 0 ? 3s : 10s), "world",
                            rank, 2, 10s);
    });
    if (rank == 0) {
      CHILD_CHECK(got.kind == testing::Thrown::kTimeout, rank, got.what);
      CHILD_CHECK(contains(got.what, "membership handshake"), rank, got.what);
      CHILD_CHECK(contains(got.what, "--token-file"), rank, got.what);
    } else {
      CHILD_CHECK(got.kind != testing::Thrown::kNothing, rank, "connected to a member");
    }
    return kChildOk;
  });
  expect_all_ok(outcomes);
}

// The handshake's waits honour the abort signal like every other wait of connect.
TEST(PairHandshake, AbortEndsAConnectWaitingInTheHandshake) {
  TestStore store(StoreKind::kFile);
  const auto outcomes = run_ranks(2, kDeadline, [&](int rank) {
    StoreOptions o = store.options(rank == 0 ? kSecret : "", 60s);
    o.abort_signal = std::make_shared<AbortSignal>();
    std::thread aborter;
    if (rank == 0) {
      aborter = std::thread([&] {
        std::this_thread::sleep_for(1s);
        o.abort_signal->abort("test abort");
      });
    }
    const auto start = Clock::now();
    const auto got =
        testing::catch_error(rank, [&] { Communicator::connect(o, "world", rank, 2, 10s); });
    if (aborter.joinable()) aborter.join();
    CHILD_CHECK(Clock::now() - start < 30s, rank, "waited for the store timeout");
    CHILD_CHECK(got.kind == testing::Thrown::kPeerLost, rank, got.what);
    if (rank == 0) {
      CHILD_CHECK(contains(got.what, "rendezvous aborted by this process: test abort"), rank,
                  got.what);
    }
    return kChildOk;
  });
  expect_all_ok(outcomes);
}

}  // namespace
}  // namespace tessel::comm
