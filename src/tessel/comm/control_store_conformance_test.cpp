// One conformance suite for every control store (control_store.h): each implementation must pass
// all of it. A store is added by one line in kStores.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/comm/etcd_store.h"
#include "tessel/comm/etcd_test_util.h"
#include "tessel/comm/memory_store.h"
#include "tessel/comm/signed_store.h"
#include "tessel/comm/store_server.h"
#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

// A fresh, empty store, with what it runs on (an etcd server, the embedded server) kept alive as
// long as the store; or why this kind of store cannot be tested here.
struct MadeStore {
  std::shared_ptr<void> backend;
  std::unique_ptr<ControlStore> store;
  std::string skip;
};

struct StoreKind {
  std::string name;
  std::function<MadeStore()> make;
  // Its get() refuses counters: add() leaves them unsigned (signed_store.h), and its users read
  // them by adding 0.
  bool counters_by_add = false;
};

// Test names and CTest's listing show the store's name, not the object's bytes.
void PrintTo(const StoreKind& kind, std::ostream* os) {
  *os << kind.name;
}

const std::vector<StoreKind>& kStores() {
  static const std::vector<StoreKind> stores = {
      {"memory",
       [] {
         return MadeStore{nullptr, std::make_unique<MemoryStore>(), ""};
       }},
      // One etcd server per test: each starts from an empty store at revision 1.
      {"etcd",
       [] {
         const auto binary = testing::find_etcd();
         if (!binary) return MadeStore{nullptr, nullptr, testing::kNoEtcd};
         auto server = std::make_shared<testing::EtcdServer>(*binary);
         auto store = std::make_unique<EtcdStore>(server->endpoint(), 10s);
         return MadeStore{server, std::move(store), ""};
       }},
      // The embedded store: a MemoryStore served over etcd's gateway protocol, through EtcdStore.
      {"embedded",
       [] {
         auto server = std::make_shared<StoreServer>(std::make_shared<MemoryStore>());
         auto store = std::make_unique<EtcdStore>(server->endpoint(), 10s);
         return MadeStore{server, std::move(store), ""};
       }},
      // Signed values over a MemoryStore: signing changes nothing a member sees.
      {"signed",
       [] {
         auto store = std::make_unique<SignedStore>(std::make_shared<MemoryStore>(),
                                                    "conformance-secret", "job conformance");
         return MadeStore{nullptr, std::move(store), ""};
       },
       true},
      // And over the embedded store: the way a job with a secret reaches its control store.
      {"signed_embedded",
       [] {
         auto server = std::make_shared<StoreServer>(std::make_shared<MemoryStore>());
         auto store =
             std::make_unique<SignedStore>(std::make_shared<EtcdStore>(server->endpoint(), 10s),
                                           "conformance-secret", "job conformance");
         return MadeStore{server, std::move(store), ""};
       },
       true},
  };
  return stores;
}

class Conformance : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override {
    MadeStore made = GetParam().make();
    if (!made.skip.empty()) GTEST_SKIP() << made.skip;
    backend = std::move(made.backend);
    store = std::move(made.store);
  }
  // The decimal a counter holds, read as the store's users read it.
  std::string counter(const std::string& key) {
    if (GetParam().counters_by_add) return std::to_string(store->add(key, 0));
    return store->get(key)->value;
  }
  std::shared_ptr<void> backend;  // destroyed after the store
  std::unique_ptr<ControlStore> store;
};

TEST_P(Conformance, SetGetAndRevisionsIncrease) {
  EXPECT_FALSE(store->get("job/a").has_value());
  const int64_t r0 = store->revision();
  const int64_t r1 = store->set("job/a", "one");
  const int64_t r2 = store->set("job/b", "two");
  EXPECT_GT(r1, r0);
  EXPECT_GT(r2, r1);
  EXPECT_EQ(store->revision(), r2);
  auto a = store->get("job/a");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->value, "one");
  EXPECT_EQ(a->revision, r1);
  const int64_t r3 = store->set("job/a", "uno");
  EXPECT_EQ(store->get("job/a")->value, "uno");
  EXPECT_EQ(store->get("job/a")->revision, r3);
  // Binary-safe values.
  const std::string bytes("\0\xff\n{}", 5);
  store->set("job/bytes", bytes);
  EXPECT_EQ(store->get("job/bytes")->value, bytes);
}

