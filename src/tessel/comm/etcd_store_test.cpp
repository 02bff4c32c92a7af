// EtcdStore beyond the conformance suite (control_store_conformance_test.cpp runs all of that on
// etcd too): its errors when etcd is not there, and a watch behind etcd's compacted history.
#include "tessel/comm/etcd_store.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tessel/comm/etcd_test_util.h"
#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;

TEST(EtcdStore, AnUnreachableEndpointIsAPeerLostErrorNamingIt) {
  const std::string endpoint = "http://127.0.0.1:" + std::to_string(testing::free_port());
  EtcdStore store(endpoint, 2s);
  try {
    store.get("job/a");
    FAIL() << "reached etcd where none runs";
  } catch (const PeerLostError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(endpoint), std::string::npos) << what;
    EXPECT_NE(what.find("check that etcd runs there"), std::string::npos) << what;
  }
  EXPECT_THROW(EtcdStore("127.0.0.1:2379"), ConfigError);
}

// A wrong endpoint where something else answers (here a web server's error page): the error
// says it is not etcd, in one line.
TEST(EtcdStore, AnEndpointThatIsNotEtcdIsNamedSo) {
  httplib::Server web;
  web.Post(".*", [](const httplib::Request&, httplib::Response& res) {
    res.status = 501;
    res.set_content("<!DOCTYPE HTML>\n<html>\n  <body>\n    <h1>Error response</h1>\n",
                    "text/html");
  });
  const int port = web.bind_to_any_port("127.0.0.1");
  std::thread serving([&] { web.listen_after_bind(); });
  while (!web.is_running()) std::this_thread::sleep_for(1ms);
  EtcdStore store("http://127.0.0.1:" + std::to_string(port), 2s);
  std::string what;
  try {
    store.revision();
  } catch (const Error& e) {
    what = e.what();
  }
  web.stop();
  serving.join();
  EXPECT_NE(what.find("not etcd's v3 gateway"), std::string::npos) << what;
  EXPECT_NE(what.find("<!DOCTYPE HTML> <html> <body> <h1>Error"), std::string::npos) << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
}

class EtcdStoreOnServer : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto binary = testing::find_etcd();
    if (!binary) GTEST_SKIP() << testing::kNoEtcd;
    server = std::make_unique<testing::EtcdServer>(*binary);
    store = std::make_unique<EtcdStore>(server->endpoint(), 10s);
  }
  std::unique_ptr<testing::EtcdServer> server;
  std::unique_ptr<EtcdStore> store;
};

TEST_F(EtcdStoreOnServer, AWatchBehindTheCompactedHistoryIsToldToReList) {
  const int64_t start = store->revision();
  for (int i = 0; i < 5; ++i) store->set("job/k", std::to_string(i));
  httplib::Client client(server->endpoint());
  const auto res =
      client.Post("/v3/kv/compaction",
                  nlohmann::json{{"revision", std::to_string(store->revision() - 1)}}.dump(),
                  "application/json");
  ASSERT_TRUE(res && res->status == 200) << (res ? res->body : httplib::to_string(res.error()));
  EXPECT_THROW(store->watch("job/", start, 2s), CorruptDataError);
  const auto recent = store->watch("job/", store->revision() - 1, 2s);
  ASSERT_EQ(recent.events.size(), 1u);
  EXPECT_EQ(recent.events[0].kv.value, "4");
}

TEST_F(EtcdStoreOnServer, LeasesAreWholeSecondsAndRevokeTwiceIsFine) {
  const LeaseId lease = store->grant_lease(1ms);
  store->set("job/l", "x", lease);
  store->keep_alive(lease);
  EXPECT_EQ(store->get("job/l")->lease, lease);
  store->revoke(lease);
  EXPECT_FALSE(store->get("job/l").has_value());
  store->revoke(lease);
  try {
    store->set("job/l", "y", lease);
    FAIL() << "set a key on a revoked lease";
  } catch (const PeerLostError& e) {
    // etcd's own message, not a transport error.
    EXPECT_NE(std::string(e.what()).find("requested lease not found"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tessel::comm
