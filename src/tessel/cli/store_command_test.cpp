// `tessel store ...` run in-process through a CLI::App holding only the store command.
#include "tessel/cli/store_command.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tessel/core/error.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

namespace fs = std::filesystem;
using tessel::testing::TempDir;

// Parses `args` (after "tessel") and runs the chosen action.
int run_store(std::vector<std::string> args) {
  CLI::App app;
  std::function<int()> action;
  add_store_command(app, action);
  args.insert(args.begin(), "tessel");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  app.parse(int(argv.size()), argv.data());
  return action ? action() : -1;
}

struct Captured {
  int status;
  std::string out, err;
};

Captured run_captured(std::vector<std::string> args) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  Captured c;
  try {
    c.status = run_store(std::move(args));
  } catch (...) {
    ::testing::internal::GetCapturedStdout();
    ::testing::internal::GetCapturedStderr();
    throw;
  }
  c.out = ::testing::internal::GetCapturedStdout();
  c.err = ::testing::internal::GetCapturedStderr();
  return c;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

class StoreCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 24; ++i) emb_[size_t(i)] = float(i) * 0.5f;
    store::CheckpointWriter a(ckpt(), 0, opts()), b(ckpt(), 1, opts());
    a.add("emb", DType::f32, Shape{6, 4}, Box({0, 0}, {3, 4}), emb_.data());
    b.add("emb", DType::f32, Shape{6, 4}, Box({3, 0}, {6, 4}), emb_.data() + 12);
    b.add("ids", Tensor::wrap(ids_.data(), Shape{3}, DType::i64));
    a.write_rank_file();
    b.write_rank_file();
    a.commit(2, {{"step", 12}, {"model", {{"n_layer", 1}}}});
  }
  static store::CheckpointWriterOptions opts() {
    store::CheckpointWriterOptions o;
    o.save_id = "cli";
    return o;
  }
  std::string ckpt() const { return (dir_ / "ckpt").string(); }

  TempDir dir_;
  std::array<float, 24> emb_;
  std::array<int64_t, 3> ids_{7, 8, 9};
};

