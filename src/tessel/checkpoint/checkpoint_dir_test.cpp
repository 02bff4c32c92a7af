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

// A manifest whose meta misses a field or has one of the wrong type (damaged, or written by a
// conversion, which holds weights only) is a CorruptDataError naming the checkpoint, not a JSON
// library exception that ends the run as an "internal error".
TEST(CheckpointDir, AMetaWithAFieldMissingOrOfTheWrongTypeIsCorruptDataNamingTheCheckpoint) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::TrainConfig::load(config::testing::write_config(
      dir, corpus, "training: {steps: 4, global_batch: 4, micro_batch: 2}\n"));
  const auto meta = checkpoint_meta(cfg, cfg.plan, 2, 8);
  auto missing = meta;
  missing.erase("data_seed");
  auto wrong = meta;
  wrong["data"]["path"] = 7;
  wrong["data"]["fingerprint"] = {{"bytes", 1}};  // differs: the message reads the path
  for (const auto& bad : {missing, wrong}) {
    try {
      check_resumable(cfg, bad, "ck/step-2");
      ADD_FAILURE() << "resumed from " << bad.dump();
    } catch (const CorruptDataError& e) {
      EXPECT_TRUE(contains(e.what(), "ck/step-2")) << e.what();
      EXPECT_TRUE(contains(e.what(), "manifest.json")) << e.what();
    }
  }
}

// `tessel train cfg` in `dir`, as one shell line (its output on stdout).
std::string train_command(const TempDir& dir, const std::string& cfg) {
  return fmt::format("cd {0} && TESSEL_CTL_DIR={0}/ctl OMP_NUM_THREADS=1 {1} train {2} 2>&1",
                     dir.path().string(), tessel::testing::tessel_binary().string(), cfg);
}

// Flips a byte inside a rank file's header JSON: any read of the checkpoint's meta then fails.
void damage_header(const fs::path& rank_file) {
  std::fstream f(rank_file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(20);
  f.put('#');
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
  const std::string train = train_command(dir, cfg);
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

// Every checkpoint damaged: the run refuses to start from scratch (which would throw away what
// the job trained) and says how to choose; `latest`, which named a damaged one, is removed; with
// checkpoint.resume: false it starts afresh. Before, it logged a warning and trained from step 0
// (found by the fault soak, after two damaged checkpoints in a row).
TEST(CheckpointDir, NoIntactCheckpointLeftIsAnErrorNotAFreshStart) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const std::string training =
      "training: {steps: 4, global_batch: 4, micro_batch: 2, threads: 1}\n";
  const auto cfg =
      config::testing::write_config(dir, corpus, training + "checkpoint: {dir: ck, every: 4}\n");
  const std::string train = train_command(dir, cfg);
  std::string out;
  ASSERT_EQ(tessel::testing::run_command(train, &out), 0) << out;
  const fs::path only = dir / "ck" / checkpoint_step_name(4);
  damage_header(only / "rank-00000.safetensors");
  std::string refused;
  EXPECT_NE(tessel::testing::run_command(train, &refused), 0) << refused;
  EXPECT_TRUE(contains(refused, "no intact checkpoint")) << refused;
  EXPECT_TRUE(contains(refused, "checkpoint.resume: false")) << refused;
  EXPECT_FALSE(contains(refused, "training gpt2-tiny")) << refused;  // no step was trained
  EXPECT_TRUE(fs::exists(dir / "ck" / (checkpoint_step_name(4) + ".corrupt")));
  EXPECT_FALSE(fs::exists(dir / "ck" / "latest"));
  // Again: the set-aside checkpoint still shows that the job saved here before.
  std::string again;
  EXPECT_NE(tessel::testing::run_command(train, &again), 0) << again;
  EXPECT_TRUE(contains(again, "no intact checkpoint")) << again;
  config::testing::write_config(
      dir, corpus, training + "checkpoint: {dir: ck, every: 4, resume: false}\n", "cfg.yaml");
  std::string fresh;
  EXPECT_EQ(tessel::testing::run_command(train, &fresh), 0) << fresh;
}

// A checkpoint set aside as damaged is kept until `keep` newer intact ones exist, then removed
// with the others retention removes: set-aside copies must not fill the disk the next saves need
// (the fault soak's 48 MiB disk filled up with them).
TEST(CheckpointDir, SetAsideCheckpointsAreRemovedOnceKeepNewerOnesExist) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 8, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "checkpoint: {dir: ck, every: 2, keep: 2, resume: false}\n");
  for (const char* name : {"step-00000001.corrupt", "step-00000007.corrupt"}) {
    fs::create_directories(dir / "ck" / name);
    std::ofstream(dir / "ck" / name / "rank-00000.safetensors") << "damaged";
  }
  std::string out;
  ASSERT_EQ(tessel::testing::run_command(train_command(dir, cfg), &out), 0) << out;
  // Kept: step-6 and step-8. The set-aside step-1 is older than both; step-7 is not.
  EXPECT_FALSE(fs::exists(dir / "ck" / "step-00000001.corrupt"));
  EXPECT_TRUE(fs::exists(dir / "ck" / "step-00000007.corrupt"));
  EXPECT_TRUE(fs::exists(dir / "ck" / checkpoint_step_name(6)));
  EXPECT_FALSE(fs::exists(dir / "ck" / checkpoint_step_name(4)));
}

