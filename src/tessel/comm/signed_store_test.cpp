// SignedStore beyond the conformance suite (control_store_conformance_test.cpp runs all of that on
// it): what happens to values written without the secret, by another secret, or moved.
#include "tessel/comm/signed_store.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "tessel/comm/memory_store.h"
#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string hex_of(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

// Two processes of one job and one of another over the same store, and the raw store beneath;
// the member store counts every skip report by key.
struct Stores {
  std::shared_ptr<MemoryStore> raw = std::make_shared<MemoryStore>();
  std::map<std::string, int> skipped;
  std::map<std::string, std::string> refusals;
  SignedStore member{raw, "secret-of-job-j1", "job j1",
                     [this](const std::string& key, const std::string& refusal) {
                       ++skipped[key];
                       refusals[key] = refusal;
                     }};
  SignedStore colleague{raw, "secret-of-job-j1", "job j1"};
  SignedStore foreign{raw, "secret-of-job-j2", "job j2"};
};

// What get() throws for `key`, or "" when it throws nothing (a failure of the test).
std::string refusal_of(SignedStore& store, const std::string& key) {
  try {
    store.get(key);
  } catch (const MembershipError& e) {
    return e.what();
  }
  ADD_FAILURE() << "get('" << key << "') did not throw MembershipError";
  return "";
}

TEST(SignedStore, HmacIsRfc4231) {
  // RFC 4231, test case 2.
  EXPECT_EQ(hex_of(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(SignedStore, ValuesRoundTripAndAreStoredSigned) {
  Stores s;
  const std::string bytes("\0\xff\n{}.tsig1.", 12);
  const int64_t r = s.member.set("/tessel/j1/a", bytes);
  const auto got = s.colleague.get("/tessel/j1/a");
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->value, bytes);
  EXPECT_EQ(got->revision, r);
  // Beneath, the envelope: tag, MAC, value.
  const std::string stored = s.raw->get("/tessel/j1/a")->value;
  EXPECT_TRUE(looks_signed(stored)) << stored;
  EXPECT_EQ(stored.substr(0, 6), "tsig1.");
  EXPECT_EQ(stored.substr(stored.size() - bytes.size()), bytes);
  EXPECT_FALSE(looks_signed(bytes));
  // list and watch unwrap too.
  const int64_t start = s.member.revision();
  s.member.set("/tessel/j1/b", "two");
  const auto listed = s.colleague.list("/tessel/j1/");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].value, bytes);
  EXPECT_EQ(listed[1].value, "two");
  const auto watched = s.colleague.watch("/tessel/j1/", start, 10s);
  ASSERT_EQ(watched.events.size(), 1u);
  EXPECT_EQ(watched.events[0].kv.value, "two");
  EXPECT_FALSE(s.colleague.get("/tessel/j1/none").has_value());
  EXPECT_TRUE(s.skipped.empty());
}

