// Fine-tuning (`init_from:`): a run starts from a Hugging Face directory's (or a converted
// checkpoint's) weights with a fresh optimizer and data cursor, under any layout. The same
// directory trained in one process, under dp 2 and under tp 2 gives the same run: every step of
// the parallel runs equals one single-process step from the state saved before it
// (step_check_test_util.h), the first from the Hugging Face weights themselves.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessel/checkpoint/hf_convert.h"
#include "tessel/checkpoint/model_weights.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {
namespace {

namespace fs = std::filesystem;
using config::TrainConfig;
using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

constexpr int kSteps = 3;

// A model pretrained for a few steps from the seed, exported as a Hugging Face directory.
fs::path pretrained_hf(const TempDir& dir, const std::string& corpus, const std::string& preset) {
  ReferenceTrainer(TrainConfig::load(write_config(
                       dir, corpus,
                       "training: {steps: 3, global_batch: 8, micro_batch: 4, seed: 99}\n"
                       "optimizer: {lr: 0.01}\ncheckpoint: {dir: pre}\n",
                       "pre.yaml", preset)))
      .run();
  const fs::path hf = dir / "hf";
  checkpoint::export_hf((dir / "pre").string(), hf.string());
  return hf;
}

// A fine-tuning config without a model section: the model is the Hugging Face directory's.
std::string fine_tune_config(const TempDir& dir, const std::string& corpus, const fs::path& from,
                             const std::string& tag, const std::string& parallel = "") {
  const fs::path path = dir / (tag + ".yaml");
  std::ofstream(path) << "init_from: " << from.string() << "\n"
                      << "data: {path: " << corpus << ", seq_len: 16, eval_fraction: 0.1}\n"
                      << "training: {steps: " << kSteps
                      << ", global_batch: 12, micro_batch: 2, threads: 1}\n"
                      << "optimizer: {lr: 0.003, warmup_steps: 1}\n"
                      << "output: {metrics: " << tag << ".jsonl}\n"
                      << testing::every_step_checkpoints(kSteps, "ck-" + tag) << parallel;
  return path.string();
}

void run_workers(const std::string& cfg, int nproc) {
  std::string out;
  ASSERT_EQ(testing::run_train(cfg, nproc, &out), 0) << out;
  EXPECT_NE(out.find("initialised from Hugging Face model"), std::string::npos) << out;
}

TEST(FineTune, FromAHuggingFaceDirectoryUnderAnyLayoutGivesTheSameSteps) {
  for (std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    const auto corpus = make_corpus(dir);
    const fs::path hf = pretrained_hf(dir, corpus, preset);

    // One process: the model is the directory's and its parameters are the pretrained ones, bit
    // for bit (an f32 export is exact).
    const auto single = fine_tune_config(dir, corpus, hf, "single");
    const TrainConfig cfg = TrainConfig::load(single);
    EXPECT_EQ(cfg.model.n_layer, model::ModelConfig::preset(preset).n_layer);
    {
      ReferenceTrainer fresh(cfg);
      store::CheckpointReader pre(*checkpoint::latest_sharded_checkpoint((dir / "pre").string()));
      for (const auto& v : fresh.model().param_views()) {
        const Tensor want = pre.read(v.name);
        ASSERT_EQ(want.numel(), v.numel) << v.name;
        EXPECT_EQ(std::memcmp(want.data<float>(), fresh.model().params().data<float>() + v.offset,
                              size_t(v.numel) * sizeof(float)),
                  0)
            << v.name;
      }
      // A fresh optimizer and cursor: nothing of the pretraining run's state.
      EXPECT_EQ(fresh.step(), 0);
      EXPECT_EQ(fresh.cursor(), 0);
      for (float m : fresh.adam_m()) ASSERT_EQ(m, 0.0f);
    }
    ReferenceTrainer(cfg).run();
    const auto single_losses = testing::read_step_losses(dir / "single.jsonl");
    ASSERT_EQ(single_losses.size(), size_t(kSteps));

    // `tessel eval` of the same directory under tp 2 gives the single process' evaluation of
    // the same weights, within the forward pass' rounding over the eval tokens.
    {
      const std::string tp_cfg = fine_tune_config(dir, corpus, hf, "eval", "parallel: {tp: 2}\n");
      std::string out;
      const int rc = tessel::testing::run_command(
          fmt::format("OMP_NUM_THREADS=1 {} eval {} --checkpoint {} --batches 3",
                      tessel::testing::tessel_binary().string(), tp_cfg, hf.string()),
          &out);
      ASSERT_EQ(rc, 0) << out;
      const auto at = out.find("{\"data\"");
      ASSERT_NE(at, std::string::npos) << out;
      const double got = nlohmann::json::parse(out.substr(at, out.find('\n', at) - at))
                             .at("eval_loss")
                             .get<double>();
      TrainConfig one = cfg;
      one.training.eval_batches = 3;
      one.checkpoint.resume = false;  // the weights, not the single run's newest checkpoint
      ReferenceTrainer ref(one);
      const double want = ref.evaluate();
      const double tol = model::test_util::step_tolerance(
          one.model, 3 * one.training.micro_batch * one.data.seq_len, one.data.seq_len, false);
      EXPECT_TRUE(tessel::testing::within_bound(got, want, tol * std::fabs(want), "eval loss"));
      // Nothing of the run's was written: no checkpoint, no metrics.
      EXPECT_FALSE(fs::exists(dir / "ck-eval"));
      EXPECT_FALSE(fs::exists(dir / "eval.jsonl"));
    }

    for (const auto& [tag, parallel] : std::vector<std::pair<std::string, std::string>>{
             {"dp2", "parallel: {dp: 2}\n"}, {"tp2", "parallel: {tp: 2}\n"}}) {
      SCOPED_TRACE(tag);
      run_workers(fine_tune_config(dir, corpus, hf, tag, parallel), 2);
      const auto losses = testing::read_step_losses(dir / (tag + ".jsonl"));
      ASSERT_EQ(losses.size(), size_t(kSteps));
      // Step 1 starts from the Hugging Face weights in the single-process check too, so a run
      // that ignored init_from (starting from the seed) fails it.
      const auto checked =
          testing::expect_steps_match_one_process(single, dir / ("ck-" + tag), losses, 1, kSteps);
      EXPECT_EQ(checked.steps, kSteps);
    }
  }
}

// A converted checkpoint (`tessel convert --from-hf`) is a source too; as checkpoint.dir (to
// resume from) it is refused with what to write instead.
TEST(FineTune, FromAnImportedCheckpointAndNotByResumingIt) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  const fs::path hf = pretrained_hf(dir, corpus, "gpt2-tiny");
  const fs::path imported = dir / "imported";
  checkpoint::import_hf(hf.string(), imported.string());

