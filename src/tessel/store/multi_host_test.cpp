// Checkpoints kept on several hosts' own disks: commits from entries, partial readers, the
// checkpoint root server, and reading pieces and copying rank files between hosts over HTTP.
#include <gtest/gtest.h>
#include <httplib.h>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "tessel/core/error.h"
#include "tessel/net/http_test_util.h"
#include "tessel/store/checkpoint_root_server.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/checksum.h"
#include "tessel/store/remote_pieces.h"
#include "tessel/store/test_util.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/testing.h"

namespace tessel::store {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using tessel::testing::error_of;
using tessel::testing::TempDir;
using namespace tessel::store::test;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << (msg)

constexpr int kRanks = 4;
const json kMeta = {{"step", 7}, {"model", {{"n_layer", 2}}}, {"lr", 0.25}};

// Tensors with random contents (seeded by `version`) split over 4 ranks: row blocks, a 3D tensor
// cut along different dimensions, a scalar, a bias on two ranks, a matrix in small checksum
// chunks (chunk_bytes 64) spread over three ranks, and a vector wholly on rank 3.
struct World : TensorWorld {
  explicit World(uint32_t version) {
    auto add = [&](std::string n, DType t, Shape s) {
      TensorWorld::add(std::move(n), t, std::move(s), version);
    };
    add("emb", DType::f32, Shape{12, 6});
    add("blk.w", DType::bf16, Shape{8, 9, 10});
    add("step", DType::i64, Shape{});
    add("bias", DType::f32, Shape{10});
    add("big", DType::f32, Shape{64, 64});
    add("layers/0/ids", DType::i32, Shape{5});
    pieces = {{0, "emb", Box({0, 0}, {3, 6})},
              {1, "emb", Box({3, 0}, {6, 6})},
              {2, "emb", Box({6, 0}, {9, 6})},
              {3, "emb", Box({9, 0}, {12, 6})},
              {0, "blk.w", Box({0, 0, 0}, {4, 9, 5})},
              {1, "blk.w", Box({0, 0, 5}, {4, 9, 10})},
              {2, "blk.w", Box({4, 0, 0}, {8, 4, 10})},
              {3, "blk.w", Box({4, 4, 0}, {8, 9, 10})},
              {2, "step", Box({}, {})},
              {1, "bias", Box({0}, {6})},
              {3, "bias", Box({6}, {10})},
              {0, "big", Box({0, 0}, {32, 64})},
              {1, "big", Box({32, 0}, {64, 32})},
              {3, "big", Box({32, 32}, {64, 64})},
              {3, "layers/0/ids", Box({0}, {5})}};
  }
};

// Writes the rank files of `ranks` into dir's staging directory; returns their entries.
std::vector<json> write_ranks(const World& w, const std::string& dir, const std::string& save_id,
                              const std::vector<int>& ranks) {
  std::vector<std::vector<char>> buffers;
  buffers.reserve(w.pieces.size());
  std::vector<json> entries;
  for (int r : ranks) {
    CheckpointWriter wr(dir, r, opts(save_id, 64));
    for (const auto& p : w.pieces) {
      if (p.rank != r) continue;
      const auto& t = w.get(p.tensor);
      buffers.push_back(w.slice(p.tensor, p.box));
      wr.add(t.name, t.dtype, t.shape, p.box, buffers.back().data());
    }
    wr.write_rank_file();
    entries.push_back(wr.rank_file_entry());
  }
  return entries;
}

std::vector<char> read_with(const CheckpointReader& r, const std::string& name, const Box& box,
                            const PieceFetcher& fetch = {}) {
  std::vector<char> out(size_t(box.volume()) * dtype_size(r.at(name).dtype), char(0x5a));
  r.read_box(name, box, out.data(), fetch);
  return out;
}

std::string rank(int r) {
  return rank_file_name(r);
}

// A port nothing listens on: one a server had and gave back.
int dead_port() {
  TempDir dir;
  CheckpointRootServer s(dir.path().string());
  const int port = s.start();
  s.stop();
  return port;
}

std::string url(int port) {
  return "http://127.0.0.1:" + std::to_string(port);
}

// One save of World(1) as a job on two hosts keeps it: host A runs ranks 0 and 1 and keeps a
// copy of rank 2's file, host B runs ranks 2 and 3 and keeps a copy of rank 0's; each host's
// checkpoint root holds the checkpoint as job/step-7. A complete copy, saved by one process as
// on a shared filesystem, is the reference.
class TwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& d : {root_a(), root_b()}) fs::create_directories(d);
    const auto full_entries = write_ranks(world_, full_dir(), "s7", {0, 1, 2, 3});
    CheckpointWriter committer(full_dir(), 0, opts("s7", 64));
    committer.commit(kRanks, kMeta);
    full_ = std::make_unique<CheckpointReader>(full_dir());
    entries_ = write_ranks(world_, dir_a(), "s7", {0, 1});
    for (auto& e : write_ranks(world_, dir_b(), "s7", {2, 3})) entries_.push_back(e);
    EXPECT_EQ(entries_, full_entries) << "the same bytes make the same entries";
  }

  std::string root_a() const { return (tmp_ / "hostA").string(); }
  std::string root_b() const { return (tmp_ / "hostB").string(); }
  std::string dir_a() const { return root_a() + "/job/step-7"; }
  std::string dir_b() const { return root_b() + "/job/step-7"; }
  std::string full_dir() const { return (tmp_ / "full" / "ckpt").string(); }

  void copy_replicas() {
    fs::copy_file(fs::path(staging_dir_for(dir_b(), "s7")) / rank(2),
                  fs::path(staging_dir_for(dir_a(), "s7")) / rank(2));
    fs::copy_file(fs::path(staging_dir_for(dir_a(), "s7")) / rank(0),
                  fs::path(staging_dir_for(dir_b(), "s7")) / rank(0));
  }

  // Each host commits from the entries, in its own order (as they arrive from the control store).
  void commit_both() {
    auto reversed = entries_;
    std::reverse(reversed.begin(), reversed.end());
    commit_checkpoint(dir_a(), "s7", entries_, kMeta, kRanks);
    commit_checkpoint(dir_b(), "s7", reversed, kMeta, kRanks);
  }

  static CheckpointReader partial(const std::string& dir) {
    CheckpointReaderOptions o;
    o.allow_missing_files = true;
    return CheckpointReader(dir, o);
  }

  // Reads every tensor whole and in many random boxes through `r` with `fetch`, comparing with
  // the complete copy bit for bit.
  void expect_reads_like_the_complete_copy(const CheckpointReader& r, const PieceFetcher& fetch,
                                           int boxes_per_tensor) {
    std::mt19937 rng(11);
    for (const auto& t : full_->tensors()) {
      const Box whole = Box::of(t.shape);
      ASSERT_EQ(read_with(r, t.name, whole, fetch), read_with(*full_, t.name, whole)) << t.name;
      ASSERT_EQ(read_with(r, t.name, whole, fetch), world_.slice(t.name, whole)) << t.name;
      for (int i = 0; i < boxes_per_tensor; ++i) {
        const Box box = random_box(t.shape, rng);
        ASSERT_EQ(read_with(r, t.name, box, fetch), read_with(*full_, t.name, box))
            << t.name << " " << box.str();
      }
    }
  }

  TempDir tmp_;
  World world_{1};
  std::vector<json> entries_;
  std::unique_ptr<CheckpointReader> full_;
};

