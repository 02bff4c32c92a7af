#include "tessel/store/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <sys/socket.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "tessel/core/error.h"
#include "tessel/net/http_test_util.h"
#include "tessel/store/npy.h"
#include "tessel/store/test_util.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/testing.h"

namespace tessel::store {
namespace {

using nlohmann::json;
using tessel::testing::TempDir;
using namespace tessel::store::test;

struct Stored {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<char> data;
  std::vector<char> slice(const Box& b) const {
    std::vector<char> out(size_t(b.volume()) * dtype_size(dtype));
    pack_box(data.data(), shape, b, out.data(), dtype_size(dtype));
    return out;
  }
};

class StoreServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = {{"emb", DType::f32, Shape{10, 6}, {}},
                {"w.bf", DType::bf16, Shape{4, 4}, {}},
                {"ids", DType::i64, Shape{5}, {}},
                {"layers/0/w", DType::f32, Shape{3}, {}}};
    uint32_t seed = 1;
    for (auto& t : tensors_)
      t.data = random_bytes(size_t(t.shape.numel()) * dtype_size(t.dtype), seed++);
    // bf16 values that are finite numbers, so the f32 conversion can be compared exactly.
    for (size_t i = 0; i < 16; ++i) {
      auto v = f32_to_bf16(float(i) * 0.25f - 1.0f);
      std::memcpy(tensors_[1].data.data() + 2 * i, &v, 2);
    }
    ckpt_ = (dir_ / "ckpt").string();
    const auto& ckpt = ckpt_;
    CheckpointWriter r0(ckpt, 0, opts("s")), r1(ckpt, 1, opts("s"));
    const auto& emb = tensors_[0];
    top_ = emb.slice(Box({0, 0}, {6, 6}));
    bottom_ = emb.slice(Box({6, 0}, {10, 6}));
    r0.add("emb", DType::f32, emb.shape, Box({0, 0}, {6, 6}), top_.data());
    r1.add("emb", DType::f32, emb.shape, Box({6, 0}, {10, 6}), bottom_.data());
    for (size_t i = 1; i < tensors_.size(); ++i)
      r1.add(tensors_[i].name, tensors_[i].dtype, tensors_[i].shape, Box::of(tensors_[i].shape),
             tensors_[i].data.data());
    r0.write_rank_file();
    r1.write_rank_file();
    r0.commit(2, {{"step", 7}});
    server_ = std::make_unique<StoreServer>(ckpt);
    port_ = server_->start();
    client_ = std::make_unique<httplib::Client>("127.0.0.1", port_);
    client_->set_connection_timeout(2);
    client_->set_read_timeout(5);
  }

  httplib::Result get(const std::string& path) { return client_->Get(path.c_str()); }

  TempDir dir_;
  std::string ckpt_;
  std::vector<Stored> tensors_;
  std::vector<char> top_, bottom_;
  std::unique_ptr<StoreServer> server_;
  int port_ = 0;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(StoreServerTest, ListsTensors) {
  auto res = get("/v1/tensors");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  auto list = json::parse(res->body);
  ASSERT_EQ(list.size(), tensors_.size());
  std::map<std::string, json> by_name;
  for (const auto& e : list) by_name[e["name"]] = e;
  for (const auto& t : tensors_) {
    ASSERT_TRUE(by_name.count(t.name)) << t.name;
    EXPECT_EQ(by_name[t.name]["dtype"], std::string(dtype_name(t.dtype)));
    EXPECT_EQ(by_name[t.name]["shape"], json(t.shape.dims()));
  }
}

TEST_F(StoreServerTest, ServesRawBoxesAcrossPieces) {
  auto res = get("/v1/tensors/emb?box=2:9,1:4");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("X-Tessel-Dtype"), "f32");
  EXPECT_EQ(res->get_header_value("X-Tessel-Shape"), "7,3");
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/octet-stream");
  const auto want = tensors_[0].slice(Box({2, 1}, {9, 4}));
  EXPECT_EQ(res->body, std::string(want.begin(), want.end()));
  // No box: the whole tensor; a name with slashes; a scalar-like single index keeps its dim.
  res = get("/v1/tensors/layers/0/w");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->body, std::string(tensors_[3].data.begin(), tensors_[3].data.end()));
  res = get("/v1/tensors/ids?box=-1");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->get_header_value("X-Tessel-Shape"), "1");
  EXPECT_EQ(res->body, std::string(tensors_[2].data.end() - 8, tensors_[2].data.end()));
}

