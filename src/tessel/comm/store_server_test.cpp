// StoreServer beyond the conformance suite (control_store_conformance_test.cpp runs all of that on
// the embedded store too): its address, its shutdown, watches whose clients went away, and the
// etcd errors EtcdStore relies on.
#include "tessel/comm/store_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/etcd_store.h"
#include "tessel/core/error.h"
#include "tessel/net/http_test_util.h"
#include "tessel/testing/testing.h"

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

std::string private_token(const tessel::testing::TempDir& dir, const std::string& token) {
  const auto path = (dir / "token").string();
  std::ofstream(path) << token << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

TEST(StoreServer, ListensOnLoopbackUnlessGivenATokenFile) {
  StoreServer plain(std::make_shared<MemoryStore>());
  EXPECT_FALSE(plain.requires_token());
  StoreServerOptions o;
  o.host = "0.0.0.0";
  try {
    StoreServer server(std::make_shared<MemoryStore>(), o);
    FAIL() << "listened on 0.0.0.0 without a token";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("token_file"), std::string::npos) << e.what();
  }
  tessel::testing::TempDir dir;
  o.token_file = private_token(dir, "control-token-0123456789");
  StoreServer guarded(std::make_shared<MemoryStore>(), o);
  EXPECT_TRUE(guarded.requires_token());
}

TEST(StoreServer, WithATokenOnlyClientsSendingItAreServed) {
  tessel::testing::TempDir dir;
  StoreServerOptions o;
  o.token_file = private_token(dir, "control-token-0123456789");
  StoreServer server(std::make_shared<MemoryStore>(), o);
  // Without the token, or with another one: 401, an etcd-shaped error EtcdStore names.
  EtcdStore anonymous(server.endpoint(), EtcdStoreOptions{});
  try {
    anonymous.set("job/a", "x");
    FAIL() << "served a client without the token";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("HTTP 401"), std::string::npos) << e.what();
  }
  tessel::testing::TempDir other;
  EtcdStore wrong(server.endpoint(),
                  EtcdStoreOptions{.token_file = private_token(other, "control-token-9876543210")});
  EXPECT_THROW(wrong.get("job/a"), IoError);
  EXPECT_THROW(wrong.watch("job/", 0, 1s), IoError);
  EXPECT_FALSE(server.store().get("job/a").has_value());
  // With it (given, or through the environment) everything works, watches included.
  EtcdStore client(server.endpoint(), EtcdStoreOptions{.token_file = o.token_file});
  const int64_t revision = client.set("job/a", "x");
  EXPECT_EQ(client.get("job/a")->value, "x");
  EXPECT_EQ(client.watch("job/", revision - 1, 5s).events.size(), 1u);
  ::setenv(kControlTokenFileEnv, o.token_file.c_str(), 1);
  EtcdStore from_env(server.endpoint(), 10s);
  ::unsetenv(kControlTokenFileEnv);
  EXPECT_EQ(from_env.get("job/a")->value, "x");
}

TEST(StoreServer, BoundsRequestSizeAndTimeAndServesOthersMeanwhile) {
  StoreServerOptions o;
  o.limits.request_timeout = 2s;
  o.limits.threads = 4;
  o.max_watches = 2;
  StoreServer server(std::make_shared<MemoryStore>(), o);
  const int port = std::stoi(server.endpoint().substr(server.endpoint().rfind(':') + 1));
  std::string reply =
      net::test::request(port, "POST", "/v3/kv/put", "", std::string((size_t(2) << 20) + 1, 'x'));
  EXPECT_EQ(net::test::status_of(reply), 413) << reply.substr(0, 200);
  EXPECT_EQ(nlohmann::json::parse(net::test::body_of(reply)).value("code", 0), 8);
  reply = net::test::request(port, "POST", "/v3/kv/range", "X: " + std::string(20000, 'a') + "\r\n",
                             "{}");
  EXPECT_EQ(net::test::status_of(reply), 431);
  // Slow clients, more than the server has threads: others are served meanwhile, and the slow
  // ones are cut off.
  std::vector<std::unique_ptr<net::test::RawClient>> slow;
  for (int i = 0; i < 8; ++i) {
    slow.push_back(std::make_unique<net::test::RawClient>(port));
    ASSERT_TRUE(slow.back()->send("POST /v3/kv/put HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"));
  }
  EtcdStore client(server.endpoint(), 10s);
  client.set("job/k", "v");
  for (auto& s : slow) EXPECT_FALSE(s->closed_now());
  for (auto& s : slow) {
    EXPECT_EQ(net::test::status_of(s->read_until_closed(30s)), 408);
    EXPECT_TRUE(s->closed());
  }
}

TEST(StoreServer, CapsOpenWatchesAndStillServesTheRest) {
  StoreServerOptions o;
  o.max_watches = 2;
  o.limits.threads = 4;
  StoreServer server(std::make_shared<MemoryStore>(), o);
  const int port = std::stoi(server.endpoint().substr(server.endpoint().rfind(':') + 1));
  const std::string watch = R"({"create_request":{"key":"am9iLw==","range_end":"am9iMA=="}})";
  auto open_watch = [&] {
    auto c = std::make_unique<net::test::RawClient>(port);
    c->send("POST /v3/watch HTTP/1.1\r\nHost: x\r\nContent-Length: " +
            std::to_string(watch.size()) + "\r\n\r\n" + watch);
    return c;
  };
  auto a = open_watch(), b = open_watch();
  // Each is open once its acknowledgement came.
  for (auto* c : {a.get(), b.get()}) {
    std::string got;
    char buf[512];
    while (got.find("created") == std::string::npos) {
      const ssize_t n = ::recv(c->fd(), buf, sizeof buf, 0);
      ASSERT_GT(n, 0);
      got.append(buf, size_t(n));
    }
  }
  EtcdStore client(server.endpoint(), 10s);
  try {
    client.watch("job/", 0, 2s);
    FAIL() << "a third watch was opened";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("too many open watches"), std::string::npos) << e.what();
  }
  client.set("job/x", "1");  // other requests find a thread
  // A watch whose client left frees its place.
  a.reset();
  const auto deadline = Clock::now() + 20s;
  bool opened = false;
  while (!opened && Clock::now() < deadline) {
    try {
      client.watch("job/", client.revision(), 100ms);
      opened = true;
    } catch (const IoError&) {
      std::this_thread::sleep_for(10ms);
    }
  }
  EXPECT_TRUE(opened);
}

}  // namespace
}  // namespace tessel::comm