// ---- commit from entries

TEST_F(TwoHosts, EveryHostPublishesTheSameIndexAndManifest) {
  copy_replicas();
  commit_both();
  for (const auto* name : {"index.json", "manifest.json"}) {
    const auto a = read_file(fs::path(dir_a()) / name);
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, read_file(fs::path(dir_b()) / name)) << name;
    // And the same as a commit that read every file itself: one code path.
    EXPECT_EQ(a, read_file(fs::path(full_dir()) / name)) << name;
  }
  auto listing = [](const std::string& dir) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
  };
  EXPECT_EQ(listing(dir_a()),
            (std::set<std::string>{rank(0), rank(1), rank(2), "index.json", "manifest.json"}));
  EXPECT_EQ(listing(dir_b()),
            (std::set<std::string>{rank(0), rank(2), rank(3), "index.json", "manifest.json"}));
  EXPECT_FALSE(fs::exists(staging_dir_for(dir_a(), "s7")));
  EXPECT_EQ(partial(dir_a()).meta(), kMeta);
}

TEST_F(TwoHosts, AnEntryIsWhatTheFileSaysAndSmall) {
  const auto path = fs::path(staging_dir_for(dir_a(), "s7")) / rank(1);
  const json e = read_rank_file_entry(path.string(), "s7");
  EXPECT_EQ(e, entries_[1]);
  EXPECT_EQ(e["file"], rank(1));
  EXPECT_EQ(e["rank"], 1);
  EXPECT_EQ(e["bytes"], fs::file_size(path));
  EXPECT_EQ(e["header_xxh3"], checksum_hex(SafetensorsReader::open(path.string()).header_xxh3()));
  EXPECT_EQ(e["pieces"].size(), 4u);
  // Small enough for a control store value: it travels as text and comes back the same.
  const std::string text = e.dump();
  EXPECT_LT(text.size(), 8000u);
  EXPECT_EQ(json::parse(text), e);
  EXPECT_HAS(error_of<IoError>([&] { read_rank_file_entry(path.string(), "other"); }),
             "belongs to save 's7'");
  CheckpointWriter unwritten(dir_a(), 1, opts("s7"));
  EXPECT_THROW(unwritten.rank_file_entry(), InvalidArgumentError);
}