// Parses a .npy v1.0 body: returns the header dict text and the data.
std::pair<std::string, std::string> parse_npy(const std::string& body) {
  EXPECT_GE(body.size(), 10u);
  EXPECT_EQ(body.substr(0, 6), "\x93NUMPY");
  EXPECT_EQ(body[6], 1);
  EXPECT_EQ(body[7], 0);
  const size_t hlen = uint8_t(body[8]) | (size_t(uint8_t(body[9])) << 8);
  EXPECT_EQ((10 + hlen) % 64, 0u) << "data must be 64-byte aligned";
  const std::string dict = body.substr(10, hlen);
  EXPECT_EQ(dict.back(), '\n');
  return {dict, body.substr(10 + hlen)};
}

TEST_F(StoreServerTest, ServesNpy) {
  auto res = get("/v1/tensors/emb?box=3:5&format=npy");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  auto [dict, data] = parse_npy(res->body);
  EXPECT_NE(dict.find("'descr': '<f4'"), std::string::npos) << dict;
  EXPECT_NE(dict.find("'fortran_order': False"), std::string::npos) << dict;
  EXPECT_NE(dict.find("'shape': (2, 6)"), std::string::npos) << dict;
  const auto want = tensors_[0].slice(Box({3, 0}, {5, 6}));
  EXPECT_EQ(data, std::string(want.begin(), want.end()));
  res = get("/v1/tensors/ids?format=npy");
  ASSERT_TRUE(res);
  EXPECT_NE(
      parse_npy(res->body).first.find("'descr': '<i8', 'fortran_order': False, 'shape': (5,)"),
      std::string::npos);
  // bf16 has no NumPy dtype: 400 with advice; converted to f32 it is served.
  res = get("/v1/tensors/w.bf?format=npy");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("dtype=f32"), std::string::npos) << res->body;
  res = get("/v1/tensors/w.bf?format=npy&dtype=f32&box=1:2,:");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  auto [d2, values] = parse_npy(res->body);
  EXPECT_NE(d2.find("'shape': (1, 4)"), std::string::npos) << d2;
  ASSERT_EQ(values.size(), 16u);
  for (int i = 0; i < 4; ++i) {
    float v;
    std::memcpy(&v, values.data() + 4 * i, 4);
    EXPECT_EQ(v, float(4 + i) * 0.25f - 1.0f);
  }
}

TEST_F(StoreServerTest, UnknownAndPathLikeNamesAre404) {
  for (std::string path :
       {"/v1/tensors/nope", "/v1/tensors/../etc/passwd", "/v1/tensors/..%2F..%2Fetc%2Fpasswd",
        "/v1/tensors/%2Fetc%2Fpasswd", "/v1/tensors/../../index.json",
        "/v1/tensors/rank-00000.safetensors", "/v1/tensors/manifest.json", "/v1/tensors/emb/..",
        "/etc/passwd", "/v1/tensors/emb%00"}) {
    auto res = get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 404) << path << ": " << res->body;
    EXPECT_EQ(res->body.find("root:"), std::string::npos);
  }
}

TEST_F(StoreServerTest, MalformedBoxesAndOptionsAre400) {
  for (std::string query : {"box=0:11", "box=a:b", "box=1,2,3", "box=5:3", "box=0:2,7:9",
                            "format=csv", "dtype=f99", "box=99"}) {
    auto res = get("/v1/tensors/emb?" + query);
    ASSERT_TRUE(res) << query;
    EXPECT_EQ(res->status, 400) << query << ": " << res->body;
    EXPECT_NO_THROW(json::parse(res->body)["error"].get<std::string>()) << res->body;
  }
}

