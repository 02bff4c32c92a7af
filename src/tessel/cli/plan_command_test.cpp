// `tessel plan` through a CLI::App built here (parse, run the chosen action, read what it printed).
#include "tessel/cli/plan_command.h"

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessel/cli/cli_test_util.h"
#include "tessel/core/error.h"
#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

// Parses `args` as the `tessel` command line and runs the plan action, returning its stdout.
std::string run_plan(const std::string& args, int* status = nullptr) {
  return test_util::run_cli(args, {add_plan_command}, status);
}

TEST(PlanCommand, PrintsARankedTable) {
  int rc = -1;
  const std::string out = run_plan(
      "plan --model gpt2-124m --cluster dgx-a100 --gpus 8 --global-batch 64 --seq 1024 --top 4",
      &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_NE(out.find("gpt2-124m"), std::string::npos) << out;
  EXPECT_NE(out.find("8 x A100-SXM4-80GB"), std::string::npos) << out;
  EXPECT_NE(out.find("tokens/s"), std::string::npos) << out;
  EXPECT_NE(out.find("MFU"), std::string::npos) << out;
  EXPECT_NE(out.find("\n  1 "), std::string::npos) << out;
  EXPECT_NE(out.find("\n  4 "), std::string::npos) << out;
  EXPECT_EQ(out.find("\n  5 "), std::string::npos) << out;
  EXPECT_NE(out.find("best: dp="), std::string::npos) << out;
  EXPECT_NE(out.find("bf16"), std::string::npos) << out;
}

TEST(PlanCommand, JsonCarriesTheBestPlanAndAlternatives) {
  testing::TempDir dir;
  const auto out_file = (dir / "plan.json").string();
  const std::string out = run_plan(
      "plan --model gpt2-350m --cluster dgx-h100 --gpus 16 --global-batch 32 --seq 512 --top 3 "
      "--json --out " +
      out_file);
  const auto doc = nlohmann::json::parse(out);
  const layout::Plan best = layout::plan_from_json(doc.at("plan"));
  const auto model = model::ModelConfig::preset("gpt2-350m");
  EXPECT_NO_THROW(best.validate(model, 32, 16));
  EXPECT_EQ(doc.at("devices"), 16);
  EXPECT_EQ(doc.at("cluster"), "dgx-h100");
  ASSERT_TRUE(doc.at("alternatives").is_array());
  EXPECT_GE(doc.at("alternatives").size(), 1u);
  EXPECT_LE(doc.at("alternatives").size(), 3u);
  EXPECT_EQ(layout::plan_from_json(doc.at("alternatives")[0].at("plan")), best);
  for (const auto& alt : doc.at("alternatives")) {
    EXPECT_NO_THROW(layout::plan_from_json(alt.at("plan")).validate(model, 32, 16));
    EXPECT_GT(alt.at("tokens_per_s").get<double>(), 0);
  }
  EXPECT_GT(doc.at("predicted").at("step_s").get<double>(), 0);
  EXPECT_GT(doc.at("predicted").at("mfu").get<double>(), 0);
  EXPECT_FALSE(doc.at("predicted").contains("plan"));
  // --out holds exactly the best plan.
  std::ifstream in(out_file);
  const layout::Plan written = layout::plan_from_json(nlohmann::json::parse(in));
  EXPECT_EQ(written, best);
}

TEST(PlanCommand, ClusterFromYamlAndPrecision) {
  testing::TempDir dir;
  std::ofstream(dir / "lab.yaml") << "preset: dgx-a100\nname: lab\ndevice: {memory_gib: 40}\n";
  const std::string out =
      run_plan("plan --model gpt2-124m --cluster " + (dir / "lab.yaml").string() +
               " --gpus 4 --global-batch 8 --seq 256 --precision fp32 --json");
  const auto doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc.at("cluster"), "lab");
  EXPECT_EQ(doc.at("precision"), "fp32");
  EXPECT_EQ(doc.at("seq"), 256);
  EXPECT_LE(doc.at("predicted").at("capacity_gib").get<double>(), 40.0);
}

