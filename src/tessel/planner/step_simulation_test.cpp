// simulate_step on hand-built requests: gpt2-tiny (6 blocks, 8 units) at seq 16 on a profile
// whose blocks take F = Bi = Bw = 1 ms and whose embedding, head, links and optimizer are free,
// so stages with equally many blocks are equal and the simulated bubble is the analytic one.
// (cli/simulate_command_test.cpp runs the same model through `tessel simulate`.)
#include "tessel/planner/step_simulation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/layout/plan.h"
#include "tessel/planner/memory_model.h"
#include "tessel/planner/profile_test_util.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/named.h"

namespace tessel::planner {
namespace {

using ::testing::HasSubstr;

using testing::flat_profile_json;

SimulateRequest request(int pp, int v, int m, std::vector<int> layers,
                        layout::ScheduleKind schedule, int dp = 1) {
  SimulateRequest rq;
  rq.model = model::ModelConfig::preset("gpt2-tiny");
  const nlohmann::json doc = flat_profile_json();
  rq.cluster = from_profile_json(doc);
  rq.profile = compute_profile_from_json(doc, rq.model);
  rq.seq = 16;
  rq.plan.dp = dp;
  rq.plan.pp = pp;
  rq.plan.virtual_stages = v;
  rq.plan.micro_batch = 1;
  rq.plan.micro_batches = m;
  rq.plan.schedule = schedule;
  rq.plan.layers_per_stage = std::move(layers);
  return rq;
}

std::string error_of(const SimulateRequest& rq) {
  try {
    simulate_step(rq);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(SimulateStep, EqualStagesRunEachScheduleAtItsAnalyticBubble) {
  for (std::string_view name : schedule::schedule_names()) {
    const bool chunked = name == "interleaved-1f1b";
    // ZB-V: two chunks per rank as a V, 6 equal virtual stages (the embedding and head cost
    // nothing in the flat profile); p = 3, m = 6 is a shape where its scheduler reaches the bound
    // (schedule/zero_bubble.h).
    SimulateRequest rq =
        chunked
            ? request(3, 2, 6, {2, 1, 1, 1, 1, 2}, layout::ScheduleKind::interleaved_one_f_one_b)
        : name == "zb-v"
            ? request(3, 2, 6, {2, 1, 1, 1, 1, 2}, layout::ScheduleKind::interleaved_one_f_one_b)
            : request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
    rq.schedule = std::string(name);
    const SimulatedStep r = simulate_step(rq);
    const int p = rq.plan.pp, m = int(rq.plan.micro_batches), v = rq.plan.virtual_stages;
    EXPECT_EQ(r.schedule, name);
    EXPECT_DOUBLE_EQ(r.analytic_bubble, schedule::analytic_bubble(name, p, m, v)) << name;
    EXPECT_NEAR(r.sim.bubble_fraction(), r.analytic_bubble, 1e-9) << name;
    EXPECT_EQ(r.pipeline_s, r.sim.makespan);
    EXPECT_EQ(r.costs.size(), size_t(p * v));
    EXPECT_GE(r.step_s, r.pipeline_s);
  }
  // The greedy dispatcher with 1F1B's caps runs 1F1B's timeline.
  SimulateRequest rq = request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
  const SimulatedStep plan_schedule = simulate_step(rq);
  EXPECT_EQ(plan_schedule.schedule, "1f1b");
  EXPECT_NEAR(plan_schedule.pipeline_s, 45e-3, 1e-12);  // 5 slots of F + B, 3 blocks of 3 ms
  rq.schedule = "greedy";
  const SimulatedStep greedy = simulate_step(rq);
  EXPECT_NEAR(greedy.pipeline_s, plan_schedule.pipeline_s, 1e-12);
  EXPECT_DOUBLE_EQ(greedy.analytic_bubble, schedule::bubble_fraction(2, 4));
}

TEST(SimulateStep, PlanSchedulesAreNamedSchedules) {
  for (auto kind : {layout::ScheduleKind::gpipe, layout::ScheduleKind::one_f_one_b,
                    layout::ScheduleKind::interleaved_one_f_one_b})
    EXPECT_TRUE(schedule::is_schedule_name(layout::schedule_name(kind)))
        << layout::schedule_name(kind);
}

TEST(SimulateStep, BalancesAnEmptySplitByCost) {
  const SimulatedStep r = simulate_step(request(2, 1, 4, {}, layout::ScheduleKind::one_f_one_b));
  ASSERT_EQ(r.plan.layers_per_stage.size(), 2u);
  EXPECT_EQ(r.plan.layers_per_stage[0] + r.plan.layers_per_stage[1], 8);
  EXPECT_NEAR(r.pipeline_s, 45e-3, 1e-12);  // three blocks a stage, whichever split
  const auto model = model::ModelConfig::preset("gpt2-tiny");
  EXPECT_DOUBLE_EQ(r.rank_params[0] + r.rank_params[1],
                   double(model.num_params()) + double(model.padded_vocab()) * model.n_embd);
}

TEST(SimulateStep, DataParallelSyncByZeroStage) {
  const auto model = model::ModelConfig::preset("gpt2-tiny");
  const double n = double(model.num_params()), bytes = 4.0 * n;
  // ZeRO-0 with nothing overlapped: the whole all-reduce follows the last backward.
  SimulateRequest rq = request(1, 1, 2, {8}, layout::ScheduleKind::one_f_one_b, 2);
  rq.dp_overlap = 0;
  const SimulatedStep zero0 = simulate_step(rq);
  EXPECT_NEAR(zero0.dp_exposed_s, bytes / 1e9 + 1e-4, 1e-12);
  EXPECT_NEAR(zero0.pipeline_s, 2 * 6 * 3e-3, 1e-12);
  EXPECT_NEAR(zero0.step_s, zero0.pipeline_s + zero0.dp_exposed_s + zero0.collectives_s, 1e-12);
  // ZeRO-1: the reduce-scatter and the all-gather, each half the data, both exposed.
  rq.plan.zero_stage = 1;
  const SimulatedStep zero1 = simulate_step(rq);
  EXPECT_NEAR(zero1.dp_exposed_s, 2 * (0.5 * bytes / 1e9 + 1e-4), 1e-12);
  EXPECT_GT(zero1.collectives_s, zero0.collectives_s);  // the norm's all-reduce over dp
}

TEST(SimulateStep, RejectsWhatItCannotSimulate) {
  SimulateRequest rq = request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
  rq.schedule = "pipedream";
  EXPECT_THAT(error_of(rq), HasSubstr("simulate: unknown schedule 'pipedream' (known: gpipe, "
                                      "1f1b, interleaved-1f1b, zb-h1, zb-v, adaptive, greedy)"));
  SimulateRequest chunks =
      request(3, 2, 6, {2, 1, 1, 1, 1, 2}, layout::ScheduleKind::interleaved_one_f_one_b);
  for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
    chunks.schedule = name;
    EXPECT_THAT(error_of(chunks), HasSubstr(std::string("schedule ") + name +
                                            " runs one model chunk per rank, but the plan has "
                                            "virtual_stages 2"));
  }
  SimulateRequest slow = request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
  slow.slowdown = {1.0};
  EXPECT_THAT(error_of(slow), HasSubstr("1 slowdown factors for 2 pipeline ranks"));
  SimulateRequest overlap = request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
  overlap.dp_overlap = 1.5;
  EXPECT_THAT(error_of(overlap), HasSubstr("dp overlap 1.5 must be in [0, 1]"));
  SimulateRequest seq = request(2, 1, 4, {4, 4}, layout::ScheduleKind::one_f_one_b);
  seq.seq = 0;
  EXPECT_THAT(error_of(seq), HasSubstr("sequence length 0 is outside model 'gpt2-tiny'"));
}

}  // namespace
}  // namespace tessel::planner
