#include "tessel/runtime/reference_trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/data/token_dataset.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/tensor/allocator.h"

namespace tessel::runtime {

using config::TrainConfig;
namespace {

using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

TEST(ReferenceTrainer, LossFallsOnASmallCorpus) {
  TempDir dir;
  auto cfg = TrainConfig::load(
      write_config(dir, make_corpus(dir),
                   "training: {steps: 40, global_batch: 8, micro_batch: 8, eval_every: 40}\n"
                   "optimizer: {lr: 0.01, warmup_steps: 5}\n"));
  ReferenceTrainer trainer(cfg);
  auto summary = trainer.run();
  ASSERT_EQ(summary.losses.size(), 40u);
  EXPECT_NEAR(summary.losses.front(), std::log(257.0), 0.3);  // uniform at init
  EXPECT_LT(summary.final_loss, 0.7 * summary.losses.front());
  EXPECT_LT(summary.final_eval_loss, 0.7 * summary.losses.front());
  EXPECT_EQ(trainer.cursor(), 40 * 8);
}

// Micro-batches of 4 and 2 accumulate the gradients of a global batch of 8 in other groupings:
// each of their steps equals one step over the whole batch at once (step_check_test_util.h).
TEST(ReferenceTrainer, GradientAccumulationMatchesOneLargeBatch) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  auto config = [&](int micro, const std::string& extra) {
    return write_config(dir, corpus,
                        "training: {steps: 4, global_batch: 8, micro_batch: " +
                            std::to_string(micro) + "}\n" + extra,
                        "m" + std::to_string(micro) + ".yaml");
  };
  const std::string whole_batch = config(8, "");
  for (int micro : {4, 2}) {
    SCOPED_TRACE(::testing::Message() << "micro-batch " << micro);
    const std::string saves = "m" + std::to_string(micro) + "-steps";
    auto cfg = TrainConfig::load(
        config(micro, "output: {metrics: m.jsonl}\n" + testing::every_step_checkpoints(4, saves)));
    ReferenceTrainer(cfg).run();
    testing::expect_steps_match_one_process(whole_batch, dir / saves,
                                            testing::read_step_losses(dir / "m.jsonl"), 1, 4);
    std::filesystem::remove(dir / "m.jsonl");
  }
}

TEST(ReferenceTrainer, ResumeContinuesWithTheSameLosses) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    TempDir dir;
    auto corpus = make_corpus(dir);
    std::string train = "training: {steps: 8, global_batch: 4, micro_batch: 2}\n";
    auto straight =
        ReferenceTrainer(TrainConfig::load(write_config(dir, corpus, train, "a.yaml", preset)))
            .run();

    std::string ckpt = "checkpoint: {dir: ck, every: 3}\n";
    auto first_cfg = TrainConfig::load(write_config(dir, corpus, train + ckpt, "b.yaml", preset));
    first_cfg.training.steps = 5;  // stops after step 5; the newest checkpoint is at step 5
    ReferenceTrainer(first_cfg).run();
    // The checkpoint records the micro-batching that ran: 2 samples, 2 micro-batches a step.
    const auto saved = checkpoint::latest_sharded_checkpoint((dir.path() / "ck").string());
    ASSERT_TRUE(saved.has_value());
    const auto plan = layout::plan_from_json(store::CheckpointReader(*saved).meta().at("plan"));
    EXPECT_EQ(plan.micro_batch, 2);
    EXPECT_EQ(plan.micro_batches, 2);
    ReferenceTrainer resumed(
        TrainConfig::load(write_config(dir, corpus, train + ckpt, "b.yaml", preset)));
    EXPECT_EQ(resumed.step(), 5);
    EXPECT_EQ(resumed.cursor(), 5 * 4);
    auto rest = resumed.run();
    ASSERT_EQ(rest.losses.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(rest.losses[i], straight.losses[5 + i]) << preset << " step " << 5 + i;
  }
}