TEST(PlanCommand, ThisMachineFromAProfile) {
  testing::TempDir dir;
  std::ofstream(dir / "profile.json") << R"({
    "workers": 2, "memory_bytes": 8589934592, "flops": {"fp32": 2e11},
    "p2p": {"bandwidth_bytes_per_s": 4e9, "latency_s": 3e-5},
    "all_reduce": {"bus_bandwidth_bytes_per_s": 1.5e9, "latency_s": 8e-5},
    "layer_times": {"seq": 64, "points": [
      {"micro_batch": 1, "forward_s": 0.01, "backward_s": 0.02, "embedding_forward_s": 0.001,
       "embedding_backward_s": 0.001, "head_forward_s": 0.02, "head_backward_s": 0.04}]}})";
  const std::string out =
      run_plan("plan --model gpt2-tiny --cluster this-machine --profile " +
               (dir / "profile.json").string() + " --global-batch 8 --seq 64 --json");
  const auto doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc.at("cluster"), "this-machine");
  EXPECT_EQ(doc.at("devices"), 2);
  EXPECT_EQ(doc.at("precision"), "fp32");  // the profile has no bf16 rate
  EXPECT_NO_THROW(layout::plan_from_json(doc.at("plan"))
                      .validate(model::ModelConfig::preset("gpt2-tiny"), 8, 2));
  // --profile alone means this machine; with another cluster it is a mistake.
  EXPECT_NE(run_plan("plan --model gpt2-tiny --profile " + (dir / "profile.json").string() +
                     " --global-batch 8 --seq 64")
                .find("this-machine"),
            std::string::npos);
  EXPECT_THROW(run_plan("plan --model gpt2-tiny --cluster dgx-a100 --profile " +
                        (dir / "profile.json").string() + " --global-batch 8"),
               ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-tiny --cluster this-machine --global-batch 8"),
               ConfigError);
}

// A train config's model section plans any model (not only the presets), with its seq_len and
// global batch unless flags say otherwise; exactly one of --model and --config.
TEST(PlanCommand, PlansTheModelOfATrainConfig) {
  testing::TempDir dir;
  const auto cfg = (dir / "train.yaml").string();
  std::ofstream(cfg) << "model: {family: llama, n_layer: 4, n_embd: 256, n_head: 8, "
                        "n_kv_head: 4, vocab_size: 32000, max_seq_len: 512, name: mine}\n"
                        "data: {path: d.tok, seq_len: 256}\n"
                        "training: {steps: 2, global_batch: 16, micro_batch: 2}\n";
  auto doc = nlohmann::json::parse(run_plan("plan --config " + cfg + " --gpus 4 --json"));
  EXPECT_EQ(doc.at("model"), "mine");
  EXPECT_EQ(doc.at("seq"), 256);
  EXPECT_EQ(doc.at("global_batch"), 16);
  model::ModelConfig mine = model::ModelConfig::preset("llama-tiny");
  mine.n_layer = 4;
  mine.n_embd = 256;
  mine.n_head = 8;
  mine.n_kv_head = 4;
  mine.ffn_hidden = model::ModelConfig::default_ffn_hidden(model::Family::llama, 256);
  mine.vocab_size = 32000;
  mine.max_seq_len = 512;
  EXPECT_NO_THROW(layout::plan_from_json(doc.at("plan")).validate(mine, 16, 4));
  doc = nlohmann::json::parse(
      run_plan("plan --config " + cfg + " --gpus 4 --seq 128 --global-batch 32 --json"));
  EXPECT_EQ(doc.at("seq"), 128);
  EXPECT_EQ(doc.at("global_batch"), 32);
  EXPECT_THROW(run_plan("plan --gpus 4 --global-batch 8"), ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-tiny --config " + cfg + " --global-batch 8"),
               ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-tiny --gpus 4"), ConfigError);  // no batch
}

TEST(PlanCommand, InfeasibleRequestsSayWhy) {
  try {
    run_plan("plan --model gpt3-175b --cluster dgx-a100 --gpus 8 --global-batch 64 --seq 2048");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no layout of model 'gpt3-175b' fits"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("use >= "), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_plan("plan --model gpt2-124m --cluster dgx-z --global-batch 8"), ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-nope --global-batch 8"), ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-124m --gpus 12 --global-batch 8"), ConfigError);
  EXPECT_THROW(run_plan("plan --model gpt2-124m --global-batch 8 --top 0"), ConfigError);
  // Without a config, the batch is required.
  EXPECT_THROW(run_plan("plan --model gpt2-124m"), ConfigError);
  // Counts out of range are CLI11 parse errors, never a silent default.
  for (const char* bad : {"--gpus 0", "--gpus -8", "--seq 0", "--global-batch 0"}) {
    CLI::App app{"test"};
    std::function<int()> action;
    add_plan_command(app, action);
    EXPECT_THROW(app.parse(std::string("plan --model gpt2-124m --global-batch 8 ") + bad, false),
                 CLI::ParseError)
        << bad;
  }
}

}  // namespace
}  // namespace tessel::cli