TEST_F(StoreCommand, LsPrintsATable) {
  auto c = run_captured({"store", "ls", ckpt()});
  EXPECT_EQ(c.status, 0);
  EXPECT_NE(c.out.find("NAME"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("emb   f32   [6, 4]"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("2           96"), std::string::npos) << c.out;  // pieces, bytes
  EXPECT_NE(c.out.find("ids   i64   [3]"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("2 tensors"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("model, step"), std::string::npos) << c.out;
}

// An output never destroys what the command reads, nor a file it was not told to replace.
TEST_F(StoreCommand, GetNeverWritesIntoTheCheckpointOrOverAFile) {
  const auto own = (fs::path(ckpt()) / "rank-00000.safetensors").string();
  ASSERT_TRUE(fs::exists(own));
  const auto before = read_file(own);
  for (bool force : {false, true}) {
    std::vector<std::string> args = {"store", "get", ckpt(), "emb", "--out", own};
    if (force) args.push_back("--force");
    const auto what = tessel::testing::error_of<ConfigError>([&] { run_captured(args); });
    EXPECT_NE(what.find("lies inside the checkpoint"), std::string::npos) << what;
  }
  EXPECT_EQ(read_file(own), before);
  EXPECT_EQ(run_captured({"store", "verify", ckpt()}).status, 0);
  const auto mine = (dir_ / "mine.txt").string();
  std::ofstream(mine) << "keep me";
  const auto what = tessel::testing::error_of<ConfigError>([&] {
    run_captured({"store", "get", ckpt(), "emb", "--out", mine});
  });
  EXPECT_NE(what.find("add --force"), std::string::npos) << what;
  EXPECT_EQ(read_file(mine), "keep me");
  EXPECT_EQ(run_captured({"store", "get", ckpt(), "emb", "--out", mine, "--force"}).status, 0);
  EXPECT_EQ(read_file(mine).size(), 24u * 4);
}

TEST_F(StoreCommand, GetWritesRawAndNpyBoxes) {
  const auto out = (dir_ / "box.bin").string();
  auto c = run_captured({"store", "get", ckpt(), "emb", "--box", "2:4,1:3", "--out", out});
  ASSERT_EQ(c.status, 0);
  EXPECT_NE(c.out.find("16 bytes"), std::string::npos) << c.out;
  const auto raw = read_file(out);
  ASSERT_EQ(raw.size(), 16u);
  float v[4];
  std::memcpy(v, raw.data(), 16);
  EXPECT_EQ(v[0], emb_[2 * 4 + 1]);
  EXPECT_EQ(v[1], emb_[2 * 4 + 2]);
  EXPECT_EQ(v[2], emb_[3 * 4 + 1]);
  EXPECT_EQ(v[3], emb_[3 * 4 + 2]);

  const auto npy = (dir_ / "ids.npy").string();
  c = run_captured({"store", "get", ckpt(), "ids", "--format", "npy", "--out", npy});
  ASSERT_EQ(c.status, 0);
  const auto body = read_file(npy);
  ASSERT_GT(body.size(), 10u);
  EXPECT_EQ(body.substr(0, 6), "\x93NUMPY");
  const size_t data_at = 10 + (uint8_t(body[8]) | (size_t(uint8_t(body[9])) << 8));
  EXPECT_EQ(data_at % 64, 0u);
  ASSERT_EQ(body.size(), data_at + 24);
  EXPECT_NE(body.find("'descr': '<i8'"), std::string::npos);
  EXPECT_NE(body.find("'shape': (3,)"), std::string::npos);
  int64_t ids[3];
  std::memcpy(ids, body.data() + data_at, 24);
  EXPECT_EQ(ids[2], 9);

  c = run_captured({"store", "get", ckpt(), "ids", "--dtype", "f32", "--out", out, "--force"});
  ASSERT_EQ(c.status, 0);
  std::memcpy(v, read_file(out).data(), 12);
  EXPECT_EQ(v[0], 7.0f);

  EXPECT_THROW(run_captured({"store", "get", ckpt(), "nope", "--out", out, "--force"}),
               InvalidArgumentError);
  EXPECT_THROW(
      run_captured({"store", "get", ckpt(), "emb", "--box", "0:9", "--out", out, "--force"}),
      InvalidArgumentError);
  EXPECT_THROW(run_captured({"store", "get", ckpt(), "emb", "--format", "csv"}), CLI::ParseError);
}

TEST_F(StoreCommand, VerifyPrintsOkOrTheFirstError) {
  auto c = run_captured({"store", "verify", ckpt()});
  EXPECT_EQ(c.status, 0);
  EXPECT_NE(c.out.find("OK"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("2 tensors, 3 pieces in 2 files"), std::string::npos) << c.out;
  // Damage one data byte of rank 1's file (its last byte belongs to a piece).
  const auto f = fs::path(ckpt()) / "rank-00001.safetensors";
  auto bytes = read_file(f);
  bytes.back() ^= 1;
  std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
  c = run_captured({"store", "verify", ckpt()});
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.out.find("OK"), std::string::npos) << c.out;
  EXPECT_NE(c.err.find("FAILED"), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("rank-00001.safetensors"), std::string::npos) << c.err;
  fs::remove(f);
  c = run_captured({"store", "verify", ckpt()});
  EXPECT_EQ(c.status, 1);
  EXPECT_NE(c.err.find("missing rank-00001.safetensors"), std::string::npos) << c.err;
}

int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(s);
  return ntohs(addr.sin_port);
}

TEST_F(StoreCommand, ServeAnswersUntilSigterm) {
  const int port = free_port();
  std::atomic<int> status{-1};
  std::atomic<bool> done{false};
  std::thread server([&] {
    try {
      status = run_store({"store", "serve", ckpt(), "--port", std::to_string(port)});
    } catch (...) {
      status = -2;
    }
    done = true;
  });
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  int http_status = 0;
  std::string body;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (http_status == 0 && !done && std::chrono::steady_clock::now() < deadline) {
    if (auto res = client.Get("/v1/tensors/ids")) {
      http_status = res->status;
      body = res->body;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  // While `serve` runs its SIGTERM handler is installed (before the server starts), so the
  // signal stops it rather than this process.
  if (!done) ::kill(::getpid(), SIGTERM);
  server.join();
  EXPECT_EQ(http_status, 200);
  EXPECT_EQ(body.size(), 24u);
  EXPECT_EQ(status.load(), 0);
  struct sigaction now {};
  ::sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL) << "the previous handler is restored";
  EXPECT_FALSE(client.Get("/v1/tensors"));
}

TEST_F(StoreCommand, ServeRefusesAnotherHostThanLoopbackWithoutATokenFile) {
  try {
    run_store({"store", "serve", ckpt(), "--host", "0.0.0.0"});
    FAIL() << "served 0.0.0.0 without a token";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--token-file"), std::string::npos) << e.what();
  }
  const std::string token = (dir_ / "token").string();
  std::ofstream(token) << "0123456789abcdef-secret\n";
  ::chmod(token.c_str(), 0644);
  try {
    run_store({"store", "serve", ckpt(), "--host", "0.0.0.0", "--token-file", token});
    FAIL() << "a token file others can read was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("chmod 600"), std::string::npos) << e.what();
  }
}

TEST_F(StoreCommand, ServeWithATokenFileAnswersOnlyTheTokenHolder) {
  const std::string token = (dir_ / "token").string();
  std::ofstream(token) << "0123456789abcdef-secret\n";
  ::chmod(token.c_str(), 0600);
  const int port = free_port();
  std::atomic<int> status{-1};
  std::atomic<bool> done{false};
  std::thread server([&] {
    try {
      status = run_store({"store", "serve", ckpt(), "--host", "0.0.0.0", "--port",
                          std::to_string(port), "--token-file", token, "--request-timeout", "5",
                          "--max-connections", "16", "--max-connections-per-client", "4"});
    } catch (...) {
      status = -2;
    }
    done = true;
  });
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  int without = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (without == 0 && !done && std::chrono::steady_clock::now() < deadline) {
    if (auto res = client.Get("/v1/tensors/ids")) {
      without = res->status;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  client.set_bearer_token_auth("0123456789abcdef-secret");
  auto with = client.Get("/v1/tensors/ids");
  if (!done) ::kill(::getpid(), SIGTERM);
  server.join();
  EXPECT_EQ(without, 401);
  ASSERT_TRUE(with);
  EXPECT_EQ(with->status, 200);
  EXPECT_EQ(with->body.size(), 24u);
  EXPECT_EQ(status.load(), 0);
}

}  // namespace
}  // namespace tessel::cli