  const TrainConfig a = TrainConfig::load(fine_tune_config(dir, corpus, hf, "a"));
  const TrainConfig b = TrainConfig::load(fine_tune_config(dir, corpus, imported, "b"));
  ReferenceTrainer ta(a), tb(b);
  ASSERT_EQ(ta.model().num_params(), tb.model().num_params());
  EXPECT_EQ(std::memcmp(ta.model().params().data<float>(), tb.model().params().data<float>(),
                        size_t(ta.model().num_params()) * sizeof(float)),
            0);

  // The import placed where a run resumes from: one clear error naming init_from.
  fs::create_directories(dir / "resume");
  fs::copy(imported, dir / "resume" / "step-00000000", fs::copy_options::recursive);
  std::ofstream(dir / "resume" / "latest") << "step-00000000\n";
  const TrainConfig c = TrainConfig::load(write_config(
      dir, corpus, "training: {steps: 2, global_batch: 4}\ncheckpoint: {dir: resume}\n", "c.yaml"));
  try {
    ReferenceTrainer t(c);
    FAIL() << "resumed from weights only";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("holds weights only"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("init_from:"), std::string::npos) << e.what();
  }
}

TEST(FineTune, BadSourcesAreNamed) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  auto error_of = [&](const std::string& yaml) {
    const fs::path p = dir / "bad.yaml";
    std::ofstream(p) << yaml << "data: {path: " << corpus << ", seq_len: 16}\n";
    try {
      TrainConfig::load(p.string());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("init_from: nowhere\n").find("'" + (dir / "nowhere").string() + "'"),
            std::string::npos);
  fs::create_directories(dir / "empty");
  EXPECT_NE(error_of("init_from: empty\n").find("neither a Hugging Face model directory"),
            std::string::npos);
  // A model section that disagrees with the weights names the field.
  const fs::path hf = pretrained_hf(dir, corpus, "gpt2-tiny");
  EXPECT_NE(error_of("init_from: hf\nmodel: {preset: gpt2-tiny, n_layer: 3}\n").find("n_layer"),
            std::string::npos);
  // An unsupported architecture is named.
  fs::create_directories(dir / "bert");
  std::ofstream(dir / "bert" / "config.json") << R"({"model_type": "bert"})";
  EXPECT_NE(error_of("init_from: bert\n").find("bert"), std::string::npos);
  // Missing tensors are found when the weights are opened, before any training.
  fs::remove(hf / "model.safetensors");
  EXPECT_THROW(checkpoint::ModelWeights::open(hf.string()), IoError);
}

}  // namespace
}  // namespace tessel::runtime
