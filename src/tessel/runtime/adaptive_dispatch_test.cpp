// The adaptive schedule on real worker processes: every pipeline rank picks its next compute
// from what has arrived (schedule/dispatcher.h) instead of following a list. Per chunk it still
// runs the forwards, the backwards and the weight-gradient passes in micro-batch order, so every
// gradient sums its micro-batches in 1F1B's order: the run must be bit-identical to 1F1B
// (interleaved 1F1B with virtual stages, zb-v on the V placement) -- the same logged losses and
// the same saved state,
// byte for byte, Adam moments included -- whatever the timing. The timing is made adversarial
// with TESSEL_PIPELINE_DELAY: every rank sleeps a random 0 to 6 times each compute's duration,
// from its own seed, so arrivals interleave differently on every rank and every step, and the
// tightest memory cap (1 micro-batch) makes ranks wait on memory as well as on data. A
// deadlock would hang the run until the communicators' timeout and fail it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/runtime/pipeline_executor.h"
#include "tessel/runtime/step_check_test_util.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {
namespace {

namespace fs = std::filesystem;
using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

struct Case {
  std::string preset;
  int dp = 1, tp = 1, pp = 2, v = 1;
  int cap = 0;  // 0: 1F1B's budget
  std::string delay;
  bool v_shape = false;  // the V placement, against zb-v
  std::string reference() const { return v_shape ? "zb-v" : v == 1 ? "1f1b" : "interleaved-1f1b"; }
  std::string name() const {
    auto s = fmt::format("{}_dp{}_tp{}_pp{}_v{}{}_cap{}{}", preset, dp, tp, pp, v,
                         v_shape ? "_vshape" : "", cap, delay.empty() ? "" : "_delayed");
    for (char& ch : s)
      if (ch == '-') ch = '_';
    return s;
  }
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name();
}

class AdaptiveRun : public ::testing::TestWithParam<Case> {};

TEST_P(AdaptiveRun, IsBitIdenticalToOneFOneB) {
  const Case& c = GetParam();
  TempDir dir;
  const auto corpus = make_corpus(dir);
  // 12 samples per replica in micro-batches of 1: m = 12 / dp, a multiple of every pp here.
  auto run = [&](const std::string& tag, const std::string& schedule, const std::string& extra,
                 const std::string& env) {
    const auto cfg = write_config(
        dir, corpus,
        fmt::format("training: {{steps: 3, global_batch: 12, micro_batch: 1, threads: 1}}\n"
                    "optimizer: {{lr: 0.01, warmup_steps: 1}}\n"
                    "output: {{metrics: {0}.jsonl}}\ncheckpoint: {{dir: ck-{0}, every: 3}}\n"
                    "parallel: {{dp: {1}, tp: {2}, pp: {3}, virtual_stages: {4}, micro_batch: 1, "
                    "schedule: {5}{6}}}\n",
                    tag, c.dp, c.tp, c.pp, c.v, schedule, extra),
        tag + ".yaml", c.preset);
    std::string out;
    EXPECT_EQ(testing::run_train(cfg, c.dp * c.tp * c.pp, &out, env), 0) << out;
  };
  run("list", c.reference(), "", "");
  run("adaptive", "adaptive",
      (c.cap > 0 ? fmt::format(", memory_cap: {}", c.cap) : "") +
          (c.v_shape ? ", v_shape: true" : ""),
      c.delay.empty() ? "" : "TESSEL_PIPELINE_DELAY=" + c.delay);
  if (HasFailure()) return;

  const auto want = testing::read_step_losses(dir / "list.jsonl");
  ASSERT_EQ(want.size(), 3u);
  EXPECT_EQ(testing::read_step_losses(dir / "adaptive.jsonl"), want);
  const auto meta = testing::expect_same_latest_checkpoint(dir / "ck-list", dir / "ck-adaptive");
  EXPECT_NE(meta.at("plan").dump().find("adaptive"), std::string::npos) << meta.dump();
}

// slowdown 4, jitter 0.75: each compute is stretched to 1 to 7 times its duration.
std::vector<Case> cases() {
  const std::string adversarial = "slowdown=4,jitter=0.75,seed=11";
  return {
      {.preset = "gpt2-tiny", .pp = 2, .delay = ""},
      {.preset = "llama-tiny", .pp = 2, .delay = adversarial},
      {.preset = "gpt2-tiny", .pp = 3, .delay = adversarial},
      {.preset = "llama-tiny", .pp = 3, .cap = 1, .delay = "slowdown=4,jitter=0.75,seed=5"},
      {.preset = "gpt2-tiny", .pp = 4, .delay = adversarial},
      // Interleaved: chunks of one rank compete, and the cap binds across them.
      {.preset = "llama-tiny", .pp = 2, .v = 2, .delay = adversarial},
      {.preset = "gpt2-tiny", .pp = 2, .v = 2, .cap = 1, .delay = "slowdown=4,jitter=0.75,seed=2"},
      {.preset = "gpt2-tiny", .pp = 3, .v = 2, .cap = 2, .delay = adversarial},
      // With data and tensor parallelism around the pipeline (4 workers).
      {.preset = "llama-tiny", .dp = 2, .pp = 2, .delay = adversarial},
      {.preset = "gpt2-tiny", .tp = 2, .pp = 2, .cap = 1, .delay = adversarial},
      {.preset = "llama-tiny", .tp = 2, .pp = 2, .v = 2, .delay = adversarial},
      {.preset = "gpt2-tiny", .dp = 2, .pp = 2, .v = 2, .cap = 1, .delay = adversarial},
      // The V (untied models): against zb-v's fixed lists, whose Bw also run in micro-batch order.
      {.preset = "llama-tiny", .pp = 2, .v = 2, .delay = adversarial, .v_shape = true},
      {.preset = "llama-tiny", .pp = 3, .v = 2, .cap = 1, .delay = adversarial, .v_shape = true},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, AdaptiveRun, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name(); });

TEST(DelayInjection, ParsesEveryFieldAndNamesABadOne) {
  const auto d = DelayInjection::parse("stage=1,slowdown=1.5,jitter=0.25,seed=9");
  EXPECT_EQ(d.stage, 1);
  EXPECT_DOUBLE_EQ(d.slowdown, 1.5);
  EXPECT_DOUBLE_EQ(d.jitter, 0.25);
  EXPECT_EQ(d.seed, 9u);
  EXPECT_TRUE(d.active());
  EXPECT_FALSE(DelayInjection::parse("").active());
  EXPECT_FALSE(DelayInjection::parse("stage=2").active());
  const auto dilated = DelayInjection::parse("dilate=8,stage=3,slowdown=1.5");
  EXPECT_DOUBLE_EQ(dilated.dilate, 8);
  EXPECT_TRUE(DelayInjection::parse("dilate=2").active());
  // Dilated, a jitter around the stage's own speed leaves room for the fast half: 2 x 0.5 >= 1.
  EXPECT_DOUBLE_EQ(DelayInjection::parse("dilate=2,jitter=0.5").jitter, 0.5);
  for (const char* bad : {"slowdown=0.5", "jitter=-1", "jitter=0.5", "slowdown=2,jitter=1",
                          "dilate=1.5,jitter=0.5",
                          "stage=x", "speed=2", "stage", "seed=1.5", "dilate=0.5", "dilate=inf"}) {
    try {
      DelayInjection::parse(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("TESSEL_PIPELINE_DELAY"), std::string::npos) << e.what();
    }
  }
}

TEST(AdaptiveRunConfig, AMemoryCapNeedsTheAdaptiveScheduleAndAPositiveValue) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  auto message = [&](const std::string& parallel) {
    return config::testing::parallel_config_error(dir, corpus, parallel);
  };
  EXPECT_NE(message("{pp: 2, schedule: 1f1b, memory_cap: 2}").find("set schedule: adaptive"),
            std::string::npos);
  EXPECT_NE(message("{pp: 2, schedule: adaptive, memory_cap: -1}").find("negative"),
            std::string::npos);
  EXPECT_EQ(message("{pp: 2, schedule: adaptive, memory_cap: 1}"), "");
  EXPECT_EQ(message("{pp: 2, schedule: adaptive, virtual_stages: 2}"), "");
}

}  // namespace
}  // namespace tessel::runtime
