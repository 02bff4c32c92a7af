// Activation recomputation in training runs: `parallel.recompute: full | selective` (or a plan
// that asks for it) makes every worker's model recompute (model/recompute.h), and the run is
// bit-identical to the same run without: the same logged losses and the same saved state, byte
// for byte, under a pipeline and tensor parallelism.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {
namespace {

namespace fs = std::filesystem;
using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

void train(const std::string& cfg, int nproc) {
  std::string out;
  ASSERT_EQ(testing::run_train(cfg, nproc, &out), 0) << out;
}

TEST(RecomputeRun, LossesAndStateAreBitIdenticalToKeepingActivations) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    const auto corpus = make_corpus(dir);
    auto run = [&](const std::string& tag, const std::string& parallel, int nproc) {
      train(write_config(dir, corpus,
                         "training: {steps: 3, global_batch: 8, micro_batch: 2, threads: 1}\n"
                         "optimizer: {lr: 0.01, warmup_steps: 1}\n"
                         "output: {metrics: " +
                             tag + ".jsonl}\ncheckpoint: {dir: ck-" + tag + ", every: 3}\n" +
                             "parallel: " + parallel + "\n",
                         tag + ".yaml", preset),
            nproc);
    };
    run("none", "{pp: 2, tp: 2}", 4);
    run("full", "{pp: 2, tp: 2, recompute: full}", 4);
    run("selective", "{pp: 2, tp: 2, recompute: selective}", 4);
    const auto want = testing::read_step_losses(dir / "none.jsonl");
    ASSERT_EQ(want.size(), 3u);
    for (std::string tag : {"full", "selective"}) {
      SCOPED_TRACE(tag);
      EXPECT_EQ(testing::read_step_losses(dir / (tag + ".jsonl")), want);
      const auto meta =
          testing::expect_same_latest_checkpoint(dir / "ck-none", dir / ("ck-" + tag));
      // The plan the run recorded says so.
      EXPECT_NE(meta.at("plan").dump().find(tag), std::string::npos) << meta.dump();
    }
  }
}

// Just-in-time recomputation (Varuna): one micro-batch's activations per chunk, the forward re-run
// before each backward that lost them. Same kernels on the same inputs: bit-identical runs.
TEST(RecomputeRun, JustInTimeRecomputationIsBitIdenticalToKeepingActivations) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  struct Case {
    std::string preset, parallel;
    int nproc;
  };
  for (const Case& c :
       {Case{"gpt2-tiny", "pp: 2, schedule: 1f1b", 2},
        Case{"llama-tiny", "pp: 3, schedule: gpipe", 3},
        Case{"gpt2-tiny", "pp: 2, virtual_stages: 2, schedule: interleaved-1f1b", 2},
        Case{"llama-tiny", "pp: 2, tp: 2, schedule: 1f1b", 4}}) {
    SCOPED_TRACE(c.parallel);
    auto run = [&](const std::string& tag, const std::string& extra) {
      train(write_config(dir, corpus,
                         "training: {steps: 3, global_batch: 8, micro_batch: 1, threads: 1}\n"
                         "optimizer: {lr: 0.01, warmup_steps: 1}\n"
                         "output: {metrics: " +
                             tag + ".jsonl}\ncheckpoint: {dir: ck-" + tag + ", every: 3}\n" +
                             "parallel: {micro_batch: 1, " + c.parallel + extra + "}\n",
                         tag + ".yaml", c.preset),
            c.nproc);
    };
    fs::remove_all(dir / "ck-keep");
    fs::remove_all(dir / "ck-jit");
    run("keep", "");
    run("jit", ", jit_recompute: true");
    const auto want = testing::read_step_losses(dir / "keep.jsonl");
    ASSERT_EQ(want.size(), 3u);
    EXPECT_EQ(testing::read_step_losses(dir / "jit.jsonl"), want);
    const auto meta = testing::expect_same_latest_checkpoint(dir / "ck-keep", dir / "ck-jit");
    EXPECT_NE(meta.at("plan").dump().find("\"jit_recompute\":true"), std::string::npos)
        << meta.dump();
  }
}

TEST(RecomputeRun, JustInTimeRecomputationNeedsWholeBackwards) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  for (std::string parallel : {"{pp: 2, schedule: zb-h1, jit_recompute: true}",
                               "{pp: 2, schedule: 1f1b, recompute: full, jit_recompute: true}"}) {
    const std::string error = config::testing::parallel_config_error(dir, corpus, parallel);
    EXPECT_NE(error.find("jit_recompute"), std::string::npos) << parallel << ": " << error;
  }
}

TEST(RecomputeRun, AnUnknownModeNamesTheKey) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  try {
    config::TrainConfig::load(
        write_config(dir, corpus, "parallel: {pp: 2, recompute: sometimes}\n", "bad.yaml"));
    FAIL() << "accepted recompute: sometimes";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.recompute"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessel::runtime
