#include "tessel/store/checkpoint_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include "tessel/core/error.h"
#include "tessel/store/async_saver.h"
#include "tessel/store/test_util.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/testing.h"

namespace tessel::store {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using tessel::testing::TempDir;
using namespace tessel::store::test;

// Logical tensors with random contents (seeded by `version`) and how 3 ranks split them: row
// blocks, a 3D tensor cut along two dimensions (two pieces of it in one file), a scalar on one
// rank, a 1D bias over two ranks.
struct World : TensorWorld {
  int ranks = 3;

  explicit World(uint32_t version) {
    auto add = [&](std::string n, DType t, Shape s) {
      TensorWorld::add(std::move(n), t, std::move(s), version);
    };
    add("emb", DType::f32, Shape{10, 6});
    add("blk.w", DType::bf16, Shape{8, 9, 10});
    add("step", DType::i64, Shape{});
    add("bias", DType::f32, Shape{7});
    pieces = {{0, "emb", Box({0, 0}, {4, 6})},
              {1, "emb", Box({4, 0}, {7, 6})},
              {2, "emb", Box({7, 0}, {10, 6})},
              {0, "blk.w", Box({0, 0, 0}, {5, 9, 4})},
              {1, "blk.w", Box({0, 0, 4}, {5, 9, 10})},
              {2, "blk.w", Box({5, 0, 0}, {8, 3, 10})},
              {2, "blk.w", Box({5, 3, 0}, {8, 9, 10})},
              {0, "step", Box({}, {})},
              {1, "bias", Box({0}, {3})},
              {2, "bias", Box({3}, {7})}};
  }
};

const json kMeta = {{"model", {{"n_layer", 2}, {"family", "gpt2"}}},
                    {"step", 100},
                    {"rng", {1, 2, 3}},
                    {"lr", 0.001}};

// Saves `w` as ranks 0..2 would (one writer each), rank 0 committing.
void save_world(const World& w, const std::string& dir, CheckpointWriterOptions opt = {},
                const json& meta = kMeta) {
  if (opt.save_id.empty()) opt.save_id = "test-save";
  std::vector<std::vector<char>> buffers;
  buffers.reserve(w.pieces.size());
  std::vector<CheckpointWriter> writers;
  for (int r = 0; r < w.ranks; ++r) writers.emplace_back(dir, r, opt);
  for (const auto& p : w.pieces) {
    const auto& t = w.get(p.tensor);
    buffers.push_back(w.slice(p.tensor, p.box));
    writers[size_t(p.rank)].add(t.name, t.dtype, t.shape, p.box, buffers.back().data());
  }
  for (auto& wr : writers) wr.write_rank_file();
  writers[0].commit(w.ranks, meta);
}

void expect_equals_world(const CheckpointReader& r, const World& w) {
  ASSERT_EQ(r.tensors().size(), w.tensors.size());
  for (const auto& t : w.tensors) {
    const auto& ct = r.at(t.name);
    EXPECT_EQ(ct.dtype, t.dtype);
    EXPECT_EQ(ct.shape, t.shape);
    auto got = r.read(t.name);
    ASSERT_EQ(got.nbytes(), t.data.size());
    EXPECT_EQ(std::memcmp(got.raw(), t.data.data(), t.data.size()), 0) << t.name;
  }
}

using tessel::testing::error_of;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << (msg)

// Bytes a verified read of `box` must touch: every chunk of every piece holding a byte of an
// element of the box, found element by element.
uint64_t expected_bytes(const CheckpointTensor& t, const Box& box) {
  uint64_t total = 0;
  const size_t es = dtype_size(t.dtype);
  for (const auto& p : t.pieces) {
    const Box region = box.intersect(p.box);
    if (region.empty()) continue;
    std::set<uint64_t> chunks;
    const auto strides = p.box.shape().strides();
    std::vector<int64_t> idx(region.lo());
    for (int64_t i = 0; i < region.volume(); ++i) {
      int64_t flat = 0;
      for (size_t d = 0; d < idx.size(); ++d) flat += (idx[d] - p.box.lo(d)) * strides[d];
      chunks.insert(uint64_t(flat) * es / p.chunk_bytes);
      chunks.insert((uint64_t(flat) * es + es - 1) / p.chunk_bytes);
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < region.hi(d)) break;
        idx[d] = region.lo(d);
      }
    }
    for (uint64_t c : chunks) total += std::min(p.chunk_bytes, p.nbytes - c * p.chunk_bytes);
  }
  return total;
}