std::string train_script(const TempDir& dir, const std::string& cfg) {
  return fmt::format("cd {} && export TESSEL_CTL_DIR={}/ctl OMP_NUM_THREADS=1\n",
                     dir.path().string(), dir.path().string()) +
         fmt::format("T='{} train {}'\n", tessel::testing::tessel_binary().string(), cfg);
}

// SIGTERM to a run that did not resume (checkpoint.resume: false) over a damaged newest checkpoint
// (a header byte flipped: any read of its meta fails): the save at the stop reads what is
// published, and must save rather than end the run on it. Before, the worker died with "corrupt
// data" there and the job lost every step since the previous checkpoint (found by the fault soak:
// a damaged checkpoint, then SIGTERM to the job).
TEST(CheckpointDir, AStopOverADamagedNewestCheckpointStillSaves) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const std::string sections =
      "training: {steps: 2000, global_batch: 4, micro_batch: 1, threads: 1}\n"
      "parallel: {dp: 2, micro_batch: 1}\n"
      "elastic: {stop_grace_s: 10}\n"
      "output: {metrics: metrics.jsonl}\n";
  std::string out;
  // The first run: a checkpoint at step 2, whose header is then damaged.
  config::testing::write_config(
      dir, corpus,
      "training: {steps: 2, global_batch: 4, micro_batch: 1, threads: 1}\n"
      "parallel: {dp: 2, micro_batch: 1}\ncheckpoint: {dir: ck, every: 2}\n",
      "first.yaml");
  ASSERT_EQ(tessel::testing::run_command(train_script(dir, "first.yaml") + "$T 2>&1", &out), 0)
      << out;
  const fs::path damaged = dir / "ck" / checkpoint_step_name(2);
  damage_header(damaged / "rank-00000.safetensors");
  EXPECT_THROW(store::CheckpointReader{damaged.string()}, CorruptDataError);
  config::testing::write_config(
      dir, corpus, sections + "checkpoint: {dir: ck, every: 1000, resume: false}\n", "second.yaml");
  const int rc = tessel::testing::run_command(
      train_script(dir, "second.yaml") +
          "$T > train.out 2>&1 &\nL=$!\n"
          "for i in $(seq 3000); do [ -s metrics.jsonl ] && break; sleep 0.01; done\n"
          "kill -TERM $L\nwait $L\necho train exit $?\ncat ck/latest\n",
      &out);
  std::string log;
  {
    std::ifstream in(dir / "train.out");
    log.assign(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(contains(out, "train exit 143")) << out << log;
  EXPECT_TRUE(contains(log, "cannot be read")) << log;
  // The stop's own checkpoint is published and reads (at step 2 it replaced the damaged one).
  const auto latest = latest_sharded_checkpoint((dir / "ck").string());
  ASSERT_TRUE(latest.has_value()) << log;
  EXPECT_NO_THROW(store::CheckpointReader(*latest).verify()) << log;
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
// the later saves succeed. `sections` sets the layout and the kind of save.
void expect_a_full_disk_keeps_the_previous_checkpoint(const std::string& sections) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const auto cfg = config::testing::write_config(
      dir, corpus,
      "training: {steps: 60, global_batch: 4, micro_batch: 2, threads: 1}\n"
      "output: {metrics: metrics.jsonl}\n" +
          sections);
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

TEST(CheckpointDir, AFullDiskKeepsThePreviousCheckpointAndTheNextIntervalSavesAgain) {
  expect_a_full_disk_keeps_the_previous_checkpoint("checkpoint: {dir: ck, every: 5, keep: 1}\n");
}

// The same with background saves on two workers: a rank whose write fails marks it in the staging
// directory, and rank 0 removes the directory once every rank is done with it (before, the failed
// saves' staging directories stayed until the next start).
TEST(CheckpointDir, AFullDiskDuringBackgroundSavesOnTwoWorkersLeavesNothingBehind) {
  expect_a_full_disk_keeps_the_previous_checkpoint(
      "checkpoint: {dir: ck, every: 5, keep: 1, async: true}\n"
      "parallel: {dp: 2, micro_batch: 1}\n");
}

}  // namespace
}  // namespace tessel::checkpoint
