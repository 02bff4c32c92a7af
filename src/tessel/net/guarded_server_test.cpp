// GuardedServer's guards, each against what it is for: slow clients do not hold up others and
// are cut off, connection caps refuse the extra connections and not others, oversized and
// malformed requests are refused, a token is required where one is given. Bounds on time are
// generous and only detect hangs; what is checked is the order of events.
#include "tessel/net/guarded_server.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/net/http_test_util.h"
#include "tessel/testing/testing.h"

namespace tessel::net {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using tessel::testing::TempDir;
using test::RawClient;
using test::request;
using test::status_of;

std::unique_ptr<GuardedServer> make_server(ServerOptions options) {
  options.name = "the test server";
  if (options.limits.max_body_bytes == 0) options.limits.max_body_bytes = 1024;  // for /echo
  auto server = std::make_unique<GuardedServer>(std::move(options));
  server->Get("/hello", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("hello", "text/plain");
  });
  server->Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
    res.set_content(req.body, "text/plain");
  });
  server->start();
  return server;
}

// Waits (within a bound that only detects a hang) until the server counts `n` connections.
void await_open(const GuardedServer& server, size_t n) {
  const auto deadline = Clock::now() + 20s;
  while (server.open_connections() != n && Clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  ASSERT_EQ(server.open_connections(), n);
}

TEST(GuardedServer, ServesOthersWhileSlowClientsDripAndCutsTheSlowOnesOff) {
  ServerOptions o;
  o.limits.threads = 2;
  o.limits.request_timeout = 2s;
  auto server = make_server(o);
  const int port = server->port();
  // More slow clients than worker threads, from two addresses (each within its per-client cap).
  std::vector<std::unique_ptr<RawClient>> slow;
  std::vector<Clock::time_point> connected;
  for (int i = 0; i < 12; ++i) {
    slow.push_back(std::make_unique<RawClient>(port, i % 2 ? "127.0.0.1" : "127.0.0.3"));
    connected.push_back(Clock::now());
    ASSERT_TRUE(slow.back()->connected());
    ASSERT_TRUE(slow.back()->send("GET /hello HTTP/1.1\r\n"));
  }
  await_open(*server, slow.size());
  // A client from another address is answered while every slow one is still connected.
  const std::string reply = request(port, "GET", "/hello", "", "", "127.0.0.2");
  EXPECT_EQ(status_of(reply), 200) << reply;
  EXPECT_EQ(test::body_of(reply), "hello");
  EXPECT_GE(server->open_connections(), slow.size());
  // The slow ones keep sending a header byte at a time; each is cut off (408) once its request
  // took longer than the bound.
  std::vector<bool> done(slow.size(), false);
  std::vector<std::string> answers(slow.size());
  const auto give_up = Clock::now() + 60s;
  size_t remaining = slow.size();
  while (remaining > 0 && Clock::now() < give_up) {
    for (size_t i = 0; i < slow.size(); ++i) {
      if (done[i]) continue;
      if (slow[i]->closed_now() || !slow[i]->send("x")) {
        answers[i] = slow[i]->read_until_closed(10s);
        EXPECT_GE(Clock::now() - connected[i], o.limits.request_timeout) << i;
        done[i] = true;
        --remaining;
      }
    }
    std::this_thread::sleep_for(100ms);
  }
  for (size_t i = 0; i < slow.size(); ++i) {
    EXPECT_TRUE(done[i]) << "slow client " << i << " was never cut off";
    EXPECT_EQ(status_of(answers[i]), 408) << answers[i];
  }
  await_open(*server, 0);
}

TEST(GuardedServer, RefusesConnectionsOverItsCapsAndServesOthers) {
  ServerOptions o;
  o.limits.max_connections_per_client = 3;
  o.limits.max_connections = 5;
  o.limits.request_timeout = 60s;  // the idle ones are not cut off during the test
  auto server = make_server(o);
  const int port = server->port();
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<RawClient>(port, "127.0.0.1"));
  await_open(*server, 3);
  // A fourth from the same address is refused at once; another address is served.
  std::string reply = request(port, "GET", "/hello", "", "", "127.0.0.1");
  EXPECT_EQ(status_of(reply), 503) << reply;
  EXPECT_NE(reply.find("too many connections"), std::string::npos) << reply;
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "", "", "127.0.0.2")), 200);
  // Five in all: a new address is refused too, until one closes.
  for (int i = 0; i < 2; ++i) idle.push_back(std::make_unique<RawClient>(port, "127.0.0.2"));
  await_open(*server, 5);
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "", "", "127.0.0.4")), 503);
  idle.pop_back();
  await_open(*server, 4);
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "", "", "127.0.0.4")), 200);
}