namespace tessel::cli {
namespace {

// The graph planner on an ONNX file (src/tessel/planner/testdata/gpt_block.onnx, written by
// tools/make_test_onnx.py): one GPT-2 block of 32 operators with a symbolic batch dimension.
std::string gpt_block() {
  return std::string(TESSEL_SOURCE_DIR) + "/src/tessel/planner/testdata/gpt_block.onnx";
}

TEST(PlanOnnx, ShardsEveryOperatorAndCutsTheGraph) {
  testing::TempDir dir;
  const auto out_file = (dir / "graph-plan.json").string();
  int rc = -1;
  const std::string out =
      run_plan("plan --onnx " + gpt_block() +
                   " --dim batch=8 --tp 2 --stages 2 --balance 0.5 --json --out " + out_file,
               &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["tp"], 2);
  EXPECT_EQ(doc["status"], "optimal");
  EXPECT_EQ(doc["optimal_programmes"], doc["programmes"]);
  ASSERT_EQ(doc["operators"].size(), 33u);  // 32 operators and the input
  int matmuls = 0;
  for (const auto& op : doc["operators"]) {
    EXPECT_TRUE(op.contains("strategy")) << op.dump();
    EXPECT_TRUE(op.contains("stage")) << op.dump();
    matmuls += op["kind"] == "matmul";
  }
  EXPECT_EQ(matmuls, 6);  // qkv, q k^T, p v, proj, fc, proj
  ASSERT_TRUE(doc.contains("cut"));
  EXPECT_EQ(doc["cut"]["status"], "optimal");
  // Attention (QKV and the projection) against the MLP: a block's best balance at one tensor.
  ASSERT_EQ(doc["cut"]["stage_flops"].size(), 2u);
  EXPECT_FALSE(doc["runnable"].get<bool>());
  std::ifstream in(out_file);
  EXPECT_EQ(nlohmann::json::parse(in), doc);

  const std::string table = run_plan("plan --onnx " + gpt_block() + " --dim batch=8 --tp 2", &rc);
  EXPECT_EQ(rc, 0) << table;
  EXPECT_NE(table.find("33 operators"), std::string::npos) << table;
  EXPECT_NE(table.find("attn.qkv"), std::string::npos) << table;
  EXPECT_NE(table.find("not runnable"), std::string::npos) << table;
  EXPECT_NE(table.find("step: "), std::string::npos) << table;
}

// --mesh: the block's sharding on 2 hosts x 4 devices, one strategy per axis for every operator.
TEST(PlanOnnx, ShardsOnATwoAxisMesh) {
  int rc = -1;
  const std::string out =
      run_plan("plan --onnx " + gpt_block() + " --dim batch=8 --mesh 2x4 --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["mesh"], nlohmann::json::array({2, 4}));
  EXPECT_EQ(doc["status"], "optimal");
  ASSERT_EQ(doc["operators"].size(), 33u);
  for (const auto& op : doc["operators"])
    EXPECT_NE(op["strategy"].get<std::string>().find(" x "), std::string::npos) << op.dump();
  const std::string table =
      run_plan("plan --onnx " + gpt_block() + " --dim batch=8 --mesh 2x4", &rc);
  EXPECT_NE(table.find("on a mesh of 2x4"), std::string::npos) << table;
}

// A graph past one programme's size (GPT-2 124M: 249 operators) is sharded on the mesh by
// segments joined by dynamic programming, most (head, tail) pairs skipped by their bounds; a
// model whose training state fits no sharding of the mesh is one clear error naming the fix.
TEST(PlanGraph, ShardsALargeGraphOnAMeshBySegments) {
  int rc = -1;
  const std::string out = run_plan("plan --graph --model gpt2-124m --mesh 2x4 --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["status"], "optimal");
  EXPECT_EQ(doc["segments"], 28);
  EXPECT_EQ(doc["programmes"].get<int>(), doc["optimal_programmes"].get<int>());
  EXPECT_GT(doc["pruned"].get<int>(), 0);
  for (const auto& op : doc["operators"]) {
    if (op["kind"] != "input") {
      EXPECT_NE(op["strategy"].get<std::string>().find(" x "), std::string::npos) << op.dump();
    }
  }
  try {
    run_plan("plan --graph --model llama2-7b --mesh 1x1");
    ADD_FAILURE() << "7B parameters' training state fit one device";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("raise --tp or --stages (or use a larger mesh)"),
              std::string::npos)
        << e.what();
  }
}

TEST(PlanOnnx, BadInputIsOneClearError) {
  auto error_of = [](const std::string& args) {
    try {
      run_plan(args);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("plan --onnx " + gpt_block()).find("--dim batch=VALUE"), std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch").find("NAME=VALUE"),
            std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch=8 --tp 16").find("tp 16"),
            std::string::npos);
  EXPECT_NE(error_of("plan --onnx missing.onnx").find("no such file"), std::string::npos);
  // Within 10% no cut exists: the MLP's matmuls are single operators.
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch=8 --stages 2").find("--balance"),
            std::string::npos);
  EXPECT_NE(error_of("plan --graph --onnx " + gpt_block()).find("--model"), std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch=8 --mesh 2x16").find("a host"),
            std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch=8 --mesh 2xfour").find("HOSTSx"),
            std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --dim batch=8 --mesh 2x4 --tp 4")
                .find("leave out --tp"),
            std::string::npos);
  EXPECT_NE(error_of("plan --onnx " + gpt_block() + " --model gpt2-124m").find("leave out"),
            std::string::npos);
}

}  // namespace
}  // namespace tessel::cli