TEST_P(Conformance, CompareAndSetSucceedsOnlyAtTheExpectedRevision) {
  // Expected revision 0: create only if absent.
  auto created = store->compare_and_set("job/leader", 0, "p1");
  ASSERT_TRUE(created.has_value());
  EXPECT_FALSE(store->compare_and_set("job/leader", 0, "p2").has_value());
  EXPECT_FALSE(store->compare_and_set("job/leader", *created + 1000, "p2").has_value());
  EXPECT_EQ(store->get("job/leader")->value, "p1");
  auto replaced = store->compare_and_set("job/leader", *created, "p3");
  ASSERT_TRUE(replaced.has_value());
  EXPECT_GT(*replaced, *created);
  EXPECT_EQ(store->get("job/leader")->value, "p3");
}

TEST_P(Conformance, AddCountsAndRefusesANonNumber) {
  EXPECT_EQ(store->add("job/n", 1), 1);
  EXPECT_EQ(store->add("job/n", 41), 42);
  EXPECT_EQ(store->add("job/n", -2), 40);
  EXPECT_EQ(counter("job/n"), "40");
  store->set("job/text", "hello");
  EXPECT_THROW(store->add("job/text", 1), CorruptDataError);
  EXPECT_EQ(store->get("job/text")->value, "hello");
}

TEST_P(Conformance, EraseAndListByPrefix) {
  store->set("job/1/b", "x");
  store->set("job/1/a", "y");
  store->set("job/10", "z");
  store->set("other/1/a", "w");
  auto l = store->list("job/1/");
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0].key, "job/1/a");
  EXPECT_EQ(l[1].key, "job/1/b");
  EXPECT_EQ(store->list("job/").size(), 3u);
  EXPECT_TRUE(store->erase("job/1/a"));
  EXPECT_FALSE(store->erase("job/1/a"));
  EXPECT_EQ(store->list("job/1/").size(), 1u);
  EXPECT_TRUE(store->list("nothing/").empty());
}

TEST_P(Conformance, WaitReturnsOnceEveryKeyExistsAndNamesTheMissingOnTimeout) {
  store->set("job/r0", "up");
  std::thread writer([&] {
    std::this_thread::sleep_for(20ms);
    store->set("job/r1", "up");
    store->set("job/r2", "up");
  });
  store->wait({"job/r0", "job/r1", "job/r2"}, 30s);
  writer.join();
  try {
    store->wait({"job/r0", "job/r7"}, 50ms);
    FAIL() << "waited for a key nobody writes";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("job/r7"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("job/r0"), std::string::npos) << e.what();
  }
}

// Watching by revision: every change after the revision asked for, in order, exactly once; a
// watcher that asks again from an older revision (it lost a reply) gets the same changes again.
TEST_P(Conformance, WatchReturnsEachChangeAfterARevisionInOrder) {
  const int64_t start = store->revision();
  store->set("job/g/switch", "1");
  store->set("elsewhere", "ignored");
  store->set("job/g/switch", "2");
  store->erase("job/g/switch");
  const auto r = store->watch("job/g/", start, 10s);
  ASSERT_EQ(r.events.size(), 3u);
  EXPECT_EQ(r.events[0].kind, WatchEvent::Kind::put);
  EXPECT_EQ(r.events[0].kv.value, "1");
  EXPECT_EQ(r.events[1].kv.value, "2");
  EXPECT_EQ(r.events[2].kind, WatchEvent::Kind::erase);
  EXPECT_EQ(r.events[2].kv.key, "job/g/switch");
  EXPECT_LT(r.events[0].kv.revision, r.events[1].kv.revision);
  EXPECT_LT(r.events[1].kv.revision, r.events[2].kv.revision);
  EXPECT_EQ(r.revision, r.events[2].kv.revision);
  // Asked again from where it left off: nothing new (after the timeout).
  const auto none = store->watch("job/g/", r.revision, 30ms);
  EXPECT_TRUE(none.events.empty());
  EXPECT_GE(none.revision, r.revision);
  // A reply lost: asked again from the middle, the later changes come again.
  const auto again = store->watch("job/g/", r.events[0].kv.revision, 10s);
  ASSERT_EQ(again.events.size(), 2u);
  EXPECT_EQ(again.events[0].kv.value, "2");
}

