// Multi-process training: real worker processes started by the built `tessel` binary
// (`tessel train CONFIG --nproc N`), whose per-step losses must equal the single-process
// Trainer's from the same seed and data.
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

#include "tessel/core/error.h"
#include "tessel/model/transformer.h"
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
  int zero_stage = 0;
  std::string name() const {
    return fmt::format("dp{}_tp{}_pp{}_v{}_{}_zero{}", dp, tp, pp, virtual_stages, schedule,
                       zero_stage);
  }
  std::string yaml() const {
    return fmt::format(
        "parallel: {{dp: {}, tp: {}, pp: {}, virtual_stages: {}, micro_batch: {}, schedule: {}, "
        "zero_stage: {}}}\n"
        "output: {{metrics: metrics.jsonl}}\n",
        dp, tp, pp, virtual_stages, micro_batch, schedule, zero_stage);
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
  auto cfg = write_config(dir, corpus, kTraining + l.yaml(), "parallel.yaml", preset);
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

// ZeRO-1: gradients reduce-scattered over dp, AdamW state only for the owned flat range,
// parameters all-gathered; the same losses as one process (incl. the tied embedding over pp).
TEST(ParallelTrainer, ZeroOneMatchesOneProcess) {
  expect_same_losses("gpt2-tiny", {.dp = 2, .zero_stage = 1});
  expect_same_losses("gpt2-tiny", {.dp = 2, .pp = 2, .zero_stage = 1});
  expect_same_losses("llama-tiny", {.dp = 2, .tp = 2, .zero_stage = 1});
}

// <dir>/rank<R>.params as written by TESSEL_DUMP_PARAMS: name -> values, for every rank.
std::vector<std::map<std::string, std::vector<float>>> read_param_dumps(
    const std::filesystem::path& dir, int ranks) {
  std::vector<std::map<std::string, std::vector<float>>> out(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(dir / fmt::format("rank{}.params", r), std::ios::binary);
    EXPECT_TRUE(in) << "rank " << r << " wrote no parameter dump";
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream head(line);
      std::string name;
      int64_t numel = 0;
      int tp_rank = 0, tp_size = 0;
      head >> name >> numel >> tp_rank >> tp_size;
      EXPECT_EQ(tp_size, 1) << "the comparison below expects whole tensors";
      std::vector<float> values(static_cast<size_t>(numel));
      in.read(reinterpret_cast<char*>(values.data()), std::streamsize(numel * sizeof(float)));
      EXPECT_TRUE(in) << name;
      out[size_t(r)][name] = std::move(values);
    }
  }
  return out;
}

// After training, every rank's parameters (every dp replica's copy, both copies of the tied
// embedding) equal the single-process Trainer's within 1e-5 absolute (lr 0.01, 3 steps: Adam
// moves each element by about 0.03 in total, so this is a relative agreement of ~3e-4 of the
// update; the observed maximum is ~2e-6, float summation-order noise amplified by Adam).
TEST(ParallelTrainer, FinalParametersMatchOneProcess) {
  TempDir dir;
  auto corpus = make_corpus(dir);
  Trainer single(TrainConfig::load(write_config(dir, corpus, kTraining, "single.yaml")));
  single.run();
  const Layout l{.dp = 2, .pp = 2, .zero_stage = 1};
  auto cfg = write_config(dir, corpus, kTraining + l.yaml(), "parallel.yaml");
  std::filesystem::create_directories(dir / "dump");
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("TESSEL_DUMP_PARAMS={} {}", (dir / "dump").string(),
                  tessel_command(fmt::format("train {} --nproc 4", cfg))),
      &out);
  ASSERT_EQ(rc, 0) << out;
  auto dumps = read_param_dumps(dir / "dump", 4);
  const auto& m = single.model();
  const float* ref = m.params().data<float>();
  std::map<std::string, int> copies;
  double max_err = 0;
  for (const auto& v : m.param_views()) {
    for (const auto& rank : dumps) {
      auto it = rank.find(v.name);
      if (it == rank.end()) continue;
      ++copies[v.name];
      ASSERT_EQ(int64_t(it->second.size()), v.numel) << v.name;
      for (int64_t i = 0; i < v.numel; ++i)
        max_err = std::max(max_err, double(std::abs(it->second[size_t(i)] - ref[v.offset + i])));
    }
    // dp 2 replicas of every tensor; the tied embedding lives on both pipeline ends.
    EXPECT_GE(copies[v.name], 2) << v.name << " missing from the workers' dumps";
  }
  EXPECT_LT(max_err, 1e-5);
  std::printf("final parameters: max abs difference %.3g\n", max_err);
}

// A worker killed mid-run: the launcher names it and fails (bounded by the comm timeout), and
// the survivors end with PeerLostError in their logs instead of hanging.
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
      fmt::arg("cmd", tessel_command(fmt::format("train {} --nproc 3 --log-dir logs", cfg))));
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
