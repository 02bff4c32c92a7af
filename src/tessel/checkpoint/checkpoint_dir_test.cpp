// checkpoint.dir as a job finds it: left over by interrupted saves, used by another job, a file,
// read-only, on a disk that fills up, or holding checkpoints of other data.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel::checkpoint {
namespace {

namespace fs = std::filesystem;
using tessel::testing::TempDir;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// What a save killed while staging, and one killed in the middle of its swap, leave behind.
TEST(CheckpointDir, WhatInterruptedSavesLeftIsRemovedAndASwappedOutCheckpointComesBack) {
  TempDir dir;
  const fs::path ck = dir / "ck";
  fs::create_directories(ck / "step-00000004");
  std::ofstream(ck / "step-00000004" / "manifest.json") << "{}";
  fs::create_directories(ck / "step-00000005.tmp-job-5");
  std::ofstream(ck / "step-00000005.tmp-job-5" / "rank-00000.safetensors")
      << std::string(4096, 'x');
  fs::create_directories(ck / "step-00000006.tmp-a");
  fs::create_directories(ck / "step-00000006.tmp-b");
  // A swap interrupted after step-3 was moved aside and before the new one took its name.
  fs::create_directories(ck / "step-00000003.old-job-3");
  std::ofstream(ck / "step-00000003.old-job-3" / "manifest.json") << "{}";

  EXPECT_EQ(remove_interrupted_saves(ck.string()), 3);
  EXPECT_TRUE(fs::exists(ck / "step-00000004" / "manifest.json"));
  EXPECT_TRUE(fs::exists(ck / "step-00000003" / "manifest.json"));
  EXPECT_FALSE(fs::exists(ck / "step-00000005.tmp-job-5"));
  EXPECT_FALSE(fs::exists(ck / "step-00000006.tmp-a"));
  EXPECT_FALSE(fs::exists(ck / "step-00000003.old-job-3"));
  EXPECT_EQ(remove_interrupted_saves(ck.string()), 0);
}

TEST(CheckpointDir, OneJobAtATimeAndNeverAFile) {
  TempDir dir;
  const std::string ck = (dir / "ck").string();
  {
    auto lock = lock_checkpoint_dir(ck);
    EXPECT_TRUE(fs::is_directory(ck));
    try {
      lock_checkpoint_dir(ck);
      ADD_FAILURE() << "a second job locked the same checkpoint.dir";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(contains(e.what(), "in use by another running job")) << e.what();
    }
  }
  auto again = lock_checkpoint_dir(ck);  // released with the first
  std::ofstream(dir / "file") << "x";
  try {
    lock_checkpoint_dir((dir / "file").string());
    ADD_FAILURE() << "a file was taken for checkpoint.dir";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "is a file")) << e.what();
  }
}

// A checkpoint of one token file refuses to resume on another: its cursor means nothing there.
TEST(CheckpointDir, ResumingOnOtherDataIsRefusedAndTheSameDataElsewhereIsNot) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, corpus, "training: {steps: 4, global_batch: 4, micro_batch: 2}\n"));
  const auto meta = checkpoint_meta(cfg, cfg.plan, 2, 8);
  EXPECT_NO_THROW(check_resumable(cfg, meta, "ck/step-2"));

  fs::copy_file(corpus, dir / "moved.tok");
  auto moved = cfg;
  moved.data.path = (dir / "moved.tok").string();
  EXPECT_NO_THROW(check_resumable(moved, meta, "ck/step-2"));

  // Other tokens of the same length: the first MiB differs.
  std::string bytes;
  {
    std::ifstream in(corpus, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() / 2] ^= 1;
  std::ofstream(dir / "other.tok", std::ios::binary) << bytes;
  auto other = cfg;
  other.data.path = (dir / "other.tok").string();
  try {
    check_resumable(other, meta, "ck/step-2");
    ADD_FAILURE() << "resumed on other data";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "trained on other data")) << e.what();
    EXPECT_TRUE(contains(e.what(), "checkpoint.resume: false")) << e.what();
  }
  // A checkpoint from before the fingerprint resumes as it did.
  auto old = meta;
  old.erase("data");
  EXPECT_NO_THROW(check_resumable(other, old, "ck/step-2"));
}