TEST_F(StoreServerTest, OversizedResponsesAre413) {
  server_->set_max_response_bytes(64);
  auto res = get("/v1/tensors/emb");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  res = get("/v1/tensors/emb?box=0:2,:");  // 48 bytes
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(StoreServerTest, AnswersConcurrentClients) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", port_);
      c.set_connection_timeout(2);
      for (int k = 0; k < 10; ++k) {
        auto res = c.Get(
            ("/v1/tensors/emb?box=" + std::to_string(i) + ":" + std::to_string(i + 5)).c_str());
        if (res && res->status == 200 && res->body.size() == 5 * 6 * 4) ++ok;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 40);
}

// Responses are produced a slab at a time: with slabs of 16 bytes (4 f32 elements, 8 bf16 ones)
// every box, format, conversion and byte range comes out as the whole read would.
TEST_F(StoreServerTest, StreamsEveryBoxInSlabsExactly) {
  StoreServerOptions o;
  o.chunk_bytes = 16;
  StoreServer small(ckpt_, o);
  httplib::Client c("127.0.0.1", small.start());
  c.set_read_timeout(10);
  const auto& emb = tensors_[0];
  for (std::string box : {"0:10,0:6", "2:9,1:4", "3:5", "9:10,5:6", "0:10,2:3", "-1"}) {
    auto res = c.Get(("/v1/tensors/emb?box=" + box).c_str());
    ASSERT_TRUE(res) << box;
    ASSERT_EQ(res->status, 200) << box << res->body;
    const auto want = emb.slice(Box::parse(box, emb.shape));
    EXPECT_EQ(res->body, std::string(want.begin(), want.end())) << box;
    // A range of the body: slabs entered in their middle.
    res = c.Get(("/v1/tensors/emb?format=npy&box=" + box).c_str(), {{"Range", "bytes=70-110"}});
    ASSERT_TRUE(res) << box;
    const std::string npy = npy_header(DType::f32, Box::parse(box, emb.shape).shape()) +
                            std::string(want.begin(), want.end());
    if (npy.size() > 110) {
      EXPECT_EQ(res->status, 206) << box;
      EXPECT_EQ(res->body, npy.substr(70, 41)) << box;
    }
  }
  auto res = c.Get("/v1/tensors/w.bf?format=npy&dtype=f32&box=1:3,:");
  ASSERT_TRUE(res);
  auto [dict, values] = parse_npy(res->body);
  ASSERT_EQ(values.size(), 32u);
  for (int i = 0; i < 8; ++i) {
    float v;
    std::memcpy(&v, values.data() + 4 * i, 4);
    EXPECT_EQ(v, float(4 + i) * 0.25f - 1.0f);
  }
  res = c.Get("/v1/tensors/ids?dtype=i32");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->body.size(), 20u);
  for (int i = 0; i < 5; ++i) {
    int64_t want;
    int32_t got;
    std::memcpy(&want, tensors_[2].data.data() + 8 * i, 8);
    std::memcpy(&got, res->body.data() + 4 * i, 4);
    EXPECT_EQ(got, int32_t(want));
  }
}