TEST_F(TwoHosts, CommitChecksTheEntries) {
  auto without = entries_;
  without.pop_back();
  EXPECT_HAS(error_of<InvalidArgumentError>(
                 [&] { commit_checkpoint(dir_a(), "s7", without, kMeta, kRanks); }),
             "no entry for rank 3 (rank-00003.safetensors)");
  auto twice = entries_;
  twice.push_back(entries_[2]);
  EXPECT_HAS(
      error_of<InvalidArgumentError>([&] { commit_checkpoint(dir_a(), "s7", twice, kMeta, 4); }),
      "two entries for rank-00002.safetensors");
  EXPECT_HAS(
      error_of<InvalidArgumentError>([&] { commit_checkpoint(dir_a(), "s7", entries_, kMeta, 3); }),
      "rank 3 but the save has 3 ranks");
  EXPECT_HAS(error_of<IoError>([&] { commit_checkpoint(dir_a(), "s8", entries_, kMeta, kRanks); }),
             "belongs to save 's7', not to this save 's8'");
  // A piece that overlaps another one.
  auto overlapping = entries_;
  overlapping[1]["pieces"][0]["box"] = json::parse("[[2, 5], [0, 6]]");
  EXPECT_HAS(error_of<InvalidArgumentError>(
                 [&] { commit_checkpoint(dir_a(), "s7", overlapping, kMeta, kRanks); }),
             "overlap");
  auto disagreeing = entries_;
  disagreeing[3]["pieces"][0]["shape"] = json::parse("[13, 6]");
  EXPECT_HAS(error_of<InvalidArgumentError>(
                 [&] { commit_checkpoint(dir_a(), "s7", disagreeing, kMeta, kRanks); }),
             "[12, 6] in rank-00000.safetensors but f32 [13, 6] in rank-00003.safetensors");
  auto misnamed = entries_;
  misnamed[0]["file"] = "../../etc/passwd";
  EXPECT_HAS(error_of<InvalidArgumentError>(
                 [&] { commit_checkpoint(dir_a(), "s7", misnamed, kMeta, kRanks); }),
             "'../../etc/passwd'");
  auto malformed = entries_;
  malformed[2].erase("header_xxh3");
  EXPECT_HAS(error_of<CorruptDataError>(
                 [&] { commit_checkpoint(dir_a(), "s7", malformed, kMeta, kRanks); }),
             "header_xxh3");
  EXPECT_FALSE(fs::exists(dir_a())) << "no failed commit may publish";
  commit_checkpoint(dir_a(), "s7", entries_, kMeta, kRanks);
  EXPECT_TRUE(fs::exists(dir_a()));
}

TEST_F(TwoHosts, CommitRefusesAHeldFileThatIsNotTheOneInItsEntry) {
  copy_replicas();
  const auto copy = fs::path(staging_dir_for(dir_a(), "s7")) / rank(2);
  const auto original = read_file(copy);
  // Rank 2's file of the same save with other contents: the same size, another header.
  write_ranks(World(9), (tmp_ / "other" / "ckpt").string(), "s7", {2});
  const auto other =
      read_file(fs::path(staging_dir_for((tmp_ / "other" / "ckpt").string(), "s7")) / rank(2));
  ASSERT_EQ(other.size(), original.size());
  write_file(copy, other);
  auto msg = error_of<CorruptDataError>(
      [&] { commit_checkpoint(dir_a(), "s7", entries_, kMeta, kRanks); });
  EXPECT_HAS(msg, "the header of '" + copy.string() + "' has checksum");
  EXPECT_HAS(msg, "its entry records");
  // A copy cut short.
  write_file(copy, original.substr(0, original.size() - 1));
  msg = error_of<CorruptDataError>(
      [&] { commit_checkpoint(dir_a(), "s7", entries_, kMeta, kRanks); });
  EXPECT_HAS(msg, "rank-00002.safetensors");
  EXPECT_HAS(msg, "truncated");
  EXPECT_FALSE(fs::exists(dir_a()));
  write_file(copy, original);
  commit_checkpoint(dir_a(), "s7", entries_, kMeta, kRanks);
  EXPECT_TRUE(partial(dir_a()).holds(rank(2)));
}

// ---- partial readers

TEST_F(TwoHosts, PartialReadersOpenAndSayWhatTheyHold) {
  copy_replicas();
  commit_both();
  const auto a = partial(dir_a());
  const auto b = partial(dir_b());
  EXPECT_EQ(a.files(), (std::vector<std::string>{rank(0), rank(1), rank(2), rank(3)}));
  EXPECT_EQ(a.missing_files(), std::vector<std::string>{rank(3)});
  EXPECT_EQ(b.missing_files(), std::vector<std::string>{rank(1)});
  EXPECT_TRUE(a.holds(rank(2)));
  EXPECT_FALSE(a.holds(rank(3)));
  // Without the option a missing file is the error it always was.
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(dir_a()); }),
             "is missing rank-00003.safetensors");
  const auto report = a.verify();
  EXPECT_FALSE(report.complete());
  EXPECT_EQ(report.missing_files, std::vector<std::string>{rank(3)});
  EXPECT_EQ(report.files, 3u);
  EXPECT_EQ(report.tensors, 6u);
  EXPECT_EQ(report.pieces_not_held, 5u);
  EXPECT_EQ(report.pieces, 10u);
  EXPECT_TRUE(full_->verify().complete());
}