TEST(SignedStore, AValueOfAnotherSecretIsRefusedByGetAndSkippedByListAndWatch) {
  Stores s;
  const int64_t start = s.member.revision();
  s.member.set("/tessel/j1/reports/alive/0", "mine");
  s.foreign.set("/tessel/j1/reports/alive/1", "theirs");
  s.foreign.set("/tessel/j1/reports/alive/2", "theirs too");

  const std::string what = refusal_of(s.member, "/tessel/j1/reports/alive/1");
  EXPECT_TRUE(contains(what, "'/tessel/j1/reports/alive/1'")) << what;
  EXPECT_TRUE(contains(what, "job j1")) << what;
  EXPECT_TRUE(contains(what, "does not match")) << what;
  EXPECT_TRUE(contains(what, "another job's process")) << what;
  EXPECT_TRUE(contains(what, "--token-file")) << what;
  // And the other way round: the other job refuses ours.
  EXPECT_TRUE(contains(refusal_of(s.foreign, "/tessel/j1/reports/alive/0"), "job j2"));

  for (int i = 0; i < 3; ++i) {
    const auto listed = s.member.list("/tessel/j1/reports/alive/");
    ASSERT_EQ(listed.size(), 1u);
    EXPECT_EQ(listed[0].value, "mine");
  }
  const auto watched = s.member.watch("/tessel/j1/", start, 10s);
  ASSERT_EQ(watched.events.size(), 1u);
  EXPECT_EQ(watched.events[0].kv.value, "mine");
  EXPECT_EQ(watched.revision, s.member.revision());  // past the skipped ones

  // Each skipped key reported once, however often it was skipped; get()'s refusals are thrown,
  // not reported.
  EXPECT_EQ(s.skipped.size(), 2u);
  EXPECT_EQ(s.skipped["/tessel/j1/reports/alive/1"], 1);
  EXPECT_EQ(s.skipped["/tessel/j1/reports/alive/2"], 1);
  EXPECT_TRUE(contains(s.refusals["/tessel/j1/reports/alive/2"], "/tessel/j1/reports/alive/2"));
  EXPECT_TRUE(contains(s.refusals["/tessel/j1/reports/alive/2"], "job j1"));
}

TEST(SignedStore, AnUnsignedValueIsRefusedInItsOwnWords) {
  Stores s;
  s.raw->set("/tessel/j1/decisions/generation", "{\"generation\": 7}");
  const std::string what = refusal_of(s.member, "/tessel/j1/decisions/generation");
  EXPECT_TRUE(contains(what, "'/tessel/j1/decisions/generation'")) << what;
  EXPECT_TRUE(contains(what, "without a signature")) << what;
  EXPECT_TRUE(contains(what, "--token-file")) << what;
  EXPECT_TRUE(s.member.list("/tessel/j1/").empty());
  EXPECT_EQ(s.skipped["/tessel/j1/decisions/generation"], 1);
  // Something that only looks like an envelope is no better.
  s.raw->set("/tessel/j1/fake", "tsig1." + std::string(64, 'a') + ".forged");
  EXPECT_TRUE(contains(refusal_of(s.member, "/tessel/j1/fake"), "does not match"));
}

TEST(SignedStore, AValueCopiedToAnotherKeyOrAlteredIsRefused) {
  Stores s;
  s.member.set("/tessel/j1/decisions/records/3", "record three");
  const std::string sealed = s.raw->get("/tessel/j1/decisions/records/3")->value;
  s.raw->set("/tessel/j1/decisions/records/4", sealed);
  EXPECT_EQ(s.member.get("/tessel/j1/decisions/records/3")->value, "record three");
  EXPECT_TRUE(contains(refusal_of(s.member, "/tessel/j1/decisions/records/4"), "copied here"));

  std::string altered = sealed;
  altered.back() = 'E';
  s.raw->set("/tessel/j1/decisions/records/3", altered);
  EXPECT_TRUE(contains(refusal_of(s.member, "/tessel/j1/decisions/records/3"), "does not match"));
  // A NUL in a key would make key + '\0' + value ambiguous: not signed, not accepted.
  const std::string nul_key("/tessel/j1/a\0b", 14);
  EXPECT_THROW(s.member.set(nul_key, "x"), InvalidArgumentError);
}

TEST(SignedStore, CompareAndSetKeepsItsSemantics) {
  Stores s;
  const auto created = s.member.compare_and_set("/tessel/j1/decisions/generation", 0, "1");
  ASSERT_TRUE(created.has_value());
  EXPECT_FALSE(s.colleague.compare_and_set("/tessel/j1/decisions/generation", 0, "x"));
  EXPECT_FALSE(s.colleague.compare_and_set("/tessel/j1/decisions/generation", *created + 5, "x"));
  const auto kv = s.colleague.get("/tessel/j1/decisions/generation");
  ASSERT_TRUE(kv.has_value());
  EXPECT_EQ(kv->value, "1");
  const auto replaced =
      s.colleague.compare_and_set("/tessel/j1/decisions/generation", kv->revision, "2");
  ASSERT_TRUE(replaced.has_value());
  EXPECT_EQ(s.member.get("/tessel/j1/decisions/generation")->value, "2");
  EXPECT_EQ(s.member.get("/tessel/j1/decisions/generation")->revision, *replaced);
}