// A checkpoint of one f32 tensor "big" whose element i is i.
std::string write_big(const TempDir& dir, int64_t rows, int64_t cols, uint64_t chunk_bytes) {
  std::vector<float> x(size_t(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i);
  const auto ckpt = (dir / "big").string();
  CheckpointWriter w(ckpt, 0, opts("b", chunk_bytes));
  w.add("big", Tensor::wrap(x.data(), Shape{rows, cols}));
  w.write_rank_file();
  w.commit(1, {});
  return ckpt;
}

// The server reads a large tensor as the client takes it, not whole before sending: while the
// client has read 64 KiB of 32 MiB, the server has read no more than the socket buffers hold.
TEST(StoreServerStreaming, ReadsALargeTensorAsTheClientTakesIt) {
  TempDir dir;
  StoreServerOptions o;
  o.chunk_bytes = uint64_t(1) << 20;
  StoreServer server(write_big(dir, 2048, 4096, uint64_t(1) << 20), o);
  const int port = server.start();
  net::test::RawClient c(port);
  const int small = 64 << 10;  // no receive-buffer autotuning up to tens of MiB
  ::setsockopt(c.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  c.send("GET /v1/tensors/big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string got;
  char buf[4096];
  while (got.size() < (64u << 10)) {
    const ssize_t n = ::recv(c.fd(), buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let it read ahead if it would
  EXPECT_LT(server.reader().bytes_read(), uint64_t(16) << 20);
  got += c.read_until_closed();
  const std::string body = net::test::body_of(got);
  ASSERT_EQ(body.size(), uint64_t(32) << 20);
  for (size_t i = 0; i < body.size() / 4; i += 4099) {
    float v;
    std::memcpy(&v, body.data() + 4 * i, 4);
    ASSERT_EQ(v, float(i)) << i;
  }
}

// Every byte served was verified: damage in a later slab ends the response before its length
// (the client sees an error, never the damaged bytes as a success); a one-slab response gets 500.
TEST(StoreServerStreaming, DamageEndsAResponseBeforeItsLength) {
  TempDir dir;
  const auto ckpt = write_big(dir, 64, 64, 1024);
  const auto file = std::filesystem::path(ckpt) / rank_file_name(0);
  flip_byte(file, SafetensorsReader::open(file.string()).at("big").offset + 40 * 256 + 8);
  StoreServerOptions o;
  o.chunk_bytes = 4096;  // 4 rows per slab
  StoreServer server(ckpt, o);
  httplib::Client c("127.0.0.1", server.start());
  c.set_read_timeout(10);
  auto res = c.Get("/v1/tensors/big");
  EXPECT_TRUE(!res || res->body.size() < 64 * 64 * 4);
  res = c.Get("/v1/tensors/big?box=40:41");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 500);
  EXPECT_NE(res->body.find("checksum"), std::string::npos) << res->body;
  res = c.Get("/v1/tensors/big?box=0:8");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body.size(), 8u * 64 * 4);
}

// The probe of issue 16: slow clients dripping header bytes, more of them than the server has
// threads, do not keep others from being served, and are cut off once over the request bound.
TEST_F(StoreServerTest, ServesOthersWhileSlowClientsDrip) {
  StoreServerOptions o;
  o.limits.request_timeout = std::chrono::seconds(2);
  StoreServer server(ckpt_, o);
  const int port = server.start();
  std::vector<std::unique_ptr<net::test::RawClient>> slow;
  for (size_t i = 0; i < o.limits.threads + 4; ++i) {
    slow.push_back(std::make_unique<net::test::RawClient>(port, i % 2 ? "127.0.0.1" : "127.0.0.3"));
    ASSERT_TRUE(slow.back()->send("GET /v1/tensors HTTP/1.1\r\n"));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (auto& s : slow) ASSERT_TRUE(s->send("X"));
  // Served while every slow client is still connected (none has been cut off yet).
  const std::string reply = net::test::request(port, "GET", "/v1/tensors", "", "", "127.0.0.2");
  EXPECT_EQ(net::test::status_of(reply), 200) << reply;
  for (auto& s : slow) EXPECT_FALSE(s->closed_now());
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  size_t cut = 0;
  std::vector<bool> done(slow.size(), false);
  while (cut < slow.size() && std::chrono::steady_clock::now() < give_up) {
    for (size_t i = 0; i < slow.size(); ++i) {
      if (done[i] || !(slow[i]->closed_now() || !slow[i]->send("x"))) continue;
      EXPECT_EQ(net::test::status_of(slow[i]->read_until_closed()), 408);
      done[i] = true;
      ++cut;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(cut, slow.size());
}

TEST_F(StoreServerTest, RefusesBodiesAndOversizedHeaders) {
  auto reply = net::test::request(port_, "GET", "/v1/tensors", "Content-Length: 3\r\n");
  EXPECT_EQ(net::test::status_of(reply), 413) << reply;
  reply = net::test::request(port_, "GET", "/v1/tensors", "X: " + std::string(40000, 'a') + "\r\n");
  EXPECT_EQ(net::test::status_of(reply), 431) << reply;
  EXPECT_EQ(net::test::status_of(net::test::request(port_, "POST", "/v1/tensors", "", "abc")), 413);
  EXPECT_EQ(net::test::status_of(net::test::request(port_, "GET", "/v1/tensors")), 200);
}

TEST_F(StoreServerTest, WithATokenFileEveryRequestMustCarryTheToken) {
  EXPECT_FALSE(server_->requires_token());
  const auto token_file = (dir_ / "token").string();
  std::ofstream(token_file) << "0123456789abcdef-token\n";
  ::chmod(token_file.c_str(), 0644);
  StoreServerOptions o;
  o.token_file = token_file;
  EXPECT_THROW(StoreServer(ckpt_, o), ConfigError);  // others can read it
  ::chmod(token_file.c_str(), 0600);
  o.host = "0.0.0.0";
  StoreServer guarded(ckpt_, o);
  EXPECT_TRUE(guarded.requires_token());
  httplib::Client c("127.0.0.1", guarded.start());
  auto res = c.Get("/v1/tensors");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  EXPECT_NO_THROW(json::parse(res->body).at("error").get<std::string>()) << res->body;
  c.set_bearer_token_auth("0123456789abcdef-wrong");
  res = c.Get("/v1/tensors");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  c.set_bearer_token_auth("0123456789abcdef-token");
  res = c.Get("/v1/tensors/emb?box=0:1");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body.size(), 24u);
}

TEST(StoreServer, RefusesANonLoopbackHostWithoutAToken) {
  TempDir dir;
  const auto ckpt = write_big(dir, 2, 2, 1024);
  StoreServerOptions o;
  o.host = "0.0.0.0";
  try {
    StoreServer server(ckpt, o);
    FAIL() << "served 0.0.0.0 without a token";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--token-file"), std::string::npos) << e.what();
  }
}

// The listening socket of `port` as /proc/net/tcp shows it: "0100007F" is 127.0.0.1.
std::string listening_address(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // header
  char want[8];
  std::snprintf(want, sizeof want, ":%04X", port);
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string sl, local, remote, state;
    fields >> sl >> local >> remote >> state;
    if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == want)
      return local.substr(0, local.size() - 5);
  }
  return "";
}

TEST_F(StoreServerTest, BindsLoopbackByDefaultAndStopsCleanly) {
  EXPECT_EQ(server_->host(), "127.0.0.1");
  EXPECT_EQ(listening_address(port_), "0100007F");
  server_->stop();
  server_->stop();
  EXPECT_EQ(listening_address(port_), "");
  EXPECT_FALSE(get("/v1/tensors"));
}

TEST(StoreServer, BindingAPortInUseIsAnIoError) {
  TempDir dir;
  std::vector<float> x(2);
  const auto ckpt = (dir / "c").string();
  CheckpointWriter w(ckpt, 0);
  w.add("x", Tensor::wrap(x.data(), Shape{2}));
  w.write_rank_file();
  w.commit(1, {});
  StoreServer a(ckpt);
  const int port = a.start();
  StoreServer b(ckpt, "127.0.0.1", port);
  EXPECT_THROW(b.start(), IoError);
  EXPECT_THROW(StoreServer((dir / "missing").string()), IoError);
}

TEST(Npy, HeaderMatchesTheFormat) {
  const auto h = npy_header(DType::u16, Shape{});
  EXPECT_EQ(h.size() % 64, 0u);
  EXPECT_NE(h.find("{'descr': '<u2', 'fortran_order': False, 'shape': (), }"), std::string::npos);
  EXPECT_NE(npy_header(DType::f16, Shape{2, 3, 4}).find("'shape': (2, 3, 4)"), std::string::npos);
  EXPECT_THROW(npy_descr(DType::bf16), UnsupportedError);
}

}  // namespace
}  // namespace tessel::store