TEST_F(TwoHosts, AFetcherReadingTheOtherHostGivesTheCompleteCopysBytes) {
  copy_replicas();
  commit_both();
  const auto a = partial(dir_a());
  const auto b = partial(dir_b());
  std::atomic<int> calls{0};
  auto from = [&](const CheckpointReader& self, const CheckpointReader& other) -> PieceFetcher {
    return [&](const CheckpointTensor& t, const CheckpointPiece& p, const Box& region, void* out) {
      ++calls;
      EXPECT_FALSE(self.holds(p.file)) << "fetched a piece this host holds";
      EXPECT_TRUE(p.box.contains(region));
      other.read_box(t.name, region, out);
    };
  };
  expect_reads_like_the_complete_copy(a, from(a, b), 60);
  EXPECT_GT(calls.load(), 0);
  expect_reads_like_the_complete_copy(b, from(b, a), 60);
}

TEST_F(TwoHosts, ABoxSpanningHeldAndMissingPieces) {
  copy_replicas();
  commit_both();
  const auto a = partial(dir_a());
  const Box box({7, 1}, {11, 5});  // rows 7..8 in rank 2 (held), 9..10 in rank 3 (missing)
  std::vector<Box> asked;
  const auto got = read_with(
      a, "emb", box,
      [&](const CheckpointTensor& t, const CheckpointPiece& p, const Box& region, void* out) {
        EXPECT_EQ(p.file, rank(3));
        asked.push_back(region);
        const auto bytes = world_.slice(t.name, region);
        std::memcpy(out, bytes.data(), bytes.size());
      });
  EXPECT_EQ(asked, std::vector<Box>{Box({9, 1}, {11, 5})});
  EXPECT_EQ(got, read_with(*full_, "emb", box));
  // Wholly in a held file: no fetch.
  EXPECT_EQ(read_with(a, "emb", Box({0, 0}, {9, 6})), world_.slice("emb", Box({0, 0}, {9, 6})));
}

TEST_F(TwoHosts, AMissingPieceWithoutAFetcherIsAClearError) {
  copy_replicas();
  commit_both();
  const auto a = partial(dir_a());
  std::vector<char> out(12 * 6 * 4, char(0x5a));
  const auto msg = error_of<CorruptDataError>([&] {
    a.read_box("emb", Box({7, 0}, {11, 6}), out.data());
  });
  EXPECT_HAS(msg, "rank-00003.safetensors");
  EXPECT_HAS(msg, "not on this host");
  EXPECT_HAS(msg, "'emb'");
  EXPECT_EQ(out, std::vector<char>(out.size(), char(0x5a))) << "nothing is read";
  EXPECT_THROW(a.read("layers/0/ids"), CorruptDataError);
}

TEST_F(TwoHosts, AHeldFileThatIsDamagedIsStillAnError) {
  copy_replicas();
  commit_both();
  truncate_by(fs::path(dir_a()) / rank(2), 1);
  const auto msg = error_of<CorruptDataError>([&] { partial(dir_a()); });
  EXPECT_HAS(msg, "rank-00002.safetensors has");
  EXPECT_HAS(msg, "truncated");
  // A damaged piece of a held file fails its read and verify(), as in a complete reader.
  const auto b_file = fs::path(dir_b()) / rank(0);
  flip_byte(b_file, SafetensorsReader::open(b_file.string()).at("emb[0:3,0:6]").offset + 5);
  const auto b = partial(dir_b());
  EXPECT_HAS(error_of<CorruptDataError>([&] {
               read_with(b, "emb", Box({0, 0}, {1, 6}));
             }),
             "fails its checksum");
  EXPECT_HAS(error_of<CorruptDataError>([&] { b.verify(); }), "rank-00000.safetensors");
}

// ---- the checkpoint root server and reads between hosts over HTTP

class TwoServedHosts : public TwoHosts {
 protected:
  void SetUp() override {
    TwoHosts::SetUp();
    copy_replicas();
    commit_both();
    server_a_ = std::make_unique<CheckpointRootServer>(root_a());
    server_b_ = std::make_unique<CheckpointRootServer>(root_b());
    port_a_ = server_a_->start();
    port_b_ = server_b_->start();
  }

  httplib::Result get(int port, const std::string& path) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(10);
    return c.Get(path.c_str());
  }

  std::unique_ptr<CheckpointRootServer> server_a_, server_b_;
  int port_a_ = 0, port_b_ = 0;
};