// Mixed precision keeps the training state fp32 (the bf16 weights are a copy made each step), so
// a bf16 run resumes bit-identically from its own checkpoints, and either precision resumes the
// other's.
TEST(ReferenceTrainer, Bf16ResumesExactlyAndEitherPrecisionResumesTheOther) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  const std::string train = "training: {steps: 8, global_batch: 4, micro_batch: 2, precision: ";
  auto load = [&](const std::string& precision, const std::string& extra, const char* name) {
    return TrainConfig::load(write_config(dir, corpus, train + precision + "}\n" + extra, name));
  };
  const auto fp32 = ReferenceTrainer(load("fp32", "", "f.yaml")).run();
  const auto bf16 = ReferenceTrainer(load("bf16", "", "b.yaml")).run();
  ASSERT_EQ(bf16.losses.size(), 8u);
  EXPECT_NEAR(bf16.losses.front(), std::log(257.0), 0.3);
  EXPECT_NE(bf16.losses.front(), fp32.losses.front());  // the bf16 arithmetic ran

  for (const char* saved_as : {"bf16", "fp32"}) {
    SCOPED_TRACE(saved_as);
    const std::string ck = std::string("checkpoint: {dir: ck-") + saved_as + ", every: 5}\n";
    auto first = load(saved_as, ck, "s.yaml");
    first.training.steps = 5;
    ReferenceTrainer(first).run();
    for (const char* resumed_as : {"bf16", "fp32"}) {
      // Each resume from its own copy of the step-5 save (a run saves again when it ends).
      const std::string copy = std::string("ck-") + saved_as + "-" + resumed_as;
      std::filesystem::copy(dir.path() / (std::string("ck-") + saved_as), dir.path() / copy,
                            std::filesystem::copy_options::recursive);
      ReferenceTrainer resumed(
          load(resumed_as, "checkpoint: {dir: " + copy + ", every: 5}\n", "r.yaml"));
      EXPECT_EQ(resumed.step(), 5) << resumed_as;
      const auto rest = resumed.run();
      ASSERT_EQ(rest.losses.size(), 3u);
      const auto& straight = std::string(resumed_as) == "bf16" ? bf16 : fp32;
      // The same state and the same arithmetic after the resume: the straight run's losses,
      // exactly, when both halves ran in one precision.
      if (std::string(saved_as) == resumed_as) {
        for (size_t i = 0; i < 3; ++i)
          EXPECT_EQ(rest.losses[i], straight.losses[5 + i]) << resumed_as << " step " << 6 + i;
      }
      for (double l : rest.losses) EXPECT_TRUE(std::isfinite(l)) << resumed_as;
    }
  }
}

TEST(ReferenceTrainer, ResumeRefusesACheckpointOfAnotherModel) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  std::string extra = "training: {steps: 1, global_batch: 2}\ncheckpoint: {dir: ck}\n";
  ReferenceTrainer(TrainConfig::load(write_config(dir, corpus, extra))).run();
  auto other = TrainConfig::load(write_config(dir, corpus, extra, "llama.yaml", "llama-tiny"));
  try {
    ReferenceTrainer t(other);
    FAIL() << "resumed from another model's checkpoint";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("different model"), std::string::npos) << e.what();
  }
}

TEST(ReferenceTrainer, SteadyStateStepsAllocateNoFreshMemory) {
  TempDir dir;
  auto cfg = TrainConfig::load(write_config(
      dir, make_corpus(dir), "training: {steps: 10, global_batch: 4, micro_batch: 2}\n"));
  ReferenceTrainer trainer(cfg);
  trainer.train_step();
  auto before = HostAllocator::instance().stats().fresh_allocations;
  for (int i = 0; i < 3; ++i) trainer.train_step();
  EXPECT_EQ(HostAllocator::instance().stats().fresh_allocations, before);
}

TEST(ReferenceTrainer, DataWithALargerVocabularyThanTheModelIsRejected) {
  TempDir dir;
  std::vector<uint32_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i % 300);
  auto path = (dir / "big.tok").string();
  data::write_token_file(path, tokens, 300, 2);
  auto cfg = TrainConfig::load(write_config(dir, path));
  try {
    ReferenceTrainer t(cfg);
    FAIL() << "accepted token ids beyond the model's vocabulary";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size"), std::string::npos) << e.what();
  }
}

TEST(ReferenceTrainer, MissingAndTruncatedDataFilesAreClearErrors) {
  TempDir dir;
  auto cfg = TrainConfig::load(write_config(dir, (dir / "absent.tok").string()));
  EXPECT_THROW(ReferenceTrainer t(cfg), IoError);
  auto corpus = make_corpus(dir);
  std::filesystem::resize_file(corpus, std::filesystem::file_size(corpus) - 3);
  EXPECT_THROW(ReferenceTrainer t(TrainConfig::load(write_config(dir, corpus))), CorruptDataError);
}

}  // namespace
}  // namespace tessel::runtime