TEST(CheckpointStore, AnyBoxOfAnyTensorEqualsSlicingTheOriginal) {
  TempDir dir;
  const World w(1);
  const auto ckpt = (dir / "ckpt").string();
  save_world(w, ckpt, opts("", 16));
  CheckpointReader r(ckpt);
  EXPECT_EQ(r.meta(), kMeta);
  EXPECT_EQ(r.files(), (std::vector<std::string>{"rank-00000.safetensors", "rank-00001.safetensors",
                                                 "rank-00002.safetensors"}));
  EXPECT_EQ(r.at("blk.w").pieces.size(), 4u);
  expect_equals_world(r, w);
  std::mt19937 rng(5);
  for (const auto& t : w.tensors) {
    for (int trial = 0; trial < 150; ++trial) {
      const Box box = random_box(t.shape, rng);
      std::vector<char> got(size_t(box.volume()) * t.esize(), 0x55);
      const uint64_t before = r.bytes_read();
      r.read_box(t.name, box, got.data());
      ASSERT_EQ(got, w.slice(t.name, box)) << t.name << " " << box.str();
      ASSERT_EQ(r.bytes_read() - before, expected_bytes(r.at(t.name), box))
          << t.name << " " << box.str();
    }
  }
  // With chunks larger than any piece, a box reads exactly the pieces it touches.
  const uint64_t before = r.bytes_read();
  std::vector<char> buf(1 << 12);
  r.read_box("emb", Box({5, 1}, {6, 2}), buf.data());
  EXPECT_LE(r.bytes_read() - before, 16u);
  const auto report = r.verify();
  EXPECT_EQ(report.files, 3u);
  EXPECT_EQ(report.tensors, 4u);
  EXPECT_EQ(report.pieces, 10u);
  EXPECT_EQ(report.bytes, 10u * 6 * 4 + 8 * 9 * 10 * 2 + 8 + 7 * 4);
}

TEST(CheckpointStore, WholePieceReadsReadEachByteOnce) {
  TempDir dir;
  const World w(2);
  const auto ckpt = (dir / "ckpt").string();
  save_world(w, ckpt, opts("", 64));
  CheckpointReader r(ckpt);
  const auto& t = r.at("blk.w");
  for (const auto& p : t.pieces) {
    const uint64_t before = r.bytes_read();
    std::vector<char> got(p.nbytes);
    r.read_box("blk.w", p.box, got.data());
    EXPECT_EQ(r.bytes_read() - before, p.nbytes);
    EXPECT_EQ(got, w.slice("blk.w", p.box));
  }
}

TEST(CheckpointStore, OneRankCheckpointFileIsAPlainSafetensorsFile) {
  TempDir dir;
  const auto ckpt = (dir / "c").string();
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  CheckpointWriter wr(ckpt, 0);
  wr.add("x", Tensor::wrap(x.data(), Shape{2, 3}));
  wr.write_rank_file();
  wr.commit(1, json::object());
  auto f = SafetensorsReader::open(ckpt + "/rank-00000.safetensors");
  std::vector<float> back(6);
  f.read("x", back.data());
  EXPECT_EQ(back, x);
  EXPECT_TRUE(CheckpointReader(ckpt).meta().empty());
}

