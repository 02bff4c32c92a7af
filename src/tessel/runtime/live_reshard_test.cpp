// Live re-partitioning: a run whose config switches plans at step boundaries (`timeline:`) moves
// the whole training state between the workers and continues; every step of it, the ones right
// after a switch included, equals one single-process step from the state the run saved before it
// (losses, parameters and Adam moments within the float32 bounds of step_check_test_util.h), like
// a run that never switched. Real processes:
// `tessel train CONFIG --nproc N`, N the largest world of the timeline (processes without a rank in
// the current plan wait for the switch that gives them one, or leave).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/reference_trainer.h"
#include "tessel/runtime/step_check_test_util.h"

namespace tessel::runtime {

using checkpoint::checkpoint_step_name;
using config::TrainConfig;
namespace {

using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

constexpr int kSteps = 8;

const std::string kTraining = fmt::format(
    "training: {{steps: {}, global_batch: 12, micro_batch: 2, threads: 1}}\n"
    "optimizer: {{lr: 0.01, warmup_steps: 1}}\n"
    "output: {{metrics: metrics.jsonl, events: events.jsonl, rank_params: dump}}\n",
    kSteps);

std::vector<nlohmann::json> read_records(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

// rank0.params of output.rank_params (one rank holding every whole tensor: a (1,1,1) last plan).
std::map<std::string, std::vector<float>> read_whole_dump(const std::filesystem::path& path) {
  std::map<std::string, std::vector<float>> out;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path << " was not written";
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream head(line);
    std::string name;
    int64_t numel = 0;
    head >> name >> numel;
    std::vector<float> v(static_cast<size_t>(numel));
    in.read(reinterpret_cast<char*>(v.data()), std::streamsize(numel * sizeof(float)));
    out[name] = std::move(v);
  }
  return out;
}

void expect_switching_run_matches(const std::string& preset, const std::string& plans, int nproc) {
  SCOPED_TRACE(preset + "\n" + plans);
  TempDir dir;
  auto corpus = make_corpus(dir);
  const auto single_cfg = write_config(dir, corpus, kTraining, "single.yaml", preset);
  auto cfg = write_config(dir, corpus, kTraining + plans + testing::every_step_checkpoints(kSteps),
                          "live.yaml", preset);
  std::filesystem::create_directories(dir / "dump");
  auto bin = tessel::testing::tessel_binary();
  std::string out;
  int rc = tessel::testing::run_command(
      fmt::format("OMP_NUM_THREADS=1 {} train {} --nproc {}", bin.string(), cfg, nproc), &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("switched from"), std::string::npos) << out;
  auto records = read_records(dir / "metrics.jsonl");
  ASSERT_EQ(int64_t(records.size()), kSteps) << out;
  std::map<int64_t, double> losses;
  for (size_t i = 0; i < records.size(); ++i) {
    losses[records[i].at("step").get<int64_t>()] = records[i].at("loss").get<double>();
    EXPECT_EQ(records[i].value("cursor", int64_t(-1)), int64_t(12 * (i + 1))) << "step " << i;
  }
  testing::expect_steps_match_one_process(single_cfg, dir / "steps", losses, 1, kSteps);
  // One event line per switch, with its costs.
  auto cfg_loaded = TrainConfig::load(cfg);
  auto events = read_records(dir / "events.jsonl");
  ASSERT_EQ(events.size(), cfg_loaded.timeline.size());
  for (size_t i = 0; i < events.size(); ++i) {
    const int64_t at = cfg_loaded.timeline[i].at_step;
    EXPECT_EQ(events[i].at("step").get<int64_t>(), at);
    // Each switch was announced elastic.prepare_steps ahead (not before the previous one), its
    // buffers built while training went on.
    if (cfg_loaded.prepare_steps > 0) {
      const int64_t previous = i > 0 ? cfg_loaded.timeline[i - 1].at_step : 0;
      EXPECT_EQ(events[i].value("announced_at_step", int64_t(-1)),
                std::max(previous, at - cfg_loaded.prepare_steps))
          << events[i].dump();
    } else {
      EXPECT_FALSE(events[i].contains("announced_at_step")) << events[i].dump();
    }
    EXPECT_EQ(events[i].at("new_workers").get<int>(), cfg_loaded.timeline[i].plan.world());
    if (cfg_loaded.reshard_transport == "network") {
      // Nothing read from another process's memory: every byte between processes went over the
      // transition world's connections.
      EXPECT_EQ(events[i].at("bytes_read_directly").get<int64_t>(), 0) << events[i].dump();
      EXPECT_EQ(events[i].at("bytes_over_network").get<int64_t>(),
                events[i].at("bytes_moved").get<int64_t>())
          << events[i].dump();
    }
    EXPECT_GE(events[i].at("total_pause_s").get<double>(),
              events[i].at("transfer_s").get<double>());
  }
  // The last plan is (1,1,1): rank 0 holds every tensor whole, as the final checkpoint has them.
  auto dump = read_whole_dump(dir / "dump" / "rank0.params");
  ReferenceTrainer saved(TrainConfig::load(single_cfg));
  saved.load_checkpoint((dir / "steps" / checkpoint_step_name(kSteps)).string());
  const float* ref = saved.model().params().data<float>();
  for (const auto& v : saved.model().param_views()) {
    ASSERT_TRUE(dump.count(v.name)) << v.name;
    ASSERT_EQ(int64_t(dump[v.name].size()), v.numel) << v.name;
    EXPECT_EQ(std::memcmp(dump[v.name].data(), ref + v.offset, size_t(v.numel) * sizeof(float)), 0)
        << v.name << " differs from the final checkpoint";
  }
}

// The sequence: dp 2 -> (tp 2 x pp 2: two processes join) -> one process (three leave).
TEST(LiveReshard, DataToTensorAndPipelineToOneProcess) {
  const std::string plans =
      "parallel: {dp: 2}\n"
      "timeline:\n"
      "  - {at_step: 3, parallel: {tp: 2, pp: 2}}\n"
      "  - {at_step: 6, parallel: {dp: 1}}\n";
  expect_switching_run_matches("gpt2-tiny", plans, 4);
  // Everything built during the pauses (nothing announced ahead), the state sent over the
  // network (no direct reads).
  expect_switching_run_matches(
      "llama-tiny", plans + "elastic: {prepare_steps: 0, reshard_transport: network}\n", 4);
}

// ZeRO-1 flat ranges and interleaved stages on both sides of a switch, shrinking and growing.
TEST(LiveReshard, ZeroOneAndInterleavedAcrossSwitches) {
  expect_switching_run_matches("gpt2-tiny",
                               "parallel: {dp: 2, pp: 2, zero_stage: 1, micro_batch: 3}\n"
                               "timeline:\n"
                               "  - {at_step: 2, parallel: {dp: 3, zero_stage: 1}}\n"
                               "  - {at_step: 4, parallel: {pp: 2, virtual_stages: 2, schedule: "
                               "interleaved-1f1b}}\n"
                               "  - {at_step: 6, parallel: {dp: 1}}\n",
                               4);
}

// Worker counts instead of plans: the planner picks each plan (4 -> 2 -> 3 -> 4 workers), and the
// run still matches one process. The last plan must hold every tensor whole on rank 0 for the
// final-parameter check, so the run ends with a (1,1,1) switch.
TEST(LiveReshard, WorkerCountsThroughThePlanner) {
  expect_switching_run_matches("gpt2-tiny",
                               "parallel: {dp: 4}\n"
                               "timeline:\n"
                               "  - {at_step: 2, workers: 2}\n"
                               "  - {at_step: 3, workers: 3}\n"
                               "  - {at_step: 5, workers: 4}\n"
                               "  - {at_step: 7, parallel: {dp: 1}}\n",
                               4);
}

TEST(LiveReshard, TimelineMistakesAreConfigErrors) {
  TempDir dir;
  auto load_error = [&](const std::string& extra) -> std::string {
    try {
      TrainConfig::load(write_config(dir, (dir / "none.tok").string(), kTraining + extra));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(load_error("timeline:\n  - {at_step: 9, parallel: {dp: 2}}\n").find("before"),
            std::string::npos);
  EXPECT_NE(load_error("timeline:\n  - {at_step: 3, parallel: {dp: 2}}\n"
                       "  - {at_step: 3, parallel: {dp: 1}}\n")
                .find("must increase"),
            std::string::npos);
  EXPECT_NE(load_error("timeline:\n  - {parallel: {dp: 2}}\n").find("at_step"), std::string::npos);
  EXPECT_NE(
      load_error("timeline:\n  - {at_step: 3, workers: 2, parallel: {dp: 2}}\n").find("either"),
      std::string::npos);
  EXPECT_NE(load_error("timeline:\n  - {at_step: 3, workers: 0}\n").find("must be >= 1"),
            std::string::npos);
  EXPECT_NE(
      load_error("timeline:\n  - {at_step: 3, parallel: {tp: 3}}\n").find("timeline[0].parallel"),
      std::string::npos)
      << load_error("timeline:\n  - {at_step: 3, parallel: {tp: 3}}\n");
  EXPECT_NE(load_error("timeline:\n  - {at_step: 3, parallel: {dp: 2, timeout_s: 4}}\n")
                .find("timeout_s"),
            std::string::npos);
  EXPECT_NE(load_error("timeline: {at_step: 3}\n").find("must be a list"), std::string::npos);
  auto cfg = TrainConfig::load(write_config(
      dir, (dir / "none.tok").string(),
      kTraining + "parallel: {dp: 2}\ntimeline:\n  - {at_step: 3, parallel: {tp: 2, pp: 2}}\n"));
  EXPECT_EQ(cfg.max_workers(), 4);
  EXPECT_EQ(cfg.generation_at(2), 0);
  EXPECT_EQ(cfg.generation_at(3), 1);
  EXPECT_EQ(cfg.plan_at(5).tp, 2);
  try {
    cfg.validate_for_workers(2);
    ADD_FAILURE() << "2 workers accepted for a timeline that needs 4";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--nproc 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessel::runtime