TEST_F(TwoServedHosts, TheHttpFetcherReproducesTheCompleteRead) {
  const std::string dead = url(dead_port());
  // Every file at both hosts, a dead one first: whoever answers must give the same bytes.
  FileHosts hosts;
  for (int r = 0; r < kRanks; ++r) hosts[rank(r)] = {dead, url(port_a_), url(port_b_)};
  // Host A lacks rank 3, which host B holds; B lacks rank 1, which A holds.
  const auto a = partial(dir_a());
  const auto b = partial(dir_b());
  expect_reads_like_the_complete_copy(a, http_piece_fetcher("job/step-7", hosts), 25);
  expect_reads_like_the_complete_copy(b, http_piece_fetcher("job/step-7", hosts), 25);
  // Where the first live host lacks the file (404), the next one is asked.
  FileHosts lacking = {{rank(3), {url(port_a_), url(port_b_)}}};
  EXPECT_EQ(read_with(a, "emb", Box({8, 0}, {12, 6}), http_piece_fetcher("job/step-7", lacking)),
            world_.slice("emb", Box({8, 0}, {12, 6})));
}

TEST_F(TwoServedHosts, ServesBoxesAsTheSingleCheckpointServerDoes) {
  auto res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=2:5,1:4");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("X-Tessel-Dtype"), "f32");
  EXPECT_EQ(res->get_header_value("X-Tessel-Shape"), "3,3");
  const auto want = world_.slice("emb", Box({2, 1}, {5, 4}));
  EXPECT_EQ(res->body, std::string(want.begin(), want.end()));
  // A tensor name with slashes, the list, npy.
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/layers/0/ids?box=1:3");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404) << "rank 3 is not on host A: " << res->body;
  res = get(port_b_, "/v1/checkpoints/job/step-7/tensors/layers/0/ids?box=1:3");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const auto ids = world_.slice("layers/0/ids", Box({1}, {3}));
  EXPECT_EQ(res->body, std::string(ids.begin(), ids.end()));
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body).size(), 6u);
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/big?box=0:2&format=npy");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/x-npy");
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=0:13");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/nope");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404) << res->body;
  res = get(port_a_, "/v1/checkpoints/job/step-9/tensors/emb");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404) << res->body;
}

TEST_F(TwoServedHosts, ABoxNeedingAFileTheHostLacksIs404NamingIt) {
  auto res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=5:11");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  const auto body = json::parse(res->body);
  EXPECT_EQ(body["missing_files"], json::array({rank(3)}));
  EXPECT_HAS(body["error"].get<std::string>(), "rank-00003.safetensors");
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=0:9");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(TwoServedHosts, NoHostAnsweringIsPeerLostNamingEveryHostTried) {
  const auto a = partial(dir_a());
  const std::string dead1 = url(dead_port()), dead2 = url(dead_port());
  auto fetch = http_piece_fetcher("job/step-7", {{rank(3), {dead1, url(port_a_), dead2}}});
  const auto msg = error_of<PeerLostError>([&] {
    read_with(a, "emb", Box({9, 0}, {10, 6}), fetch);
  });
  EXPECT_HAS(msg, "rank-00003.safetensors");
  EXPECT_HAS(msg, "'emb'");
  EXPECT_HAS(msg, dead1 + ": ");
  EXPECT_HAS(msg, dead2 + ": ");
  EXPECT_HAS(msg, url(port_a_) + ": HTTP 404");
  // No host known for the file at all.
  EXPECT_HAS(error_of<PeerLostError>([&] {
               read_with(a, "emb", Box({9, 0}, {10, 6}), http_piece_fetcher("job/step-7", {}));
             }),
             "no host is known to hold the file");
  EXPECT_THROW(http_piece_fetcher("../job", {}), ConfigError);
  EXPECT_THROW(http_piece_fetcher("job/step-7", {{rank(3), {"127.0.0.1:80"}}}), ConfigError);
}

// A host that takes the connection and never answers: the request ends at its timeout.
TEST_F(TwoServedHosts, ASilentHostTimesOut) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 16), 0);  // the kernel completes handshakes; nobody reads
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string silent = url(ntohs(addr.sin_port));
  RemoteOptions o;
  o.timeout = std::chrono::milliseconds(300);
  const auto a = partial(dir_a());
  const auto start = std::chrono::steady_clock::now();
  auto fetch = http_piece_fetcher("job/step-7", {{rank(3), {silent, url(port_b_)}}}, o);
  EXPECT_EQ(read_with(a, "bias", Box({7}, {9}), fetch), world_.slice("bias", Box({7}, {9})));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  const auto msg = error_of<PeerLostError>([&] {
    read_with(a, "bias", Box({7}, {9}), http_piece_fetcher("job/step-7", {{rank(3), {silent}}}, o));
  });
  EXPECT_HAS(msg, silent);
  ::close(fd);
}

