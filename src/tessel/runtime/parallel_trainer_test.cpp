// Multi-process training: real worker processes started by the built `tessel` binary
// (`tessel train CONFIG --nproc N`), whose per-step losses must equal the single-process
// Trainer's from the same seed and data.
#include "tessel/runtime/parallel_trainer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessel/core/error.h"
#include "tessel/runtime/runtime_test_util.h"

namespace tessel::runtime {
namespace {

using tessel::testing::TempDir;
using testing::make_corpus;
using testing::write_config;

std::vector<double> read_losses(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<double> losses;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) losses.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return losses;
}

std::string tessel_command(const std::string& args) {
  auto bin = tessel::testing::tessel_binary();
  EXPECT_TRUE(std::filesystem::exists(bin)) << bin << " is not built; build the `tessel` target";
  return fmt::format("OMP_NUM_THREADS=1 {} {}", bin.string(), args);
}

struct Layout {
  int dp = 1, tp = 1, pp = 1, virtual_stages = 1;
  int micro_batch = 2;
  std::string schedule = "1f1b";
  std::string name() const {
    return fmt::format("dp{}_tp{}_pp{}_v{}_{}", dp, tp, pp, virtual_stages, schedule);
  }
};

const std::string kTraining =
    "training: {steps: 3, global_batch: 12, micro_batch: 2, threads: 1}\n"
    "optimizer: {lr: 0.01, warmup_steps: 1}\n";

void expect_same_losses(const std::string& preset, const Layout& l) {
  SCOPED_TRACE(preset + " " + l.name());
  TempDir dir;
  auto corpus = make_corpus(dir);
  auto single =
      Trainer(TrainConfig::load(write_config(dir, corpus, kTraining, "single.yaml", preset)))
          .run()
          .losses;
  std::string parallel = fmt::format(
      "parallel: {{dp: {}, tp: {}, pp: {}, virtual_stages: {}, micro_batch: {}, schedule: {}}}\n"
      "output: {{metrics: metrics.jsonl}}\n",
      l.dp, l.tp, l.pp, l.virtual_stages, l.micro_batch, l.schedule);
  auto cfg = write_config(dir, corpus, kTraining + parallel, "parallel.yaml", preset);
  std::string out;
  int rc = tessel::testing::run_command(
      tessel_command(fmt::format("train {} --nproc {}", cfg, l.dp * l.tp * l.pp)), &out);
  ASSERT_EQ(rc, 0) << out;
  auto losses = read_losses(dir / "metrics.jsonl");
  ASSERT_EQ(losses.size(), single.size()) << out;
  for (size_t i = 0; i < single.size(); ++i)
    EXPECT_NEAR(losses[i], single[i], 1e-5 * single[i]) << "step " << i;
}

TEST(ParallelTrainer, DataParallelMatchesOneProcess) {
  expect_same_losses("gpt2-tiny", {.dp = 2});
  expect_same_losses("llama-tiny", {.dp = 3});
}

TEST(ParallelTrainer, TensorParallelMatchesOneProcess) {
  expect_same_losses("gpt2-tiny", {.tp = 2});
  expect_same_losses("llama-tiny", {.tp = 2});
}

TEST(ParallelTrainer, PipelineParallelMatchesOneProcess) {
  expect_same_losses("gpt2-tiny", {.pp = 2});
  expect_same_losses("llama-tiny", {.pp = 2, .schedule = "gpipe"});
}

TEST(ParallelTrainer, InterleavedPipelineMatchesOneProcess) {
  expect_same_losses(
      "gpt2-tiny",
      {.pp = 4, .virtual_stages = 2, .micro_batch = 3, .schedule = "interleaved-1f1b"});
}

TEST(ParallelTrainer, ThreeDimensionsMatchOneProcess) {
  expect_same_losses("gpt2-tiny", {.dp = 2, .tp = 2});
  expect_same_losses("llama-tiny", {.dp = 2, .pp = 2});
  expect_same_losses("gpt2-tiny", {.tp = 2, .pp = 2});
}

// Plan mistakes are reported before any worker starts.
std::string config_error(const std::string& parallel, int workers = 0) {
  TempDir dir;
  auto path = write_config(dir, (dir / "none.tok").string(), kTraining + parallel);
  try {
    auto cfg = TrainConfig::load(path);
    cfg.validate_for_workers(workers > 0 ? workers : cfg.plan.world());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelTrainer, PlanMistakesAreConfigErrors) {
  EXPECT_NE(config_error("parallel: {dp: 2, tp: 2}\n", 3)
                .find("dp 2 x tp 2 x pp 1 = 4 workers but 3 were started"),
            std::string::npos)
      << config_error("parallel: {dp: 2, tp: 2}\n", 3);
  EXPECT_NE(config_error("parallel: {tp: 3}\n").find("tp 3 does not divide n_head 4"),
            std::string::npos)
      << config_error("parallel: {tp: 3}\n");
  EXPECT_NE(config_error("parallel: {pp: 9}\n")
                .find("9 pipeline stages but model 'gpt2-tiny' has only 8"),
            std::string::npos)
      << config_error("parallel: {pp: 9}\n");
  EXPECT_NE(config_error("parallel: {dp: 5}\n").find("dp 5 must divide the global batch"),
            std::string::npos)
      << config_error("parallel: {dp: 5}\n");
  EXPECT_NE(config_error("parallel: {dp: 2, micro_batch: 4}\n")
                .find("micro_batch must divide the 6 samples"),
            std::string::npos)
      << config_error("parallel: {dp: 2, micro_batch: 4}\n");
  EXPECT_NE(config_error("parallel: {dp: 2, tpp: 2}\n").find("tpp"), std::string::npos);
  EXPECT_EQ(config_error("parallel: {dp: 2, tp: 2}\n"), "");
}

TEST(ParallelTrainer, DefaultPlanIsOneWorker) {
  TempDir dir;
  auto cfg = TrainConfig::load(write_config(dir, (dir / "none.tok").string(), kTraining));
  EXPECT_EQ(cfg.plan.world(), 1);
  EXPECT_EQ(cfg.plan.micro_batch, 2);
  EXPECT_EQ(cfg.plan.micro_batches, 6);
  EXPECT_FALSE(cfg.is_parallel());
  auto dp3 = TrainConfig::load(write_config(dir, (dir / "none.tok").string(),
                                            kTraining + "parallel: {dp: 3}\n", "dp3.yaml"));
  EXPECT_EQ(dp3.plan.micro_batch, 2);
  EXPECT_EQ(dp3.plan.micro_batches, 2);
}

TEST(ParallelTrainer, WrongWorkerCountFailsBeforeStarting) {
  TempDir dir;
  auto cfg = write_config(dir, make_corpus(dir), kTraining + "parallel: {dp: 2}\n");
  std::string out;
  int rc =
      tessel::testing::run_command(tessel_command(fmt::format("train {} --nproc 3", cfg)), &out);
  EXPECT_EQ(rc, 2) << out;  // a config error
  EXPECT_NE(out.find("3 were started"), std::string::npos) << out;
  EXPECT_EQ(out.find("[rank"), std::string::npos) << out;
}

}  // namespace
}  // namespace tessel::runtime