// The newest checkpoint damaged on disk (one flipped byte in a rank file): a restart sets it
// aside and resumes from the one before it, instead of failing on it at every start.
TEST(CheckpointDir, ADamagedNewestCheckpointIsSetAsideAndTheOneBeforeIsResumedFrom) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 6, stop_at: 4, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "checkpoint: {dir: ck, every: 2, keep: 5}\n");
  const std::string train =
      fmt::format("cd {0} && TESSEL_CTL_DIR={0}/ctl OMP_NUM_THREADS=1 {1} train {2}",
                  dir.path().string(), tessel::testing::tessel_binary().string(), cfg);
  std::string out;
  ASSERT_EQ(tessel::testing::run_command(train, &out), 0) << out;
  const fs::path newest = dir / "ck" / checkpoint_step_name(4);
  ASSERT_TRUE(fs::exists(newest / "manifest.json")) << out;
  {
    // A byte in the middle of the rank file: tensor data, which only a full read notices.
    const auto file = newest / "rank-00000.safetensors";
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = fs::file_size(file);
    f.seekg(std::streamoff(size / 2));
    char c = 0;
    f.get(c);
    f.seekp(std::streamoff(size / 2));
    f.put(char(c ^ 0x10));
  }
  // `tessel train` to the end: resumes at step 2, not 4, and finishes.
  config::testing::write_config(
      dir, corpus,
      "training: {steps: 6, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "checkpoint: {dir: ck, every: 2, keep: 5}\n",
      "cfg.yaml");
  ASSERT_EQ(tessel::testing::run_command(train, &out), 0) << out;
  EXPECT_TRUE(contains(out, "is damaged")) << out;
  EXPECT_TRUE(contains(out, "at step 2")) << out;
  EXPECT_TRUE(fs::exists(dir / "ck" / (checkpoint_step_name(4) + ".corrupt")));
  EXPECT_EQ(latest_sharded_checkpoint((dir / "ck").string()),
            (dir / "ck" / checkpoint_step_name(6)).string());
}

// Runs `script` in a private mount namespace (so it may mount a tmpfs or a read-only bind);
// false when this machine cannot make one.
bool in_mount_namespace(const TempDir& dir, const std::string& script, std::string* out, int* rc) {
  std::string probe;
  if (tessel::testing::run_command("unshare -m true 2>&1", &probe) != 0) return false;
  std::ofstream(dir / "ns.sh") << script;
  *rc = tessel::testing::run_command(
      fmt::format("timeout 300 unshare -m bash {} 2>&1", (dir / "ns.sh").string()), out);
  return true;
}

std::string train_script(const TempDir& dir, const std::string& cfg) {
  return fmt::format("cd {} && export TESSEL_CTL_DIR={}/ctl OMP_NUM_THREADS=1\n",
                     dir.path().string(), dir.path().string()) +
         fmt::format("T='{} train {}'\n", tessel::testing::tessel_binary().string(), cfg);
}

TEST(CheckpointDir, AReadOnlyCheckpointDirIsRefusedBeforeTheFirstStep) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 6, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "checkpoint: {dir: ck, every: 2}\n");
  fs::create_directories(dir / "ck");
  std::string out;
  int rc = 0;
  if (!in_mount_namespace(
          dir,
          train_script(dir, cfg) + "mount --bind ck ck && mount -o remount,bind,ro ck && $T 2>&1",
          &out, &rc))
    GTEST_SKIP() << "no mount namespace here (unshare -m fails): cannot make a read-only dir";
  EXPECT_NE(rc, 0) << out;
  EXPECT_TRUE(contains(out, "cannot write into checkpoint.dir")) << out;
  EXPECT_FALSE(contains(out, "step 1/")) << out;  // before training, not at the first save
}

// The checkpoint disk fills up after the first save and is freed two saves later: the saves in
// between fail, each leaving the previous checkpoint and nothing of its own, training goes on, and
// the later saves succeed.
TEST(CheckpointDir, AFullDiskKeepsThePreviousCheckpointAndTheNextIntervalSavesAgain) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 60, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "checkpoint: {dir: ck, every: 5, keep: 1}\n"
      "output: {metrics: metrics.jsonl}\n");
  fs::create_directories(dir / "ck");
  std::string out;
  int rc = 0;
  const std::string script =
      train_script(dir, cfg) +
      "mount -t tmpfs -o size=4m tmpfs ck || exit 90\n"
      "$T > train.out 2>&1 &\n"
      "L=$!\n"
      "for i in $(seq 3000); do [ -e ck/latest ] && break; sleep 0.01; done\n"
      "dd if=/dev/zero of=ck/filler bs=64k 2>/dev/null\n"  // until the disk is full
      "for i in $(seq 3000); do [ $(grep -c 'not saved' train.out) -ge 2 ] && break; "
      "sleep 0.01; done\n"
      "rm ck/filler\n"
      "wait $L\necho train exit $?\n"
      "ls -a ck\ncat ck/latest\n";
  if (!in_mount_namespace(dir, script, &out, &rc))
    GTEST_SKIP() << "no mount namespace here (unshare -m fails): cannot make a small disk";
  std::string log;
  {
    std::ifstream in(dir / "train.out");
    log.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_NE(rc, 90) << "cannot mount a tmpfs: " << out;
  EXPECT_TRUE(contains(out, "train exit 0")) << out << log;
  EXPECT_TRUE(contains(log, "No space left on device")) << log;
  EXPECT_TRUE(contains(log, "the previous checkpoint")) << log;
  EXPECT_TRUE(contains(out, "step-00000060")) << out;  // the last save succeeded
  EXPECT_FALSE(contains(out, ".tmp-")) << out;         // nothing left of the failed ones
}

}  // namespace
}  // namespace tessel::checkpoint