// A tensor store by hand, for answers a real one never gives: it accepts connections one after
// another and answers the first request of each with `reply`, then closes the connection when
// the next request (or the client's close) comes.
class HandMadeHost {
 public:
  explicit HandMadeHost(std::string reply) : reply_(std::move(reply)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        ::listen(listener_, 4) != 0 || ::pipe(stop_) != 0)
      throw std::runtime_error("cannot listen");
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~HandMadeHost() {
    ::close(stop_[1]);
    thread_.join();
    ::close(stop_[0]);
    ::close(listener_);
  }
  std::string url() const { return store::url(port_); }
  int connections() const { return connections_.load(); }

 private:
  // Waits for `fd` to be readable; false once the host stops.
  bool wait(int fd) const {
    pollfd p[2] = {{fd, POLLIN, 0}, {stop_[0], POLLIN, 0}};
    return ::poll(p, 2, 30'000) > 0 && !(p[1].revents & (POLLIN | POLLHUP)) && p[0].revents;
  }
  bool read_request(int fd) const {
    std::string got;
    char c;
    while (got.find("\r\n\r\n") == std::string::npos) {
      if (!wait(fd) || ::recv(fd, &c, 1, 0) != 1) return false;
      got += c;
    }
    return true;
  }
  void run() {
    while (wait(listener_)) {
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      ++connections_;
      if (read_request(fd)) {
        ::send(fd, reply_.data(), reply_.size(), MSG_NOSIGNAL);
        read_request(fd);
      }
      ::close(fd);
    }
  }

  const std::string reply_;
  int listener_ = -1, port_ = 0, stop_[2] = {-1, -1};
  std::atomic<int> connections_{0};
  std::thread thread_;
};

std::string reply_of(const std::string& dtype, const std::string& shape, const std::string& body,
                     size_t content_length) {
  return "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nX-Tessel-Dtype: " + dtype +
         "\r\nX-Tessel-Shape: " + shape + "\r\nContent-Length: " + std::to_string(content_length) +
         "\r\n\r\n" + body;
}

// The fetcher keeps connections. A host may close one just as it is used again (its idle limit
// ran out): that is no failure of the host, which is asked again on a new connection.
TEST_F(TwoServedHosts, AConnectionClosedJustAsItIsReusedIsNoFailure) {
  const auto body = world_.slice("bias", Box({6}, {10}));
  HandMadeHost host(reply_of("f32", "4", std::string(body.begin(), body.end()), 16));
  auto fetch = http_piece_fetcher("job/step-7", {{rank(3), {host.url()}}});
  const auto a = partial(dir_a());
  EXPECT_EQ(read_with(a, "bias", Box({6}, {10}), fetch), body);
  EXPECT_EQ(read_with(a, "bias", Box({6}, {10}), fetch), body);
  EXPECT_EQ(host.connections(), 2);
}

// An answer of another dtype or shape, or of fewer or more bytes than the region has, is the
// host's failure: the next host is asked, and the error names what each one did.
TEST_F(TwoServedHosts, AnAnswerThatIsNotTheRegionIsRefused) {
  const auto a = partial(dir_a());
  const auto body = world_.slice("bias", Box({6}, {10}));
  const std::string bytes(body.begin(), body.end());
  HandMadeHost other_dtype(reply_of("i32", "4", bytes, 16));
  HandMadeHost other_shape(reply_of("f32", "2,2", bytes, 16));
  HandMadeHost short_body(reply_of("f32", "4", bytes.substr(0, 12), 12));
  HandMadeHost long_body(reply_of("f32", "4", bytes + "more", 20));
  const auto msg = error_of<PeerLostError>([&] {
    read_with(a, "bias", Box({6}, {10}),
              http_piece_fetcher("job/step-7", {{rank(3),
                                                 {other_dtype.url(), other_shape.url(),
                                                  short_body.url(), long_body.url()}}}));
  });
  EXPECT_HAS(msg, other_dtype.url() + ": sent i32 [4] where f32 [4] was asked for");
  EXPECT_HAS(msg, other_shape.url() + ": sent f32 [2,2] where f32 [4] was asked for");
  EXPECT_HAS(msg, short_body.url() + ": sent 12 bytes where the region has 16");
  EXPECT_HAS(msg, long_body.url() + ": sent more than the 16 bytes of the region");
  // After all of them, a good host.
  EXPECT_EQ(
      read_with(a, "bias", Box({6}, {10}),
                http_piece_fetcher("job/step-7", {{rank(3), {short_body.url(), url(port_b_)}}})),
      body);
}

TEST_F(TwoServedHosts, PathsOutsideTheRootAreRefused) {
  // A link inside root A to a checkpoint outside it.
  fs::create_directory_symlink(dir_b(), fs::path(root_a()) / "escape");
  for (std::string path : {
           "/v1/checkpoints/../hostB/job/step-7/tensors/emb",
           "/v1/checkpoints/job/../job/step-7/tensors/emb",
           "/v1/checkpoints/./job/step-7/tensors/emb",
           "/v1/checkpoints//etc/tensors/passwd",
           "/v1/checkpoints/%2Fetc/tensors/passwd",
           "/v1/checkpoints/..%2F..%2F..%2Fetc/tensors/passwd",
           "/v1/checkpoints/job%2F..%2F..%2FhostB%2Fjob%2Fstep-7/tensors/emb",
           "/v1/checkpoints/job/step-7%00/tensors/emb",
           "/v1/checkpoints/job/step%207/tensors/emb",
           "/v1/checkpoints/job/step~7/tensors/emb",
           "/v1/checkpoints/job\\step-7/tensors/emb",
           "/v1/checkpoints/escape/tensors/emb",
           "/v1/checkpoints/escape/files/rank-00003.safetensors",
           "/v1/checkpoints/job/step-7/files/index.json",
           "/v1/checkpoints/job/step-7/files/manifest.json",
           "/v1/checkpoints/job/step-7/files/rank-3.safetensors",
           "/v1/checkpoints/job/step-7/files/../manifest.json",
           "/v1/checkpoints/../../../../etc/passwd",
           "/v1/checkpoints/",
       }) {
    const std::string reply = net::test::request(port_a_, "GET", path);
    EXPECT_EQ(net::test::status_of(reply), 400) << path << "\n" << reply;
    EXPECT_EQ(reply.find("root:"), std::string::npos) << path;
    EXPECT_NO_THROW(json::parse(net::test::body_of(reply)).at("error").get<std::string>())
        << path << "\n"
        << reply;
  }
  // Tensor names are only ever looked up in the index.
  EXPECT_EQ(net::test::status_of(net::test::request(
                port_a_, "GET", "/v1/checkpoints/job/step-7/tensors/../../../index.json")),
            404);
}

TEST_F(TwoServedHosts, ServesRankFilesForCopies) {
  auto res = get(port_a_, "/v1/checkpoints/job/step-7/files/" + rank(1));
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->body, read_file(fs::path(dir_a()) / rank(1)));
  res = get(port_a_, "/v1/checkpoints/job/step-7/files/" + rank(3));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(json::parse(res->body)["missing_files"], json::array({rank(3)}));
}

