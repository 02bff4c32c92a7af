// `tessel convert ...` run in-process through a CLI::App holding only the convert command.
#include "tessel/cli/convert_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessel/config/model_json.h"
#include "tessel/core/error.h"
#include "tessel/model/init.h"
#include "tessel/model/model_spec.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/safetensors.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

namespace fs = std::filesystem;
using tessel::testing::error_of;
using tessel::testing::TempDir;
using ::testing::HasSubstr;

// Parses `args` (after "tessel") and runs the chosen action; returns its status and stdout.
std::pair<int, std::string> run_convert(std::vector<std::string> args) {
  CLI::App app;
  std::function<int()> action;
  add_convert_command(app, action);
  args.insert(args.begin(), "tessel");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  app.parse(int(argv.size()), argv.data());
  ::testing::internal::CaptureStdout();
  int status = -1;
  try {
    status = action ? action() : -1;
  } catch (...) {
    ::testing::internal::GetCapturedStdout();
    throw;
  }
  return {status, ::testing::internal::GetCapturedStdout()};
}

// gpt2-tiny (2 layers), freshly initialised, as a one-rank tessel checkpoint.
model::ModelConfig write_checkpoint(const fs::path& dir) {
  model::ModelConfig cfg = model::ModelConfig::preset("gpt2-tiny");
  cfg.n_layer = 2;
  const auto spec = model::ModelSpec::from(cfg);
  std::vector<std::vector<float>> values;
  store::CheckpointWriter w(dir.string(), 0);
  for (const auto& p : spec) {
    values.emplace_back(size_t(p.numel()));
    model::init_full(p, 9, values.back().data());
    w.add(p.name, DType::f32, p.shape, Box::of(p.shape), values.back().data());
  }
  w.write_rank_file();
  w.commit(1, {{"model", config::to_json(cfg)}, {"step", 3}});
  return cfg;
}

TEST(ConvertCommand, ToHfAndBack) {
  TempDir tmp;
  const auto cfg = write_checkpoint(tmp / "ckpt");
  auto [status, out] = run_convert(
      {"convert", "--to", "hf", (tmp / "ckpt").string(), (tmp / "hf").string(), "--dtype", "bf16"});
  EXPECT_EQ(status, 0);
  EXPECT_THAT(out, HasSubstr("GPT2LMHeadModel 'gpt2-tiny'"));
  EXPECT_THAT(out, HasSubstr("bf16"));
  const auto hf = store::SafetensorsReader::open((tmp / "hf" / "model.safetensors").string());
  EXPECT_EQ(hf.at("transformer.h.1.attn.c_attn.weight").dtype, DType::bf16);
  EXPECT_EQ(hf.at("transformer.h.1.attn.c_attn.weight").shape, (Shape{32, 96}));
  std::ifstream config_in(tmp / "hf" / "config.json");
  EXPECT_EQ(nlohmann::json::parse(config_in).at("n_layer"), 2);

  std::tie(status, out) =
      run_convert({"convert", "--from", "hf", (tmp / "hf").string(), (tmp / "back").string()});
  EXPECT_EQ(status, 0);
  EXPECT_THAT(out, HasSubstr("from GPT2LMHeadModel weights in bf16"));
  // The parameters are the originals rounded to bf16.
  store::CheckpointReader orig((tmp / "ckpt").string()), back((tmp / "back").string());
  const std::string name = "transformer.h.1.mlp.c_proj.weight";
  Tensor a = orig.read(name), b = back.read(name);
  ASSERT_EQ(a.shape(), b.shape());
  Tensor rounded = a.to(DType::bf16).to(DType::f32);
  for (int64_t i = 0; i < a.numel(); ++i)
    ASSERT_EQ(b.data<float>()[i], rounded.data<float>()[i]) << i;
  EXPECT_EQ(config::model_config_from_json(back.meta().at("model")).n_layer, cfg.n_layer);
}

// An export into a directory that holds the user's files (their own config.json) is refused
// unless --force, and never goes inside the checkpoint it reads.
TEST(ConvertCommand, AnExportNeverOverwritesWithoutForce) {
  TempDir tmp;
  write_checkpoint(tmp / "ckpt");
  fs::create_directories(tmp / "hf");
  std::ofstream(tmp / "hf" / "config.json") << "{\"mine\": true}";
  const auto what = tessel::testing::error_of<ConfigError>([&] {
    run_convert({"convert", "--to", "hf", (tmp / "ckpt").string(), (tmp / "hf").string()});
  });
  EXPECT_THAT(what, HasSubstr("add --force"));
  std::ifstream mine(tmp / "hf" / "config.json");
  EXPECT_EQ(nlohmann::json::parse(mine).at("mine"), true);
  EXPECT_THROW(run_convert({"convert", "--to", "hf", (tmp / "ckpt").string(),
                            (tmp / "ckpt" / "hf").string(), "--force"}),
               ConfigError);
  EXPECT_EQ(run_convert({"convert", "--to", "hf", (tmp / "ckpt").string(), (tmp / "hf").string(),
                         "--force"})
                .first,
            0);
}

