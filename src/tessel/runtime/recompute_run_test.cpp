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
  const int rc = tessel::testing::run_command(
      fmt::format("OMP_NUM_THREADS=1 {} train {} --nproc {}",
                  tessel::testing::tessel_binary().string(), cfg, nproc),
      &out);
  ASSERT_EQ(rc, 0) << out;
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
    store::CheckpointReader a(*checkpoint::latest_sharded_checkpoint((dir / "ck-none").string()));
    for (std::string tag : {"full", "selective"}) {
      SCOPED_TRACE(tag);
      EXPECT_EQ(testing::read_step_losses(dir / (tag + ".jsonl")), want);
      store::CheckpointReader b(
          *checkpoint::latest_sharded_checkpoint((dir / ("ck-" + tag)).string()));
      ASSERT_EQ(a.tensors().size(), b.tensors().size());
      for (const auto& t : a.tensors()) {
        const Tensor x = a.read(t.name), y = b.read(t.name);
        ASSERT_EQ(x.numel(), y.numel()) << t.name;
        EXPECT_EQ(std::memcmp(x.raw(), y.raw(), size_t(x.numel()) * dtype_size(x.dtype())), 0)
            << t.name;
      }
      // The plan the run recorded says so.
      EXPECT_NE(b.meta().at("plan").dump().find(tag), std::string::npos) << b.meta().dump();
    }
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
