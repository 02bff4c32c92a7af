// Multi-process training: faults and plan mistakes, on real worker processes started by the
// built `tessel` binary (`tessel train CONFIG --nproc N`).
#include "tessel/runtime/parallel_trainer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/step_check_test_util.h"

namespace tessel::runtime {

using config::TrainConfig;
namespace {

using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

std::string tessel_command(const std::string& args) {
  auto bin = tessel::testing::tessel_binary();
  EXPECT_TRUE(std::filesystem::exists(bin)) << bin << " is not built; build the `tessel` target";
  return fmt::format("OMP_NUM_THREADS=1 {} {}", bin.string(), args);
}

const std::string kTraining =
    "training: {steps: 3, global_batch: 12, micro_batch: 2, threads: 1}\n"
    "optimizer: {lr: 0.01, warmup_steps: 1}\n";

// The equivalence of every layout with one process is tested in equivalence_test.cpp.

// A worker killed mid-run in a fixed (non-elastic) launch, `tessel launch -- tessel worker`: the
// launcher names it and fails (bounded by the comm timeout), and the survivors end with
// PeerLostError in their logs instead of hanging. (`tessel train` recovers instead:
// elastic/failure_test.cpp.)
TEST(ParallelTrainer, KilledWorkerFailsTheJobAndSurvivorsSeePeerLost) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  auto cfg = write_config(dir, corpus,
                          "training: {steps: 100000, global_batch: 6, micro_batch: 2, threads: 1}\n"
                          "parallel: {dp: 3, timeout_s: 5}\n"
                          "output: {metrics: metrics.jsonl}\n");
  // The whole script is bounded by `timeout`: a hang fails the test (rc 124) instead of blocking.
  std::ofstream(dir / "kill.sh") << fmt::format(
      "cd {dir}\n"
      "{cmd} > train.out 2>&1 &\n"
      "L=$!\n"
      "for i in $(seq 600); do [ -s metrics.jsonl ] && break; sleep 0.05; done\n"
      "for p in $(pgrep -P $L); do\n"
      "  if tr '\\0' '\\n' < /proc/$p/environ | grep -qx TESSEL_RANK=1; then kill -9 $p; fi\n"
      "done\n"
      "wait $L\n"
      "echo \"launcher rc=$?\"\n",
      fmt::arg("dir", dir.path().string()),
      fmt::arg("cmd", tessel_command(fmt::format(
                          "launch --nproc 3 --log-dir logs --peer-grace 10 -- {} worker {}",
                          tessel::testing::tessel_binary().string(), cfg))));
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("timeout 60 bash {}", (dir / "kill.sh").string()), &out);
  ASSERT_EQ(rc, 0) << out;
  std::ifstream train_out(dir / "train.out");
  std::string launcher((std::istreambuf_iterator<char>(train_out)), {});
  EXPECT_NE(out.find("launcher rc=137"), std::string::npos) << out << launcher;
  EXPECT_NE(launcher.find("rank 1"), std::string::npos) << launcher;
  EXPECT_NE(launcher.find("SIGKILL"), std::string::npos) << launcher;
  for (int r : {0, 2}) {
    std::ifstream log(dir / "logs" / fmt::format("rank{}.log", r));
    std::string text((std::istreambuf_iterator<char>(log)), {});
    EXPECT_NE(text.find("peer lost"), std::string::npos) << "rank " << r << ":\n" << text;
  }
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
  EXPECT_NE(
      config_error("parallel: {dp: 2, timeout_s: 0}\n").find("'parallel.timeout_s': must be > 0"),
      std::string::npos)
      << config_error("parallel: {dp: 2, timeout_s: 0}\n");
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

namespace tessel::runtime {
namespace {

// `tessel plan --out plan.json` then `parallel: {plan_file: plan.json}`: the runtime trains the
// planner's layout, each step equal to one single-process step (step_check_test_util.h).
TEST(ParallelTrainer, TrainsThePlannersJsonPlan) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  auto bin = tessel::testing::tessel_binary().string();
  std::string out;
  ASSERT_EQ(tessel::testing::run_command(
                fmt::format("{} plan --model gpt2-tiny --cluster dgx-a100 --gpus 4 "
                            "--global-batch 12 --seq 16 --out {}",
                            bin, (dir / "plan.json").string()),
                &out),
            0)
      << out;
  const auto plan = layout::plan_from_json(nlohmann::json::parse(std::ifstream(dir / "plan.json")));
  auto cfg = write_config(dir, corpus,
                          kTraining + testing::every_step_checkpoints(3) +
                              "parallel: {plan_file: plan.json}\n"
                              "output: {metrics: metrics.jsonl}\n");
  EXPECT_EQ(TrainConfig::load(cfg).plan.world(), plan.world());
  int rc = tessel::testing::run_command(
      tessel_command(fmt::format("train {} --nproc {}", cfg, plan.world())), &out);
  ASSERT_EQ(rc, 0) << out;
  SCOPED_TRACE(plan.describe());
  const auto losses = testing::read_step_losses(dir / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 3u) << out;
  testing::expect_steps_match_one_process(write_config(dir, corpus, kTraining, "single.yaml"),
                                          dir / "steps", losses, 1, 3);
  // A missing or malformed plan file is named.
  auto missing =
      write_config(dir, corpus, kTraining + "parallel: {plan_file: none.json}\n", "missing.yaml");
  EXPECT_NE(
      tessel::testing::error_of<IoError>([&] { TrainConfig::load(missing); }).find("none.json"),
      std::string::npos);
  std::ofstream(dir / "bad.json") << "{dp: 2";
  auto bad = write_config(dir, corpus, kTraining + "parallel: {plan_file: bad.json}\n", "bad.yaml");
  EXPECT_NE(
      tessel::testing::error_of<ConfigError>([&] { TrainConfig::load(bad); }).find("not JSON"),
      std::string::npos);
  // A layout key beside plan_file is ambiguous.
  EXPECT_NE(config_error("parallel: {plan_file: plan.json, dp: 2}\n").find("plan_file"),
            std::string::npos);
}

}  // namespace
}  // namespace tessel::runtime