// Streamed pieces (produced while the rank file is written, in chunk-sized ranges) make the same
// checkpoint as pieces in memory: the same bytes, the same checksums (the header, written with
// placeholders first, is rewritten in place), readable box by box and verified whole.
TEST(CheckpointStore, StreamedPiecesWriteTheSameCheckpointAsPiecesInMemory) {
  TempDir dir;
  std::vector<float> a(37 * 5);
  std::vector<uint16_t> b(11);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i) * 0.25f - 3.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint16_t(1000 + 7 * i);
  CheckpointWriterOptions opt;
  opt.chunk_bytes = 64;  // many chunks per piece, one partial at the end
  opt.save_id = "same";
  auto write = [&](const std::string& name, bool streamed) {
    CheckpointWriter w((dir / name).string(), 0, opt);
    auto bytes_of = [](const void* base) {
      return [base](uint64_t off, uint64_t n, void* out) {
        std::memcpy(out, static_cast<const char*>(base) + off, n);
      };
    };
    std::vector<uint64_t> asked;
    if (streamed) {
      w.add_streamed("a", DType::f32, Shape{37, 5}, Box::of(Shape{37, 5}),
                     [&, f = bytes_of(a.data())](uint64_t off, uint64_t n, void* out) {
                       EXPECT_LE(n, opt.chunk_bytes);
                       asked.push_back(off);
                       f(off, n, out);
                     });
      w.add_streamed("b", DType::bf16, Shape{11}, Box::of(Shape{11}), bytes_of(b.data()));
    } else {
      w.add("a", DType::f32, Shape{37, 5}, Box::of(Shape{37, 5}), a.data());
      w.add("b", DType::bf16, Shape{11}, Box::of(Shape{11}), b.data());
    }
    w.write_rank_file();
    w.commit(1, json{{"step", 1}});
    if (streamed) {
      EXPECT_EQ(asked.size(), (a.size() * 4 + 63) / 64);
      EXPECT_TRUE(std::is_sorted(asked.begin(), asked.end()));
      EXPECT_THROW(w.snapshot(), InvalidArgumentError);
    }
  };
  write("memory", false);
  write("streamed", true);
  auto read_file = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(read_file(dir / "memory" / "rank-00000.safetensors"),
            read_file(dir / "streamed" / "rank-00000.safetensors"));
  CheckpointReader r((dir / "streamed").string());
  r.verify();
  std::vector<float> rows(3 * 5);
  r.read_box("a", Box({30, 0}, {33, 5}), rows.data());
  EXPECT_EQ(std::memcmp(rows.data(), a.data() + 30 * 5, rows.size() * 4), 0);
}

TEST(CheckpointStore, CommitChecksThePiecesTileEachTensor) {
  TempDir dir;
  const auto ckpt = (dir / "c").string();
  std::vector<float> x(100);
  {
    CheckpointWriter a(ckpt, 0, opts("s")), b(ckpt, 1, opts("s"));
    a.add("x", DType::f32, Shape{10}, Box({0}, {6}), x.data());
    b.add("x", DType::f32, Shape{10}, Box({5}, {10}), x.data());
    a.write_rank_file();
    b.write_rank_file();
    EXPECT_HAS(error_of<InvalidArgumentError>([&] { a.commit(2, {}); }), "overlap");
  }
  {
    CheckpointWriter a(ckpt, 0, opts("t"));
    a.add("x", DType::f32, Shape{10}, Box({0}, {6}), x.data());
    a.write_rank_file();
    EXPECT_HAS(error_of<InvalidArgumentError>([&] { a.commit(1, {}); }), "cover 6 of its 10");
  }
  {
    CheckpointWriter a(ckpt, 0, opts("u")), b(ckpt, 1, opts("u"));
    a.add("x", DType::f32, Shape{10}, Box({0}, {5}), x.data());
    b.add("x", DType::bf16, Shape{10}, Box({5}, {10}), x.data());
    a.write_rank_file();
    b.write_rank_file();
    EXPECT_HAS(error_of<InvalidArgumentError>([&] { a.commit(2, {}); }), "bf16");
  }
  {
    CheckpointWriter a(ckpt, 0, opts("v"));
    a.add("x", DType::f32, Shape{10}, Box({0}, {10}), x.data());
    a.write_rank_file();
    auto msg = error_of<IoError>([&] { a.commit(2, {}); });
    EXPECT_HAS(msg, "rank-00001.safetensors is missing");
  }
  EXPECT_FALSE(fs::exists(ckpt)) << "no failed commit may publish";
  CheckpointWriter a(ckpt, 0);
  EXPECT_THROW(a.add("x", DType::f32, Shape{10}, Box({0}, {11}), x.data()), InvalidArgumentError);
  a.add("x", DType::f32, Shape{10}, Box({0}, {5}), x.data());
  EXPECT_THROW(a.add("x", DType::f32, Shape{10}, Box({0}, {5}), x.data()), InvalidArgumentError);
}

