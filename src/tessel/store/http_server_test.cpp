#include "tessel/store/http_server.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "tessel/core/error.h"
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
    const auto ckpt = (dir_ / "ckpt").string();
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
