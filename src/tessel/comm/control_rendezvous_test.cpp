// Gloo's rendezvous through the control store: the adapter on its own (against a MemoryStore), and
// communicators formed through the embedded store's server by processes that share no directory.
#include "tessel/comm/control_rendezvous.h"

#include <gloo/common/error.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/abort_signal.h"
#include "tessel/comm/comm_state.h"
#include "tessel/comm/communicator.h"
#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/comm/memory_store.h"
#include "tessel/comm/multiprocess_test_util.h"
#include "tessel/comm/store_server.h"
#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::kChildOk;
using testing::run_ranks;
using testing::Thrown;
using testing::what_throws;

std::vector<char> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TEST(ControlRendezvous, SetAndGetAreBinarySafeAndAKeyIsWrittenOnce) {
  MemoryStore control;
  ControlRendezvousStore store(control, 2s);
  const std::string value("\0\xff\n{}", 5);
  store.set("job/0/world/0", bytes(value));
  EXPECT_EQ(store.get("job/0/world/0"), bytes(value));
  EXPECT_EQ(control.get("job/0/world/0")->value, value);
  try {
    store.set("job/0/world/0", bytes("again"));
    FAIL() << "overwrote a rendezvous key";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("job/0/world/0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(control.get("job/0/world/0")->value, value);
}

TEST(ControlRendezvous, AWaitEndsWhenAnotherProcessSetsTheKey) {
  MemoryStore control;
  ControlRendezvousStore store(control, 20s);
  std::thread peer([&] {
    std::this_thread::sleep_for(20ms);
    control.set("world/1", "address");
  });
  EXPECT_EQ(store.get("world/1"), bytes("address"));
  peer.join();
}

// The adapter's own timeout bounds every wait, whatever Gloo passes, and a timeout is the
// gloo::IoException the Communicator maps to TimeoutError.
TEST(ControlRendezvous, AWaitTimesOutAsAGlooIoExceptionNamingTheMissingKey) {
  MemoryStore control;
  ControlRendezvousStore store(control, 30ms);
  store.set("world/0", bytes("here"));
  const auto start = Clock::now();
  try {
    store.wait({"world/0", "world/7"}, 60s);
    FAIL() << "waited for a key nobody sets";
  } catch (const gloo::IoException& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("world/7"), std::string::npos) << what;
    EXPECT_EQ(detail::classify_gloo_message(what), detail::FailureKind::kTimeout) << what;
  }
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_THROW(store.get("world/7"), gloo::IoException);
  EXPECT_THROW(ControlRendezvousStore(control, 0ms), ConfigError);
}

// With an abort signal the adapter waits in slices: the signal ends a wait within about a slice,
// a key that appears after several slices is still found, and the whole timeout still applies.
TEST(ControlRendezvous, WithASignalAWaitEndsOnAbortAndStillFindsLateKeys) {
  MemoryStore control;
  auto signal = std::make_shared<AbortSignal>();
  ControlRendezvousStore store(control, 60s, signal);

  std::thread late([&] {
    std::this_thread::sleep_for(kAbortableWaitSlice * 2 + 50ms);
    control.set("world/1", "address");
  });
  EXPECT_EQ(store.get("world/1"), bytes("address"));
  late.join();

  std::thread aborter([&] {
    std::this_thread::sleep_for(50ms);
    signal->abort("process 4 died");
  });
  const auto start = Clock::now();
  try {
    store.wait({"world/1", "world/2"});
    FAIL() << "waited for a key nobody sets";
  } catch (const gloo::IoException& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rendezvous aborted"), std::string::npos) << what;
    EXPECT_NE(what.find("world/2"), std::string::npos) << what;
    EXPECT_NE(what.find("process 4 died"), std::string::npos) << what;
  }
  aborter.join();
  EXPECT_LT(Clock::now() - start, 30s);

  ControlRendezvousStore short_wait(control, kAbortableWaitSlice * 2 + 30ms,
                                    std::make_shared<AbortSignal>());
  try {
    short_wait.wait({"world/9"});
    FAIL() << "waited for a key nobody sets";
  } catch (const gloo::IoException& e) {
    EXPECT_EQ(detail::classify_gloo_message(e.what()), detail::FailureKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("world/9"), std::string::npos) << e.what();
  }
}

TEST(ControlRendezvous, AnUnreachableControlStoreIsALostPeerForGloo) {
  EtcdStore control("http://127.0.0.1:" + std::to_string(testing::free_port()), 2s);
  ControlRendezvousStore store(control, 2s);
  try {
    store.set("world/0", bytes("x"));
    FAIL() << "set a key in a store that is not there";
  } catch (const gloo::IoException& e) {
    EXPECT_NE(std::string(e.what()).find("world/0"), std::string::npos) << e.what();
    EXPECT_EQ(detail::classify_gloo_message(e.what()), detail::FailureKind::kPeerLost) << e.what();
  }
}

TEST(ControlRendezvous, OptionsNeedAPathOrAControlEndpoint) {
  StoreOptions o;
  o.job_id = "job";
  EXPECT_THROW(validate(o), ConfigError);
  o.control_endpoint = "127.0.0.1:2379";
  EXPECT_THROW(validate(o), ConfigError);
  o.control_endpoint = "http://127.0.0.1:2379";
  EXPECT_NO_THROW(validate(o));
  o.generation = 3;
  EXPECT_EQ(store_prefix(o, "tp.1"), "/tessel/job/rendezvous/3/tp.1");
}

StoreOptions through(const StoreServer& server, int64_t generation,
                     std::chrono::milliseconds timeout = 20s) {
  StoreOptions o;
  o.job_id = "job-c";
  o.generation = generation;
  o.timeout = timeout;
  o.control_endpoint = server.endpoint();
  return o;
}

// The parent serves the store; the ranks, forked after it started, share nothing else. Each
// world size forms its world in its own generation.
TEST(ControlRendezvous, CommunicatorsFormThroughTheEmbeddedStore) {
  StoreServer server(std::make_shared<MemoryStore>());
  for (int size = 1; size <= 4; ++size) {
    const StoreOptions store = through(server, size);
    EXPECT_TRUE(store.path.empty());
    auto outcomes = run_ranks(size, 60s, [&](int rank) {
      auto c = Communicator::connect(store, "world", rank, size, 20s);
      std::vector<double> v(1000);
      for (size_t i = 0; i < v.size(); ++i) v[i] = double((rank + 1) * int(i % 13));
      c->all_reduce_sum(v.data(), v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        CHILD_CHECK(v[i] == double(size * (size + 1) / 2 * int(i % 13)), rank,
                    "all_reduce_sum wrong at " + std::to_string(i));
      }
      return kChildOk;
    });
    for (const auto& o : outcomes) {
      EXPECT_TRUE(o.ok()) << "world size " << size << "\n" << testing::describe(outcomes);
    }
    // Every rank of a connected world registered under the group's prefix (size 1 never meets).
    const std::string prefix = store_prefix(store, "world") + "/";
    EXPECT_EQ(server.store().list(prefix).empty(), size == 1) << "world size " << size;
    for (int rank = 0; size > 1 && rank < size; ++rank) {
      EXPECT_TRUE(server.store().get(prefix + std::to_string(rank)).has_value())
          << "world size " << size << ", rank " << rank;
    }
  }
  // Re-using a generation whose keys are in the store is refused, not mis-wired.
  auto outcomes = run_ranks(1, 20s, [&](int) {
    try {
      Communicator::connect(through(server, 2, 2s), "world", 0, 2, 20s);
    } catch (const ConfigError& e) {
      std::fprintf(stderr, "expected ConfigError: %s\n", e.what());
      return kChildOk;
    }
    return testing::kChildCheckFailed;
  });
  EXPECT_TRUE(outcomes[0].ok()) << testing::describe(outcomes);
}

TEST(ControlRendezvous, RendezvousTimesOutWhenPeersNeverArrive) {
  StoreServer server(std::make_shared<MemoryStore>());
  const StoreOptions store = through(server, 0, 200ms);
  auto outcomes = run_ranks(1, 20s, [&](int rank) {
    Thrown t = what_throws(rank, [&] { Communicator::connect(store, "world", 0, 2, 20s); });
    CHILD_CHECK(t == Thrown::kTimeout, rank, thrown_name(t));
    return kChildOk;
  });
  EXPECT_TRUE(outcomes[0].ok()) << testing::describe(outcomes);
}

}  // namespace
}  // namespace tessel::comm
