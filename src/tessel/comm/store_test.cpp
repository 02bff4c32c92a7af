#include "tessel/comm/store.h"

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/store.h>
#include <gtest/gtest.h>

#include <thread>

#include "tessel/comm/abort_signal.h"
#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

StoreOptions options(const tessel::testing::TempDir& dir, int64_t generation) {
  return StoreOptions{(dir.path() / "store").string(), "job-7", generation, 2s};
}

std::vector<char> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TEST(StoreTest, PrefixNamesJobGenerationAndGroup) {
  tessel::testing::TempDir dir;
  EXPECT_EQ(store_prefix(options(dir, 3), "tp.1"), "job-7/3/tp.1");
}

TEST(StoreTest, RejectsOptionsThatCannotFormAPrefix) {
  tessel::testing::TempDir dir;
  auto o = options(dir, 0);
  EXPECT_THROW(store_prefix(o, ""), ConfigError);
  EXPECT_THROW(store_prefix(o, "a/b"), ConfigError);
  o.job_id = "a/b";
  EXPECT_THROW(validate(o), ConfigError);
  o = options(dir, -1);
  EXPECT_THROW(validate(o), ConfigError);
  o = options(dir, 0);
  o.timeout = 0ms;
  EXPECT_THROW(validate(o), ConfigError);
  o = options(dir, 0);
  o.path = "";
  EXPECT_THROW(GroupStore(o, "world"), ConfigError);
}

// The same key written by two generations, and by two groups of one generation, lands in
// different entries of one directory; each store reads back its own value.
TEST(StoreTest, GenerationsAndGroupsDoNotShareKeys) {
  tessel::testing::TempDir dir;
  GroupStore gen0(options(dir, 0), "world");
  GroupStore gen1(options(dir, 1), "world");
  GroupStore other_group(options(dir, 1), "dp.0");
  gen0.store().set("0", bytes("zero"));
  gen1.store().set("0", bytes("one"));
  other_group.store().set("0", bytes("dp"));
  EXPECT_EQ(gen0.store().get("0"), bytes("zero"));
  EXPECT_EQ(gen1.store().get("0"), bytes("one"));
  EXPECT_EQ(other_group.store().get("0"), bytes("dp"));
  // A second store on the same prefix (another process, in real use) sees the first one's keys.
  GroupStore gen1_again(options(dir, 1), "world");
  EXPECT_EQ(gen1_again.store().get("0"), bytes("one"));
  // Gloo's FileStore refuses to overwrite: re-using a prefix is detectable.
  EXPECT_THROW(gen1_again.store().set("0", bytes("again")), gloo::EnforceNotMet);
}

TEST(StoreTest, WaitForAMissingKeyTimesOut) {
  tessel::testing::TempDir dir;
  auto o = options(dir, 0);
  o.timeout = 20ms;
  GroupStore store(o, "world");
  EXPECT_THROW(store.store().wait({"never"}), gloo::IoException);
  EXPECT_THROW(store.store().get("never"), gloo::IoException);
  store.store().set("there", bytes("x"));
  EXPECT_NO_THROW(store.store().wait({"there"}));
}

// With an abort signal, a wait (and a get, which waits) ends soon after the signal fires, long
// before its 60 s timeout, naming the keys and the reason; a wait for a key that is there does not
// look at the signal.
TEST(StoreTest, AnAbortSignalEndsAWait) {
  tessel::testing::TempDir dir;
  auto o = options(dir, 0);
  o.timeout = 60s;
  o.abort_signal = std::make_shared<AbortSignal>();
  GroupStore store(o, "world");
  store.store().set("there", bytes("x"));
  std::thread aborter([&] {
    std::this_thread::sleep_for(50ms);
    o.abort_signal->abort("recovery 3");
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    store.store().wait({"never"});
    ADD_FAILURE() << "the wait ended without the key";
  } catch (const gloo::IoException& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rendezvous aborted"), std::string::npos) << what;
    EXPECT_NE(what.find("never"), std::string::npos) << what;
    EXPECT_NE(what.find("recovery 3"), std::string::npos) << what;
  }
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  EXPECT_THROW(store.store().get("never"), gloo::IoException);
  EXPECT_EQ(store.store().get("there"), bytes("x"));
}

}  // namespace
}  // namespace tessel::comm