TEST_F(TwoServedHosts, ACachedReaderNoticesWhatChangesUnderIt) {
  const std::string path = "/v1/checkpoints/job/step-7/tensors/emb?box=0:2";
  auto res = get(port_a_, path);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  const auto v1 = world_.slice("emb", Box({0, 0}, {2, 6}));
  EXPECT_EQ(res->body, std::string(v1.begin(), v1.end()));
  res = get(port_a_, path);
  EXPECT_EQ(server_a_->readers_opened(), 1u) << "the reader is kept";
  // A copy of rank 3 arrives: host A now holds the box that needed it.
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=10:12");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  fs::copy_file(fs::path(dir_b()) / rank(3), fs::path(dir_a()) / rank(3));
  res = get(port_a_, "/v1/checkpoints/job/step-7/tensors/emb?box=10:12");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  // A newer save published over the directory (all on host A this time).
  const World w2(2);
  write_ranks(w2, dir_a(), "s8", {0, 1, 2, 3});
  CheckpointWriter(dir_a(), 0, opts("s8", 64)).commit(kRanks, kMeta);
  res = get(port_a_, path);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  const auto v2 = w2.slice("emb", Box({0, 0}, {2, 6}));
  ASSERT_NE(v1, v2);
  EXPECT_EQ(res->body, std::string(v2.begin(), v2.end()));
  EXPECT_EQ(server_a_->readers_opened(), 3u);
}

TEST_F(TwoServedHosts, WithATokenEveryRequestCarriesIt) {
  const auto token_file = (tmp_ / "token").string();
  std::ofstream(token_file) << "0123456789abcdef-token\n";
  ::chmod(token_file.c_str(), 0600);
  CheckpointRootServerOptions o;
  o.server.host = "0.0.0.0";
  EXPECT_THROW(CheckpointRootServer(root_b(), o), ConfigError);
  o.server.token_file = token_file;
  CheckpointRootServer guarded(root_b(), o);
  EXPECT_TRUE(guarded.requires_token());
  const int port = guarded.start();
  const auto a = partial(dir_a());
  EXPECT_HAS(error_of<PeerLostError>([&] {
               read_with(a, "emb", Box({9, 0}, {12, 6}),
                         http_piece_fetcher("job/step-7", {{rank(3), {url(port)}}}));
             }),
             "HTTP 401");
  RemoteOptions ro;
  ro.bearer_token = "0123456789abcdef-token";
  EXPECT_EQ(read_with(a, "emb", Box({9, 0}, {12, 6}),
                      http_piece_fetcher("job/step-7", {{rank(3), {url(port)}}}, ro)),
            world_.slice("emb", Box({9, 0}, {12, 6})));
}

// ---- copies of rank files between hosts

