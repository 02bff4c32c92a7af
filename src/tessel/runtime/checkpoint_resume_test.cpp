// Checkpoints across layouts: a run saved under one plan resumes under another (more or fewer
// workers, other dp/tp/pp, ZeRO on or off, or one process), and continues as one process would:
// every step equals one single-process step from the state saved before it
// (step_check_test_util.h).
#include "tessel/checkpoint/sharded_checkpoint.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/model/model_spec.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {

using checkpoint::checkpoint_step_name;
using checkpoint::latest_sharded_checkpoint;
using config::TrainConfig;
namespace {

using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

// 8 steps in all (the learning-rate schedule spans them); this run ends after `stop_at`, and
// saves every step (all kept, for the step-by-step check).
std::string training(int stop_at, bool async = false) {
  return fmt::format(
      "training: {{steps: 8, stop_at: {}, global_batch: 12, micro_batch: 2, threads: 1}}\n"
      "optimizer: {{lr: 0.01, warmup_steps: 1}}\n"
      "output: {{metrics: metrics.jsonl}}\n"
      "checkpoint: {{dir: ck, every: 1, keep: 9, async: {}}}\n",
      stop_at, async);
}

void run_workers(const std::string& cfg, int nproc) {
  std::string out;
  ASSERT_EQ(testing::run_train(cfg, nproc, &out), 0) << out;
  EXPECT_NE(out.find("saved checkpoint"), std::string::npos) << out;
}

TEST(ShardedCheckpoint, SavedUnderOneLayoutResumesUnderAnother) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    auto corpus = make_corpus(dir);
    // Steps 1-3 on 4 workers (dp 2 x pp 2, ZeRO-1), 4-5 on 4 workers (tp 2 x pp 2), 6-8 in one
    // process: each run resumes from the checkpoint the previous one saved at its end (run a
    // saves in the background).
    run_workers(write_config(
                    dir, corpus,
                    training(3, true) + "parallel: {dp: 2, pp: 2, zero_stage: 1, micro_batch: 3}\n",
                    "a.yaml", preset),
                4);
    run_workers(
        write_config(dir, corpus, training(5) + "parallel: {tp: 2, pp: 2}\n", "b.yaml", preset), 4);
    auto c = TrainConfig::load(write_config(dir, corpus, training(8), "c.yaml", preset));
    ReferenceTrainer(c).run();

    const auto losses = testing::read_step_losses(dir / "metrics.jsonl");
    ASSERT_EQ(losses.size(), 8u);
    testing::expect_steps_match_one_process(
        write_config(dir, corpus, training(8), "single.yaml", preset), dir / "ck", losses, 1, 8);

    // The newest checkpoint is the single process's, at step 8; `latest` names it.
    auto latest = latest_sharded_checkpoint((dir / "ck").string());
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(std::filesystem::path(*latest).filename(), "step-00000008");
    // Every parameter and both Adam moments, whole (the store checks the pieces tile them).
    store::CheckpointReader reader(*latest);
    const auto spec = model::ModelSpec::from(c.model);
    for (const auto& p : spec)
      for (std::string suffix : {"", "/adam_m", "/adam_v"})
        EXPECT_NE(reader.find(p.name + suffix), nullptr) << p.name + suffix;
    EXPECT_EQ(reader.meta().at("step").get<int64_t>(), 8);
  }
}

// Saving prunes the folder to the newest checkpoint.keep checkpoints; `latest` names the newest.
TEST(ShardedCheckpoint, OldCheckpointsArePrunedToKeep) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  ReferenceTrainer(
      TrainConfig::load(write_config(dir, corpus,
                                     "training: {steps: 4, global_batch: 4, micro_batch: 2}\n"
                                     "checkpoint: {dir: ck, every: 1, keep: 2}\n")))
      .run();
  EXPECT_FALSE(std::filesystem::exists(dir / "ck" / checkpoint_step_name(1)));
  EXPECT_FALSE(std::filesystem::exists(dir / "ck" / checkpoint_step_name(2)));
  EXPECT_TRUE(std::filesystem::exists(dir / "ck" / checkpoint_step_name(3)));
  EXPECT_EQ(latest_sharded_checkpoint((dir / "ck").string()),
            (dir / "ck" / checkpoint_step_name(4)).string());
}

// Where a run starts (decided once by `tessel train`, which passes it to its workers): the newest
// checkpoint and its step when checkpoint.resume is on, nothing when it is off.
TEST(ShardedCheckpoint, TheResumePointIsTheNewestCheckpointUnlessResumeIsOff) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  const std::string run = "training: {steps: 3, global_batch: 4, micro_batch: 2}\n";
  auto cfg =
      TrainConfig::load(write_config(dir, corpus, run + "checkpoint: {dir: ck, every: 1}\n"));
  EXPECT_FALSE(checkpoint::find_resume_point(cfg).has_value());  // nothing saved yet
  ReferenceTrainer(cfg).run();
  const auto point = checkpoint::find_resume_point(cfg);
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->path, (dir / "ck" / checkpoint_step_name(3)).string());
  EXPECT_EQ(point->step, 3);
  auto fresh = TrainConfig::load(write_config(
      dir, corpus, run + "checkpoint: {dir: ck, every: 1, resume: false}\n", "fresh.yaml"));
  EXPECT_FALSE(checkpoint::find_resume_point(fresh).has_value());
}

TEST(ShardedCheckpoint, ResumingWithAnotherGlobalBatchIsRefused) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  ReferenceTrainer(TrainConfig::load(write_config(dir, corpus, training(2), "a.yaml"))).run();
  auto cfg = TrainConfig::load(write_config(
      dir, corpus, "training: {steps: 4, global_batch: 6, micro_batch: 2}\ncheckpoint: {dir: ck}\n",
      "b.yaml"));
  try {
    ReferenceTrainer t(cfg);
    FAIL() << "resumed with another global batch";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("training.global_batch 12"), std::string::npos)
        << e.what();
  }
}

TEST(ShardedCheckpoint, LatestNamingAMissingCheckpointIsAnError) {
  TempDir dir;
  std::filesystem::create_directories(dir / "ck");
  std::ofstream(dir / "ck" / "latest") << "step-00000007\n";
  EXPECT_THROW(latest_sharded_checkpoint((dir / "ck").string()), CorruptDataError);
  EXPECT_FALSE(latest_sharded_checkpoint((dir / "none").string()).has_value());
}

}  // namespace
}  // namespace tessel::runtime