TEST(CheckpointStore, RefusesToReplaceWhatIsNotACheckpoint) {
  TempDir dir;
  fs::create_directories(dir / "mine");
  write_file(dir / "mine" / "notes.txt", "precious");
  EXPECT_HAS(error_of<IoError>([&] { CheckpointWriter((dir / "mine").string(), 0); }),
             "refusing to replace");
  write_file(dir / "file", "x");
  EXPECT_THROW(CheckpointWriter((dir / "file").string(), 0), IoError);
  EXPECT_EQ(read_file(dir / "mine" / "notes.txt"), "precious");
}

// Saving over an existing checkpoint replaces it completely (no stale rank files).
TEST(CheckpointStore, SavingOverACheckpointReplacesIt) {
  TempDir dir;
  const auto ckpt = (dir / "ckpt").string();
  save_world(World(1), ckpt);
  World w2(2);
  w2.ranks = 3;
  save_world(w2, ckpt, opts("second"));
  CheckpointReader r(ckpt);
  expect_equals_world(r, w2);
  EXPECT_EQ(r.manifest()["save_id"], "second");
  std::vector<std::string> siblings;
  for (const auto& e : fs::directory_iterator(dir.path()))
    siblings.push_back(e.path().filename().string());
  EXPECT_EQ(siblings, std::vector<std::string>{"ckpt"});
}

// ---- damage: each a clear error naming the file or tensor

class CheckpointDamage : public ::testing::Test {
 protected:
  void SetUp() override { save_world(world_, ckpt(), opts("", 32)); }
  std::string ckpt() const { return (dir_ / "ckpt").string(); }
  fs::path file(const std::string& n) const { return dir_ / "ckpt" / n; }
  // Absolute offset of the first data byte of `tensor` in rank file `rank`.
  uint64_t data_offset(int rank, const std::string& tensor) const {
    return SafetensorsReader::open(file(rank_file_name(rank)).string()).at(tensor).offset;
  }

  TempDir dir_;
  World world_{3};
};

TEST_F(CheckpointDamage, FlippedDataByteIsCaughtWhenRead) {
  // Byte 40 of rank 1's piece of emb (rows 4..7): in row 5.
  flip_byte(file("rank-00001.safetensors"), data_offset(1, "emb[4:7,0:6]") + 40);
  CheckpointReader r(ckpt());  // headers are intact
  std::vector<char> buf(4096);
  auto msg = error_of<CorruptDataError>([&] {
    r.read_box("emb", Box::of(Shape{10, 6}), buf.data());
  });
  EXPECT_HAS(msg, "'emb'");
  EXPECT_HAS(msg, "rank-00001.safetensors");
  EXPECT_HAS(msg, "checksum");
  // Every read touching the damaged chunk fails, also a one-element read; others succeed.
  EXPECT_THROW(r.read_box("emb", Box({5, 4}, {6, 5}), buf.data()), CorruptDataError);
  r.read_box("emb", Box({0, 0}, {4, 6}), buf.data());
  r.read_box("emb", Box({7, 0}, {10, 6}), buf.data());
  msg = error_of<CorruptDataError>([&] { r.verify(); });
  EXPECT_HAS(msg, "'emb'");
  EXPECT_HAS(msg, "rank-00001.safetensors");
}

TEST_F(CheckpointDamage, FlippedHeaderByteIsCaughtAtOpen) {
  const auto path = file("rank-00002.safetensors");
  // A letter inside the JSON metadata: the header still parses, only the checksum can tell.
  const auto at = read_file(path).find("tessel-rank-file");
  ASSERT_NE(at, std::string::npos);
  flip_byte(path, at + 2);
  auto msg = error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); });
  EXPECT_HAS(msg, "header of rank-00002.safetensors fails its checksum");
}