TEST_P(Conformance, WatchWakesOnAChangeMadeWhileItWaits) {
  const int64_t start = store->revision();
  std::thread writer([&] {
    std::this_thread::sleep_for(30ms);
    store->set("job/go", "now");
  });
  const auto r = store->watch("job/", start, 30s);
  writer.join();
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].kv.value, "now");
}

TEST_P(Conformance, KeysOfAnExpiredLeaseVanish) {
  const LeaseId lease = store->grant_lease(500ms);
  const int64_t start = store->revision();
  store->set("job/hosts/a", "alive", lease);
  store->set("job/plain", "stays");
  EXPECT_EQ(store->get("job/hosts/a")->lease, lease);
  // The erase is a change like any other: a watcher sees it.
  WatchResult r;
  for (int i = 0; i < 100 && r.events.size() < 2; ++i) {
    auto more = store->watch("job/hosts/", r.revision ? r.revision : start, 100ms);
    r.revision = more.revision;
    for (auto& e : more.events) r.events.push_back(e);
  }
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[1].kind, WatchEvent::Kind::erase);
  EXPECT_FALSE(store->get("job/hosts/a").has_value());
  EXPECT_TRUE(store->get("job/plain").has_value());
  EXPECT_THROW(store->keep_alive(lease), PeerLostError);
  EXPECT_THROW(store->set("job/hosts/a", "back", lease), PeerLostError);
}

TEST_P(Conformance, AKeptAliveLeaseKeepsItsKeysAndRevokeErasesThem) {
  const LeaseId lease = store->grant_lease(10s);
  store->set("job/w/0", "x", lease);
  store->set("job/w/1", "y", lease);
  store->keep_alive(lease);
  EXPECT_EQ(store->list("job/w/").size(), 2u);
  store->revoke(lease);
  EXPECT_TRUE(store->list("job/w/").empty());
  EXPECT_THROW(store->keep_alive(lease), PeerLostError);
  store->revoke(lease);  // again: no error
}

TEST_P(Conformance, ConcurrentAddsAndOneWinnerOfCompareAndSet) {
  constexpr int kThreads = 6, kAdds = 200;
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kAdds; ++i) store->add("job/count", 1);
      if (store->compare_and_set("job/owner", 0, std::to_string(t))) ++winners;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter("job/count"), std::to_string(kThreads * kAdds));
  EXPECT_EQ(winners.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(Stores, Conformance, ::testing::ValuesIn(kStores()),
                         [](const auto& info) { return info.param.name; });

// MemoryStore only: a watcher further behind than the kept history is told to re-list.
TEST(MemoryStore, AWatchBehindTheKeptHistoryIsToldToReList) {
  MemoryStore store(4);
  const int64_t start = store.revision();
  for (int i = 0; i < 10; ++i) store.set("job/k", std::to_string(i));
  EXPECT_THROW(store.watch("job/", start, 10ms), CorruptDataError);
  const auto recent = store.watch("job/", store.revision() - 2, 10ms);
  EXPECT_EQ(recent.events.size(), 2u);
}

}  // namespace
}  // namespace tessel::comm
