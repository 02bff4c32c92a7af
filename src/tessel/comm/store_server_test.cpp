// StoreServer beyond the conformance suite (control_store_conformance_test.cpp runs all of that on
// the embedded store too): its address, its shutdown, watches whose clients went away, and the
// etcd errors EtcdStore relies on.
#include "tessel/comm/store_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tessel/comm/etcd_store.h"
#include "tessel/core/error.h"

namespace tessel::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(StoreServer, ServesItsStoreAtItsEndpoint) {
  StoreServer server(std::make_shared<MemoryStore>());
  EXPECT_EQ(server.endpoint().rfind("http://127.0.0.1:", 0), 0u) << server.endpoint();
  EtcdStore client(server.endpoint(), 10s);
  const int64_t revision = client.set("job/a", "remote");
  EXPECT_EQ(server.store().get("job/a")->value, "remote");
  EXPECT_EQ(server.store().get("job/a")->revision, revision);
  server.store().set("job/b", "local");
  EXPECT_EQ(client.get("job/b")->value, "local");
  EXPECT_EQ(client.revision(), server.store().revision());
}

TEST(StoreServer, AnAddressInUseIsAnIoErrorNamingIt) {
  StoreServer first(std::make_shared<MemoryStore>());
  const std::string endpoint = first.endpoint();
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  try {
    StoreServer second(std::make_shared<MemoryStore>(), "127.0.0.1", port);
    FAIL() << "two servers listen on " << endpoint;
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(StoreServer(std::make_shared<MemoryStore>(), "127.0.0.1", 70000), ConfigError);
}

// Stopping does not wait for the watches' clients: their streams end, and the clients hear it.
TEST(StoreServer, StoppingEndsOpenWatches) {
  auto server = std::make_unique<StoreServer>(std::make_shared<MemoryStore>());
  EtcdStore client(server->endpoint(), 10s);
  const int64_t start = client.revision();
  bool lost = false;
  std::thread watcher([&] {
    try {
      client.watch("job/", start, 30s);
    } catch (const PeerLostError&) {
      lost = true;
    }
  });
  std::this_thread::sleep_for(100ms);
  const auto before = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - before, 2s);
  watcher.join();
  EXPECT_TRUE(lost) << "the watch did not notice the server stop";
}

// A client that takes its first batch and leaves (EtcdStore's watch() does) frees its server
// thread: far more such watches than the server has threads all get served.
TEST(StoreServer, WatchesWhoseClientsLeftEnd) {
  StoreServer server(std::make_shared<MemoryStore>());
  EtcdStore client(server.endpoint(), 10s);
  const int64_t revision = client.set("job/k", "v");
  for (size_t i = 0; i < 3 * StoreServer::kMaxThreads; ++i) {
    const auto r = client.watch("job/", revision - 1, 5s);
    ASSERT_EQ(r.events.size(), 1u) << "watch " << i << " got no event";
  }
}

TEST(StoreServer, AWatchBehindTheKeptHistoryIsToldToReList) {
  StoreServer server(std::make_shared<MemoryStore>(4));
  EtcdStore client(server.endpoint(), 10s);
  const int64_t start = client.revision();
  for (int i = 0; i < 10; ++i) client.set("job/k", std::to_string(i));
  EXPECT_THROW(client.watch("job/", start, 2s), CorruptDataError);
  const auto recent = client.watch("job/", client.revision() - 1, 2s);
  ASSERT_EQ(recent.events.size(), 1u);
  EXPECT_EQ(recent.events[0].kv.value, "9");
}

TEST(StoreServer, LeasesAreWholeSecondsAndADeadOneIsEtcdsNotFound) {
  StoreServer server(std::make_shared<MemoryStore>());
  EtcdStore client(server.endpoint(), 10s);
  const LeaseId lease = client.grant_lease(1ms);
  EXPECT_EQ(server.store().lease_ttl(lease), std::chrono::milliseconds(1000));
  client.set("job/l", "x", lease);
  client.keep_alive(lease);
  client.revoke(lease);
  EXPECT_FALSE(client.get("job/l").has_value());
  client.revoke(lease);
  EXPECT_THROW(client.keep_alive(lease), PeerLostError);
  try {
    client.set("job/l", "y", lease);
    FAIL() << "set a key on a revoked lease";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find("requested lease not found"), std::string::npos)
        << e.what();
  }
}

// What EtcdStore does not send is refused by name, not half-served.
TEST(StoreServer, RefusesWhatItDoesNotImplement) {
  StoreServer server(std::make_shared<MemoryStore>());
  httplib::Client http(server.endpoint());
  auto post = [&](const std::string& path, const std::string& body) {
    auto res = http.Post(path.c_str(), body, "application/json");
    EXPECT_TRUE(res) << path;
    return res ? std::make_pair(res->status, res->body) : std::make_pair(0, std::string());
  };
  auto [status, body] = post("/v3/kv/put", R"({"key":"YQ==","value":"eA==","prev_kv":true})");
  EXPECT_EQ(status, 501);
  EXPECT_NE(body.find("prev_kv"), std::string::npos) << body;
  EXPECT_FALSE(server.store().get("a").has_value());
  std::tie(status, body) = post("/v3/kv/compaction", R"({"revision":"1"})");
  EXPECT_EQ(status, 501);
  EXPECT_NE(body.find("/v3/kv/compaction"), std::string::npos) << body;
  std::tie(status, body) = post("/v3/kv/range", "not json");
  EXPECT_EQ(status, 400);
  EXPECT_EQ(nlohmann::json::parse(body).value("code", 0), 3) << body;
  std::tie(status, body) = post("/v3/kv/range", R"({"key":""})");
  EXPECT_EQ(status, 400);
  EXPECT_NE(body.find("key is not provided"), std::string::npos) << body;
}

}  // namespace
}  // namespace tessel::comm
