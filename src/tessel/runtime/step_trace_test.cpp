// output.trace: the window of recorded steps, the merged file's tracks, and a real pipelined run
// whose trace holds every compute of its schedule on the rank that ran it.
#include "tessel/runtime/step_trace.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tessel/config/config_test_util.h"
#include "tessel/core/error.h"
#include "tessel/runtime/step_check_test_util.h"

namespace tessel::runtime {
namespace {

namespace fs = std::filesystem;
using config::testing::make_corpus;
using config::testing::write_config;
using tessel::testing::TempDir;

TEST(StepTracer, RecordsFromTheSecondStepOnly) {
  StepTracer t("unused.json", 2);
  const auto now = StepTracer::Clock::now();
  EXPECT_FALSE(t.begin_step());  // the launch's first step warms up
  t.slice("F0.0", "F", now, now);
  EXPECT_FALSE(t.active());
  EXPECT_TRUE(t.begin_step());
  EXPECT_TRUE(t.active());
  StepTracer off;
  EXPECT_FALSE(off.enabled());
  EXPECT_FALSE(off.begin_step());
  EXPECT_FALSE(off.begin_step());
}

TEST(StepTracer, MergesRanksIntoOneTrackEachFromTheEarliestSlice) {
  using S = StepTracer::Slice;
  const auto a = StepTracer::encode("rank 0 (dp 0, tp 0, pp 0)",
                                    {S{"step", "step", "", 1000, 50}, S{"F0.0", "F", "", 1010, 5}});
  const auto b =
      StepTracer::encode("rank 1 (dp 0, tp 0, pp 1)", {S{"wait recvA0.0<0", "wait", "", 990, 20}});
  const auto doc = nlohmann::json::parse(StepTracer::merged_json({a, b}));
  std::map<int, std::string> tracks;
  std::map<std::string, std::pair<double, int>> slices;  // name -> (ts, tid)
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"]] = e["args"]["name"];
    if (e["ph"] == "X") slices[e["name"]] = {e["ts"].get<double>(), e["tid"].get<int>()};
  }
  EXPECT_EQ(tracks[0], "rank 0 (dp 0, tp 0, pp 0)");
  EXPECT_EQ(tracks[1], "rank 1 (dp 0, tp 0, pp 1)");
  ASSERT_EQ(slices.size(), 3u);
  EXPECT_EQ(slices["wait recvA0.0<0"], std::make_pair(0.0, 1));  // the origin
  EXPECT_EQ(slices["step"], std::make_pair(10.0, 0));
  EXPECT_EQ(slices["F0.0"], std::make_pair(20.0, 0));
  EXPECT_EQ(doc["otherData"]["origin_unix_us"], 990);
}

TEST(StepTracer, AGarbledRankIsNamedNotCrashedOn) {
  EXPECT_THROW(StepTracer::merged_json({"{\"label\": \"r\", \"sli"}), CorruptDataError);
}

TEST(StepTracer, LaterGenerationsWriteBesideTheFirst) {
  EXPECT_EQ(StepTracer::path_of("/x/trace.json", 0), "/x/trace.json");
  EXPECT_EQ(StepTracer::path_of("/x/trace.json", 2), "/x/trace.g2.json");
  EXPECT_EQ(StepTracer::path_of("trace", 1), "trace.g1");
}

TEST(StepTracer, ABadStepCountIsAConfigError) {
  EXPECT_THROW(StepTracer("t.json", 0), ConfigError);
}

// Two pipeline ranks under 1F1B, m = 4, two traced steps: each rank's track holds a forward and a
// backward of every micro-batch per traced step, nested in the step's "pipeline" slice, and the
// stage-1 rank waits for activations the stage-0 rank sends.
TEST(StepTraceRun, APipelinedRunTracesEveryComputeOnItsRank) {
  TempDir dir;
  const auto corpus = make_corpus(dir);
  const auto cfg =
      write_config(dir, corpus,
                   "training: {steps: 4, global_batch: 8, micro_batch: 2, threads: 1}\n"
                   "optimizer: {lr: 0.01, warmup_steps: 1}\n"
                   "output: {trace: trace.json, trace_steps: 2}\n"
                   "parallel: {pp: 2, schedule: 1f1b}\n",
                   "trace.yaml", "gpt2-tiny");
  std::string out;
  ASSERT_EQ(testing::run_train(cfg, 2, &out), 0) << out;
  std::ifstream in(dir / "trace.json");
  ASSERT_TRUE(in.good()) << "no trace written\n" << out;
  const auto doc = nlohmann::json::parse(in);
  std::map<int, std::string> tracks;
  std::map<int, std::multiset<std::string>> names;
  std::map<int, std::vector<std::pair<double, double>>> pipelines;  // per track: [start, end)
  std::vector<std::tuple<int, double, double>> computes;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"]] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    const int tid = e["tid"];
    const std::string name = e["name"];
    names[tid].insert(name);
    const double ts = e["ts"], dur = e["dur"];
    EXPECT_GE(ts, 0.0);
    EXPECT_GE(dur, 0.0);
    if (name == "pipeline") pipelines[tid].push_back({ts, ts + dur});
    if (e["cat"] == "F" || e["cat"] == "B") computes.emplace_back(tid, ts, ts + dur);
  }
  ASSERT_EQ(tracks.size(), 2u);
  EXPECT_EQ(tracks[0], "rank 0 (dp 0, tp 0, pp 0)");
  EXPECT_EQ(tracks[1], "rank 1 (dp 0, tp 0, pp 1)");
  for (int tid : {0, 1}) {
    SCOPED_TRACE(tid);
    EXPECT_EQ(names[tid].count("step"), 2u);  // trace_steps
    EXPECT_EQ(names[tid].count("pipeline"), 2u);
    EXPECT_EQ(names[tid].count("optimizer"), 2u);
    EXPECT_EQ(names[tid].count("grad reduce"), 2u);
    for (int mb = 0; mb < 4; ++mb) {
      EXPECT_EQ(names[tid].count(fmt::format("F{}.0", mb)), 2u) << mb;
      EXPECT_EQ(names[tid].count(fmt::format("B{}.0", mb)), 2u) << mb;
    }
  }
  EXPECT_GE(names[1].count("wait recvA0.0<0"), 1u);  // stage 1 starts by waiting for stage 0
  // Every compute lies inside one of its rank's pipeline slices (1 us of rounding each side).
  for (const auto& [tid, t0, t1] : computes) {
    bool inside = false;
    for (const auto& [p0, p1] : pipelines[tid]) inside |= t0 >= p0 - 1 && t1 <= p1 + 1;
    EXPECT_TRUE(inside) << "compute at " << t0 << " on track " << tid;
  }
  EXPECT_FALSE(fs::exists(dir / "trace.json.tmp"));
}

}  // namespace
}  // namespace tessel::runtime