TEST(GuardedServer, RefusesOversizedAndMalformedRequests) {
  ServerOptions o;
  o.limits.max_head_bytes = 1024;
  o.limits.max_body_bytes = 100;
  auto server = make_server(o);
  const int port = server->port();
  std::string reply = request(port, "GET", "/hello", "X-Big: " + std::string(2000, 'a') + "\r\n");
  EXPECT_EQ(status_of(reply), 431) << reply;
  EXPECT_NO_THROW(nlohmann::json::parse(test::body_of(reply)).at("error"));
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "Content-Length: 5\r\n")), 413);
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "Transfer-Encoding: chunked\r\n")), 413);
  EXPECT_EQ(status_of(request(port, "POST", "/echo", "", std::string(101, 'b'))), 413);
  EXPECT_EQ(status_of(request(port, "POST", "/echo", "Transfer-Encoding: chunked\r\n")), 411);
  EXPECT_EQ(status_of(request(port, "POST", "/echo")), 411);  // no Content-Length
  EXPECT_EQ(status_of(request(port, "GET", "/hello", "Content-Length: 1\r\nContent-Length: 1\r\n")),
            400);
  // A head that never ends is cut off at the size limit, not at the deadline.
  {
    RawClient c(port);
    c.send("GET /hello HTTP/1.1\r\n" + std::string(2000, 'h'));
    EXPECT_EQ(status_of(c.read_until_closed()), 431);
  }
  // The server goes on serving, bodies up to the limit included.
  reply = request(port, "POST", "/echo", "", std::string(100, 'b'));
  EXPECT_EQ(status_of(reply), 200) << reply;
  EXPECT_EQ(test::body_of(reply), std::string(100, 'b'));
}

TEST(GuardedServer, ServesPipelinedRequestsOnAKeptAliveConnection) {
  auto server = make_server({});
  RawClient c(server->port());
  const std::string get = "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n";
  c.send(get + "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" +
         get.substr(0, 10));
  c.send(get.substr(10, get.size() - 12) + "Connection: close\r\n\r\n");
  const std::string replies = c.read_until_closed();
  size_t count = 0;
  for (size_t at = 0; (at = replies.find("HTTP/1.1 200", at)) != std::string::npos; ++at) ++count;
  EXPECT_EQ(count, 3u) << replies;
  EXPECT_NE(replies.find("abc"), std::string::npos) << replies;
}

std::string private_file(const TempDir& dir, const std::string& text) {
  const auto path = (dir / "token").string();
  std::ofstream(path) << text << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

TEST(GuardedServer, BindsLoopbackByDefaultAndElsewhereOnlyWithAToken) {
  ServerOptions o;
  EXPECT_EQ(o.host, "127.0.0.1");
  EXPECT_FALSE(GuardedServer(o).requires_token());
  for (const char* host : {"0.0.0.0", "::", "192.0.2.1", "example.com"}) {
    o.host = host;
    o.token_hint = "--token-file F";
    try {
      GuardedServer server(o);
      FAIL() << host << " without a token";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--token-file F"), std::string::npos) << e.what();
    }
  }
  TempDir dir;
  o.token_file = private_file(dir, "s3cret-s3cret-s3cret");
  o.host = "0.0.0.0";
  auto server = make_server(o);
  EXPECT_TRUE(server->requires_token());
  EXPECT_EQ(status_of(request(server->port(), "GET", "/hello")), 401);
  EXPECT_EQ(status_of(request(server->port(), "GET", "/hello",
                              "Authorization: Bearer s3cret-s3cret-s3cret\r\n")),
            200);
}

TEST(GuardedServer, WithATokenEveryRequestMustCarryIt) {
  TempDir dir;
  ServerOptions o;
  o.token_file = private_file(dir, "s3cret-s3cret-s3cret");
  auto server = make_server(o);
  const int port = server->port();
  for (std::string headers :
       {"", "Authorization: Bearer wrong-wrong-wrong-wr\r\n", "Authorization: Bearer s3cret\r\n",
        "Authorization: Basic s3cret-s3cret-s3cret\r\n",
        "Authorization: Bearer s3cret-s3cret-s3cret-and-more\r\n"}) {
    const std::string reply = request(port, "POST", "/echo", headers, "body");
    EXPECT_EQ(status_of(reply), 401) << headers << reply;
    EXPECT_NE(reply.find("WWW-Authenticate: Bearer"), std::string::npos) << reply;
    EXPECT_NE(nlohmann::json::parse(test::body_of(reply))
                  .at("error")
                  .get<std::string>()
                  .find("Authorization: Bearer"),
              std::string::npos);
  }
  const std::string reply =
      request(port, "POST", "/echo", "authorization: bearer s3cret-s3cret-s3cret\r\n", "body");
  EXPECT_EQ(status_of(reply), 200) << reply;
  EXPECT_EQ(test::body_of(reply), "body");
  // And an httplib client that sets the header is served.
  httplib::Client client("127.0.0.1", port);
  client.set_bearer_token_auth("s3cret-s3cret-s3cret");
  auto res = client.Get("/hello");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST(GuardedServer, StoppingEndsTheConnectionsStillSendingTheirRequest) {
  ServerOptions o;
  o.limits.request_timeout = 60s;
  auto server = make_server(o);
  RawClient c(server->port());
  c.send("GET /hel");
  await_open(*server, 1);
  server->stop();
  EXPECT_EQ(server->open_connections(), 0u);
  c.read_until_closed(20s);
  EXPECT_TRUE(c.closed());
  server->stop();
}

}  // namespace
}  // namespace tessel::net