TEST_F(CheckpointDamage, TruncatedShardIsCaughtAtOpen) {
  truncate_by(file("rank-00002.safetensors"), 1);
  auto msg = error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); });
  EXPECT_HAS(msg, "rank-00002.safetensors has");
  EXPECT_HAS(msg, "truncated");
}

TEST_F(CheckpointDamage, MissingShardNamesFileAndTensor) {
  fs::remove(file("rank-00002.safetensors"));
  auto msg = error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); });
  EXPECT_HAS(msg,
             "is missing rank-00002.safetensors (listed in index.json for tensor 'bias'); "
             "the save was interrupted or the file was deleted");
}

TEST_F(CheckpointDamage, UnknownFormatVersion) {
  auto m = json::parse(read_file(file("manifest.json")));
  m["version"] = 2;
  write_file(file("manifest.json"), m.dump());
  auto msg = error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); });
  EXPECT_HAS(msg, "format version 2");
  EXPECT_HAS(msg, "manifest.json");
  m["version"] = 1;
  m["format"] = "something-else";
  write_file(file("manifest.json"), m.dump());
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); }), "not a tessel");
}

TEST_F(CheckpointDamage, EditedManifestOrIndexFailsItsChecksum) {
  const auto text = read_file(file("manifest.json"));
  auto edited = text;
  edited.replace(edited.find("\"step\": 100"), 11, "\"step\": 900");
  write_file(file("manifest.json"), edited);
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); }),
             "manifest.json fails its checksum");
  write_file(file("manifest.json"), text);
  const auto index = file("index.json");
  flip_byte(index, read_file(index).find("blk.w") + 1);
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); }),
             "index.json does not match");
  fs::remove(index);
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); }), "missing index.json");
  fs::remove(file("manifest.json"));
  EXPECT_HAS(error_of<CorruptDataError>([&] { CheckpointReader r(ckpt()); }), "no manifest.json");
  EXPECT_HAS(error_of<IoError>([&] { CheckpointReader r((dir_ / "nothing").string()); }),
             "does not exist");
}

// ---- crashes during a save leave the previous checkpoint intact

// Saves World(2) over `dir` in a child process that SIGKILLs itself right after `stage`.
void save_and_crash(const std::string& dir, const std::string& stage) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      CheckpointWriterOptions opt;
      opt.save_id = "crashing";
      opt.on_stage = [&](std::string_view s) {
        if (s == stage) ::kill(::getpid(), SIGKILL);
      };
      save_world(World(2), dir, opt);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
}

TEST(CheckpointCrash, CrashAtAnyStageLeavesACompleteCheckpoint) {
  for (std::string stage : {"rank_file", "index", "manifest", "publish"}) {
    SCOPED_TRACE(stage);
    TempDir dir;
    const auto ckpt = (dir / "ckpt").string();
    save_world(World(1), ckpt);
    save_and_crash(ckpt, stage);
    const World& expect = stage == "publish" ? World(2) : World(1);
    expect_equals_world(CheckpointReader(ckpt), expect);
    EXPECT_TRUE(fs::exists(ckpt + ".tmp-crashing"));
    EXPECT_EQ(cleanup_interrupted_saves(ckpt), 1);
    EXPECT_FALSE(fs::exists(ckpt + ".tmp-crashing"));
    CheckpointReader after(ckpt);
    expect_equals_world(after, expect);
    after.verify();
  }
}

TEST(CheckpointCrash, FirstSaveCrashingLeavesNoCheckpoint) {
  TempDir dir;
  const auto ckpt = (dir / "ckpt").string();
  save_and_crash(ckpt, "manifest");
  EXPECT_THROW(CheckpointReader r(ckpt), IoError);
  EXPECT_EQ(cleanup_interrupted_saves(ckpt), 1);
}

