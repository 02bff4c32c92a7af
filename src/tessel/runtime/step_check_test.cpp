// The step-by-step check of step_check_test_util.h must be able to fail: a run whose arithmetic
// differs by more than rounding (a learning rate 0.1% off, weight decay left out) is caught, while
// the same run passes against its own config.
#include "tessel/runtime/step_check_test_util.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "tessel/config/config_test_util.h"

namespace tessel::runtime {

using config::TrainConfig;
namespace {

using tessel::testing::TempDir;

// How many failures checking `run_extra`'s run against `single_extra`'s config reports.
size_t failures_of_check(const std::string& run_extra, const std::string& single_extra) {
  TempDir dir;
  const auto corpus = config::testing::make_corpus(dir);
  const std::string training = "training: {steps: 3, global_batch: 4, micro_batch: 2}\n";
  ReferenceTrainer(TrainConfig::load(config::testing::write_config(
                       dir, corpus,
                       training + run_extra + "output: {metrics: m.jsonl}\n" +
                           testing::every_step_checkpoints(3),
                       "run.yaml")))
      .run();
  const auto single =
      config::testing::write_config(dir, corpus, training + single_extra, "single.yaml");
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    testing::expect_steps_match_one_process(single, dir / "steps",
                                            testing::read_step_losses(dir / "m.jsonl"), 1, 3);
  }
  return size_t(failures.size());
}

TEST(StepCheck, PassesTheSameTraining) {
  EXPECT_EQ(failures_of_check("optimizer: {lr: 0.01}\n", "optimizer: {lr: 0.01}\n"), 0u);
}

TEST(StepCheck, CatchesALearningRateOffByATenthOfAPercent) {
  EXPECT_GT(failures_of_check("optimizer: {lr: 0.01001}\n", "optimizer: {lr: 0.01}\n"), 0u);
}

TEST(StepCheck, CatchesAMissingWeightDecay) {
  EXPECT_GT(failures_of_check("optimizer: {weight_decay: 0}\n", ""), 0u);
}

}  // namespace
}  // namespace tessel::runtime