// Host B copies rank 1's file from host A's staging directory before the commit, as a job keeps
// its second copy; the copy is checked against the entry and then commits like any held file.
TEST(RankFileCopies, ADownloadIsVerifiedAndCommits) {
  TempDir tmp;
  const World w(3);
  const auto root_a = tmp / "a", root_b = tmp / "b";
  const auto dir_a = (root_a / "ckpt").string(), dir_b = (root_b / "ckpt").string();
  fs::create_directories(root_a);
  fs::create_directories(root_b);
  auto entries = write_ranks(w, dir_a, "s1", {0, 1});
  for (auto& e : write_ranks(w, dir_b, "s1", {2, 3})) entries.push_back(e);
  CheckpointRootServer server(root_a.string());
  const std::string base = url(server.start());
  const auto staging_b = staging_dir_for(dir_b, "s1");
  const std::string rel = fs::path(staging_dir_for(dir_a, "s1")).filename().string();
  EXPECT_EQ(rel, "ckpt.tmp-s1");
  const auto path = download_rank_file(base, rel, entries[1], staging_b);
  EXPECT_EQ(path, (fs::path(staging_b) / rank(1)).string());
  EXPECT_EQ(read_file(path), read_file(fs::path(staging_dir_for(dir_a, "s1")) / rank(1)));
  commit_checkpoint(dir_b, "s1", entries, kMeta, kRanks);
  CheckpointReaderOptions o;
  o.allow_missing_files = true;
  CheckpointReader b(dir_b, o);
  EXPECT_EQ(b.missing_files(), std::vector<std::string>{rank(0)});
  EXPECT_EQ(b.read("bias").nbytes(), 40u);
  EXPECT_EQ(b.verify().pieces, 12u);
}

class DamagedCopies : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(tmp_ / "a");
    fs::create_directories(dest_);
    entry_ = write_ranks(world_, dir_a_, "s1", {0})[0];
    source_ = fs::path(staging_dir_for(dir_a_, "s1")) / rank(0);
    server_ = std::make_unique<CheckpointRootServer>((tmp_ / "a").string());
    port_ = server_->start();
  }
  std::string fetch() { return download_rank_file(url(port_), "ckpt.tmp-s1", entry_, dest_); }
  std::vector<std::string> left_in_dest() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dest_)) names.push_back(e.path().string());
    return names;
  }

  TempDir tmp_;
  World world_{4};
  std::string dir_a_ = (tmp_ / "a" / "ckpt").string();
  std::string dest_ = (tmp_ / "dest").string();
  json entry_;
  fs::path source_;
  std::unique_ptr<CheckpointRootServer> server_;
  int port_ = 0;
};

TEST_F(DamagedCopies, AFlippedPieceByteIsRefusedAndNothingIsKept) {
  // A byte in the middle of the second half of "big": past many chunks already written.
  flip_byte(source_, SafetensorsReader::open(source_.string()).at("big[0:32,0:64]").offset + 6000);
  const auto msg = error_of<CorruptDataError>([&] { fetch(); });
  EXPECT_HAS(msg, "rank-00000.safetensors");
  EXPECT_HAS(msg, "'big[0:32,0:64]' fails the checksum");
  EXPECT_EQ(left_in_dest(), std::vector<std::string>{});
}

TEST_F(DamagedCopies, AFlippedHeaderByteIsRefused) {
  flip_byte(source_, read_file(source_).find("tessel-rank-file") + 1);
  EXPECT_HAS(error_of<CorruptDataError>([&] { fetch(); }), "header fails the checksum");
  EXPECT_EQ(left_in_dest(), std::vector<std::string>{});
}

TEST_F(DamagedCopies, ATruncatedOrLongerSourceIsRefused) {
  const auto original = read_file(source_);
  truncate_by(source_, 3);
  EXPECT_THROW(fetch(), CorruptDataError);
  write_file(source_, original + "extra");
  EXPECT_HAS(error_of<CorruptDataError>([&] { fetch(); }), "more than");
  EXPECT_EQ(left_in_dest(), std::vector<std::string>{});
  write_file(source_, original);
  fetch();
  EXPECT_EQ(left_in_dest().size(), 1u);
}

TEST_F(DamagedCopies, UnreachableOrRefusingHostsAndBadEntries) {
  EXPECT_HAS(error_of<PeerLostError>(
                 [&] { download_rank_file(url(dead_port()), "ckpt.tmp-s1", entry_, dest_); }),
             "cannot copy rank-00000.safetensors");
  auto other = entry_;
  other["file"] = rank(5);
  other["rank"] = 5;
  EXPECT_HAS(
      error_of<IoError>([&] { download_rank_file(url(port_), "ckpt.tmp-s1", other, dest_); }),
      "HTTP 404");
  auto escaping = entry_;
  escaping["file"] = "../rank-00000.safetensors";
  EXPECT_THROW(download_rank_file(url(port_), "ckpt.tmp-s1", escaping, dest_),
               InvalidArgumentError);
  EXPECT_THROW(download_rank_file(url(port_), "../a", entry_, dest_), ConfigError);
  EXPECT_EQ(left_in_dest(), std::vector<std::string>{});
}

}  // namespace
}  // namespace tessel::store