TEST(SignedStore, CountersPassThroughUnsigned) {
  Stores s;
  EXPECT_EQ(s.member.add("/tessel/clusters/c/next-host", 1), 1);
  EXPECT_EQ(s.colleague.add("/tessel/clusters/c/next-host", 1), 2);
  EXPECT_EQ(s.foreign.add("/tessel/clusters/c/next-host", 1), 3);  // ids only: see the header
  EXPECT_EQ(s.member.add("/tessel/clusters/c/next-host", 0), 3);
  EXPECT_EQ(s.raw->get("/tessel/clusters/c/next-host")->value, "3");
  // Unsigned, so get() refuses it like any unsigned value.
  EXPECT_THROW(s.member.get("/tessel/clusters/c/next-host"), MembershipError);
  // Listed with its neighbours, a counter is left out without a report: it is not foreign.
  s.member.set("/tessel/clusters/c/members", "m");
  const auto listed = s.member.list("/tessel/clusters/c/");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].key, "/tessel/clusters/c/members");
  EXPECT_EQ(s.skipped.count("/tessel/clusters/c/next-host"), 0u);
  // A signed value is no counter.
  s.member.set("/tessel/j1/text", "hello");
  EXPECT_THROW(s.member.add("/tessel/j1/text", 1), CorruptDataError);
}

TEST(SignedStore, AWatchThatSeesOnlyForeignChangesWaitsForAMembersOne) {
  Stores s;
  const int64_t start = s.member.revision();
  s.foreign.set("/tessel/j1/go", "forged");
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    s.colleague.set("/tessel/j1/go", "real");
  });
  const auto r = s.member.watch("/tessel/j1/", start, 10s);
  writer.join();
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].kv.value, "real");
  // Only foreign changes and the time is up: nothing, but the revision moved past them.
  const int64_t before = s.member.revision();
  s.foreign.set("/tessel/j1/go", "forged again");
  const auto none = s.member.watch("/tessel/j1/", before, 50ms);
  EXPECT_TRUE(none.events.empty());
  EXPECT_GT(none.revision, before);
  EXPECT_EQ(s.skipped["/tessel/j1/go"], 1);
}

TEST(SignedStore, EraseEventsLeasesAndWaitsPassThrough) {
  Stores s;
  const LeaseId lease = s.member.grant_lease(10s);
  s.member.set("/tessel/j1/alive/0", "up", lease);
  EXPECT_EQ(s.member.get("/tessel/j1/alive/0")->lease, lease);
  s.member.wait({"/tessel/j1/alive/0"}, 1s);
  s.member.keep_alive(lease);
  const int64_t start = s.member.revision();
  s.member.revoke(lease);
  const auto r = s.member.watch("/tessel/j1/", start, 10s);
  ASSERT_EQ(r.events.size(), 1u);
  EXPECT_EQ(r.events[0].kind, WatchEvent::Kind::erase);
  EXPECT_EQ(r.events[0].kv.key, "/tessel/j1/alive/0");
  s.foreign.set("/tessel/j1/x", "theirs");
  EXPECT_TRUE(s.member.erase("/tessel/j1/x"));
  EXPECT_TRUE(s.skipped.empty());
}

TEST(SignedStore, AnEmptySecretIsAConfigError) {
  try {
    SignedStore store(std::make_shared<MemoryStore>(), "", "job j1");
    FAIL() << "an empty secret was accepted";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "job j1")) << e.what();
  }
}

}  // namespace
}  // namespace tessel::comm