// The fallback swap (two renames) can leave DIR.old-<id> and no DIR; cleanup moves it back.
TEST(CheckpointCrash, CleanupRestoresAFallbackSwapInterruptedBetweenRenames) {
  TempDir dir;
  const auto ckpt = (dir / "ckpt").string();
  save_world(World(1), ckpt);
  fs::rename(ckpt, ckpt + ".old-x");
  fs::create_directories(ckpt + ".tmp-x");
  EXPECT_EQ(cleanup_interrupted_saves(ckpt), 1);
  expect_equals_world(CheckpointReader(ckpt), World(1));
}

// ---- asynchronous saves

TEST(AsyncSaver, WritesTheSameBytesAsASynchronousSave) {
  TempDir dir;
  const World w(4);
  const auto sync_dir = (dir / "sync").string(), async_dir = (dir / "async").string();
  // One rank holding everything, same save id so the manifests match too.
  std::vector<std::vector<char>> buffers;
  auto writer_for = [&](const std::string& d) {
    CheckpointWriter wr(d, 0, opts("same", 100));
    buffers.clear();
    for (const auto& t : w.tensors) buffers.push_back(t.data);
    for (size_t i = 0; i < w.tensors.size(); ++i)
      wr.add(w.tensors[i].name, w.tensors[i].dtype, w.tensors[i].shape, Box::of(w.tensors[i].shape),
             buffers[i].data());
    return wr;
  };
  {
    auto wr = writer_for(sync_dir);
    wr.write_rank_file();
    wr.commit(1, kMeta);
  }
  {
    AsyncSaver saver;
    saver.save(writer_for(async_dir), [](CheckpointWriter& wr, std::exception_ptr error) {
      ASSERT_FALSE(error);
      wr.commit(1, kMeta);
    });
    // Training goes on: the buffers change while the save runs.
    for (auto& b : buffers) std::fill(b.begin(), b.end(), char(0x7f));
    saver.wait();
    EXPECT_FALSE(saver.busy());
  }
  for (const auto& name : {"rank-00000.safetensors", "index.json", "manifest.json"})
    EXPECT_EQ(read_file(fs::path(sync_dir) / name), read_file(fs::path(async_dir) / name)) << name;
  expect_equals_world(CheckpointReader(async_dir), w);
}

TEST(AsyncSaver, RethrowsTheBackgroundError) {
  TempDir dir;
  write_file(dir / "file", "x");
  std::vector<float> x(4);
  CheckpointWriter wr((dir / "file" / "ckpt").string(), 0);
  wr.add("x", Tensor::wrap(x.data(), Shape{4}));
  AsyncSaver saver;
  saver.save(std::move(wr));
  EXPECT_THROW(saver.wait(), IoError);
  saver.wait();  // reported once
}

// A rank whose background write fails leaves its failure marker in the staging directory (the
// committing rank stops waiting for its file there), and `then` still runs, with the write's
// error, so that the committing rank can clean up: what it throws is the save's error.
TEST(AsyncSaver, AFailedWriteLeavesItsMarkerAndStillRunsThenWithTheError) {
  TempDir dir;
  const auto ckpt = (dir / "ckpt").string();
  const auto staging = staging_dir_for(ckpt, "s1");
  // A directory where the rank file should go: the rename into place fails.
  fs::create_directories(fs::path(staging) / rank_file_name(3));
  std::vector<float> x(4);
  CheckpointWriter wr(ckpt, 3, opts("s1", 100));
  wr.add("x", Tensor::wrap(x.data(), Shape{4}));
  AsyncSaver saver;
  bool ran = false, marker_seen = false;
  saver.save(std::move(wr), [&](CheckpointWriter& w, std::exception_ptr error) {
    ran = true;
    marker_seen = fs::exists(fs::path(w.staging_dir()) / rank_failed_name(3));
    EXPECT_TRUE(error);
    EXPECT_EQ(cleanup_interrupted_saves(w.dir()), 1);
    throw TimeoutError("what then threw");
  });
  EXPECT_THROW(saver.wait(), TimeoutError);
  EXPECT_TRUE(ran);
  EXPECT_TRUE(marker_seen);
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_EQ(rank_failed_name(3), "rank-00003.failed");
}

}  // namespace
}  // namespace tessel::store