TEST(ConvertCommand, ModelPresetMustFitTheWeights) {
  TempDir tmp;
  write_checkpoint(tmp / "ckpt");
  run_convert({"convert", "--to", "hf", (tmp / "ckpt").string(), (tmp / "hf").string()});
  fs::remove(tmp / "hf" / "config.json");
  // gpt2-tiny has 6 layers; these weights have 2.
  try {
    run_convert({"convert", "--from", "hf", (tmp / "hf").string(), (tmp / "back").string(),
                 "--model", "gpt2-tiny"});
    FAIL() << "imported 2 layers as 6";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("lacks 48 tensor(s) of gpt2 model 'gpt2-tiny' (n_layer 6"));
  }
  EXPECT_THROW(run_convert({"convert", "--from", "hf", (tmp / "hf").string(),
                            (tmp / "back").string(), "--model", "gpt5"}),
               ConfigError);
}

TEST(ConvertCommand, UsageErrors) {
  TempDir tmp;
  write_checkpoint(tmp / "ckpt");
  const std::string in = (tmp / "ckpt").string(), out = (tmp / "out").string();
  // No direction, a direction with an option of the other, an unknown format: nothing written.
  EXPECT_THROW(run_convert({"convert", in, out}), ConfigError);
  EXPECT_THROW(run_convert({"convert", "--from", "hf", in, out, "--dtype", "bf16"}), ConfigError);
  EXPECT_THROW(run_convert({"convert", "--to", "hf", in, out, "--model", "gpt2-tiny"}),
               ConfigError);
  EXPECT_THROW(run_convert({"convert", "--to", "onnx", in, out}), CLI::ValidationError);
  EXPECT_THROW(run_convert({"convert", "--to", "hf", "--from", "hf", in, out}), CLI::ExcludesError);
  EXPECT_THROW(run_convert({"convert", "--to", "hf", in}), CLI::RequiredError);
  // Sizes that are not sizes, or nothing: named with the flag.
  for (std::string bad : {"0", "-5GB", "5XB", "GB", "1.2.3MB"})
    EXPECT_THAT(error_of<ConfigError>([&] {
                  run_convert({"convert", "--to", "hf", in, out, "--shard-size", bad});
                }),
                HasSubstr("--shard-size '" + bad + "'"))
        << bad;
  EXPECT_THROW(run_convert({"convert", "--from", "hf", in, out, "--shard-size", "1GB"}),
               ConfigError);
  EXPECT_FALSE(fs::exists(out));
}

// --shard-size in transformers' units: a 40KB limit shards gpt2-tiny, 2GiB does not.
TEST(ConvertCommand, ShardSizeSetsTheFiles) {
  TempDir tmp;
  write_checkpoint(tmp / "ckpt");
  const std::string in = (tmp / "ckpt").string();
  auto [rc, out] =
      run_convert({"convert", "--to", "hf", in, (tmp / "a").string(), "--shard-size", "40KB"});
  EXPECT_EQ(rc, 0);
  EXPECT_THAT(out, HasSubstr("model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(tmp / "a" / "model.safetensors.index.json"));
  std::tie(rc, out) =
      run_convert({"convert", "--to", "hf", in, (tmp / "b").string(), "--shard-size", "2GiB"});
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(fs::exists(tmp / "b" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp / "b" / "model.safetensors.index.json"));
}

// `tessel init`: the initialiser's values, every parameter, bit for bit, at step 0.
TEST(ConvertCommand, InitWritesTheDeterministicInitialWeights) {
  TempDir tmp;
  CLI::App app;
  std::function<int()> action;
  add_init_command(app, action);
  std::vector<std::string> args = {
      "tessel", "init", "--model", "llama-tiny", "--seed", "7", (tmp / "ck").string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  app.parse(int(argv.size()), argv.data());
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(action(), 0);
  ::testing::internal::GetCapturedStdout();
  store::CheckpointReader r((tmp / "ck").string());
  r.verify();
  EXPECT_EQ(r.meta().at("step"), 0);
  const auto spec = model::ModelSpec::from(model::ModelConfig::preset("llama-tiny"));
  for (const auto& p : spec) {
    std::vector<float> want(size_t(p.numel()));
    model::init_full(p, 7, want.data());
    const Tensor got = r.read(p.name);
    ASSERT_EQ(got.numel(), p.numel()) << p.name;
    EXPECT_EQ(std::memcmp(got.data<float>(), want.data(), want.size() * 4), 0) << p.name;
  }
}

}  // namespace
}  // namespace tessel::cli
