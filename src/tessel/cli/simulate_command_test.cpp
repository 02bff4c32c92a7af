// `tessel simulate` through a CLI::App built here, on a hand-written profile whose costs make
// every pipeline stage equal, so the simulated bubble must be the analytic one.
#include "tessel/cli/simulate_command.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessel/cli/cli_test_util.h"
#include "tessel/cli/plan_command.h"
#include "tessel/core/error.h"
#include "tessel/layout/plan.h"
#include "tessel/planner/memory_model.h"
#include "tessel/planner/profile_test_util.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/zero_bubble.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

// Parses `args` as the `tessel` command line and runs the chosen action, returning its stdout.
std::string run(const std::string& args) {
  int rc = -1;
  auto out = test_util::run_cli(args, {add_simulate_command, add_plan_command}, &rc);
  EXPECT_EQ(rc, 0) << args;
  return out;
}

nlohmann::json run_json(const std::string& args) {
  const std::string out = run(args + " --json");
  return nlohmann::json::parse(out);
}

// gpt2-tiny (6 blocks, 8 units) at seq 16: a block takes F = 1 ms, Bi = Bw = 1 ms; embedding and
// head are free, links are free and instant, the optimizer is free (no memory bandwidth), so
// stages with equally many blocks are equal. all_reduce has a real rate for the dp tests.
struct Fixture {
  testing::TempDir dir;
  std::string profile;
  std::string write(const std::string& name, const std::string& text) {
    const auto path = (dir / name).string();
    std::ofstream(path) << text;
    return path;
  }
  Fixture() { profile = write("profile.json", planner::testing::flat_profile_json().dump()); }
  // The same profile measured on 4 workers of 1 thread sharing 2 cores (its times hold for all
  // four computing at once, twice as slow as alone), with measured tp = 2 stages.
  std::string shared_profile() {
    nlohmann::json p = nlohmann::json::parse(std::ifstream(profile));
    p["workers"] = 4;
    p["cores"] = 2;
    p["threads_per_worker"] = 1;
    p["cpu_oversubscription"] = 2.0;
    p["tp_layer_times"] = {{{"seq", 16},
                            {"tp", 2},
                            {"points",
                             {{{"micro_batch", 1},
                               {"forward_s", 0.5e-3},
                               {"backward_s", 1e-3},
                               {"embedding_forward_s", 0},
                               {"embedding_backward_s", 0},
                               {"head_forward_s", 0},
                               {"head_backward_s", 0}}}}}};
    return write("shared.json", p.dump());
  }
  std::string plan(int pp, int v, int m, const std::vector<int>& layers,
                   const std::string& schedule, int dp = 1, int tp = 1) {
    layout::Plan p;
    p.dp = dp;
    p.tp = tp;
    p.pp = pp;
    p.virtual_stages = v;
    p.micro_batch = 1;
    p.micro_batches = m;
    p.schedule = layout::parse_schedule(schedule);
    p.layers_per_stage = layers;
    return write(fmt::format("plan-{}-{}-{}-{}-{}.json", pp, v, m, dp, tp),
                 layout::to_json(p).dump());
  }
  std::string base(const std::string& plan_file) {
    return fmt::format("simulate --plan {} --model gpt2-tiny --seq 16 --profile {}", plan_file,
                       profile);
  }
};

TEST(SimulateCommand, PrintsTheAnalyticBubbleForEqualStages) {
  Fixture f;
  // p = 2, m = 4: (p - 1) / (m + p - 1) = 20%.
  const std::string out = run(f.base(f.plan(2, 1, 4, {4, 4}, "1f1b")));
  EXPECT_NE(out.find("bubble 20.0% (analytic 20.0%"), std::string::npos) << out;
  EXPECT_NE(out.find("tessel simulate: gpt2-tiny"), std::string::npos) << out;
  EXPECT_NE(out.find("step "), std::string::npos) << out;
  // Makespan: (m + p - 1) slots of F + B = 3 blocks x 3 ms each.
  EXPECT_NE(out.find("pipeline  45.000 ms makespan"), std::string::npos) << out;
}

TEST(SimulateCommand, BubbleEqualsTheAnalyticOneOverAGrid) {
  Fixture f;
  // Splits of the 8 units into equal stages (embedding and head cost nothing).
  const std::map<int, std::vector<int>> splits = {
      {2, {4, 4}}, {3, {3, 2, 3}}, {6, {2, 1, 1, 1, 1, 2}}};
  for (const auto& [p, layers] : splits) {
    for (int m : {1, 2, 3, 6, 8}) {
      for (const std::string s : {"gpipe", "1f1b"}) {
        const auto doc = run_json(f.base(f.plan(p, 1, m, layers, s)));
        const double want = schedule::bubble_fraction(p, m);
        EXPECT_NEAR(doc.at("bubble").get<double>(), want, 1e-9) << s << " p " << p << " m " << m;
        EXPECT_NEAR(doc.at("analytic_bubble").get<double>(), want, 1e-12);
      }
      // The greedy dispatcher with 1F1B's caps runs 1F1B's timeline.
      const auto greedy = run_json(f.base(f.plan(p, 1, m, layers, "1f1b")) + " --schedule greedy");
      EXPECT_NEAR(greedy.at("bubble").get<double>(), schedule::bubble_fraction(p, m), 1e-9)
          << "greedy p " << p << " m " << m;
      // ZB-H1 with F = Bi = Bw: its own formula.
      const auto zb = run_json(f.base(f.plan(p, 1, m, layers, "1f1b")) + " --schedule zb-h1");
      EXPECT_NEAR(zb.at("bubble").get<double>(), schedule::zb_h1_bubble_fraction(p, m), 1e-9)
          << "zb-h1 p " << p << " m " << m;
    }
  }
  // Interleaved: p = 3, v = 2 over 6 equal virtual stages.
  for (int m : {3, 6, 9}) {
    const auto doc = run_json(f.base(f.plan(3, 2, m, {2, 1, 1, 1, 1, 2}, "interleaved-1f1b")));
    EXPECT_NEAR(doc.at("bubble").get<double>(), schedule::bubble_fraction(3, m, 2), 1e-9) << m;
  }
}

TEST(SimulateCommand, WritesAChromeTrace) {
  Fixture f;
  const auto trace = (f.dir / "step.trace.json").string();
  const std::string out = run(f.base(f.plan(2, 1, 4, {4, 4}, "1f1b")) + " --trace " + trace);
  EXPECT_NE(out.find("wrote the simulated pipeline to"), std::string::npos) << out;
  std::ifstream in(trace);
  ASSERT_TRUE(in.good());
  const auto doc = nlohmann::json::parse(in);
  int computes = 0, steps = 0;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    if (e.at("name") == "step") {
      ++steps;
    } else {
      ++computes;
    }
  }
  EXPECT_EQ(computes, 2 * 2 * 4);  // 2 stages x (F + B) x 4 micro-batches
  EXPECT_EQ(steps, 2);             // the (free) optimizer step of each stage
  EXPECT_GT(doc.at("otherData").at("step_s").get<double>(), 0);
}

TEST(SimulateCommand, StepAddsTheExposedGradientAllReduce) {
  Fixture f;
  // dp = 2, no pipeline: the whole gradient all-reduce follows the last backward when nothing may
  // overlap it.
  const auto doc = run_json(f.base(f.plan(1, 1, 2, {8}, "1f1b", 2)) + " --dp-overlap 0");
  const auto model = model::ModelConfig::preset("gpt2-tiny");
  const double bytes = 4.0 * double(model.num_params());
  const double ar = 2.0 * (2 - 1) / 2 * bytes / 1e9 + 1e-4;
  EXPECT_NEAR(doc.at("dp_exposed_s").get<double>(), ar, 1e-12);
  EXPECT_NEAR(doc.at("pipeline_s").get<double>(), 2 * 6 * 3e-3, 1e-12);
  // Loss and token-count all-reduces over dp = 2 (latency-bound), nothing else.
  EXPECT_GT(doc.at("collectives_s").get<double>(), 2e-4);
  EXPECT_NEAR(doc.at("step_s").get<double>(),
              doc.at("pipeline_s").get<double>() + ar + doc.at("collectives_s").get<double>(),
              1e-12);
  // The runtime's default 25 MiB bucket holds the whole gradient: it is complete only when the
  // backward ends, so nothing can overlap.
  const auto one_bucket = run_json(f.base(f.plan(1, 1, 2, {8}, "1f1b", 2)) + " --dp-overlap 0.8");
  EXPECT_NEAR(one_bucket.at("dp_exposed_s").get<double>(), ar, 1e-12);
  // Small buckets: those after the embedding (the first unit) complete during the last backward
  // and up to 80% of their all-reduce hides behind it; every bucket pays the latency.
  const double S = std::floor(0.01 * (1 << 20) / 4);  // elements per bucket
  const double n = double(model.num_params());
  const double emb = double(planner::unit_params(model, 0, 1));
  const double calls = std::ceil(n / S), early = std::floor((n - emb) / S);
  const double total = calls * 1e-4 + n * 4 / 1e9, hideable = early * 1e-4 + early * S * 4 / 1e9;
  const auto small =
      run_json(f.base(f.plan(1, 1, 2, {8}, "1f1b", 2)) + " --dp-overlap 0.8 --bucket-mb 0.01");
  EXPECT_NEAR(small.at("dp_exposed_s").get<double>(), total - std::min(0.8 * hideable, 6 * 2e-3),
              1e-12);
}

TEST(SimulateCommand, WorkersSharingCoresSlowDownWhileTheyComputeTogether) {
  Fixture f;
  const std::string shared = f.shared_profile();
  auto sim = [&](const std::string& plan) {
    return run_json(
        fmt::format("simulate --plan {} --model gpt2-tiny --seq 16 --profile {}", plan, shared));
  };
  // dp = 4: all four compute at once, as profiled: 6 blocks x 3 ms per micro-batch.
  const auto dp4 = sim(f.plan(1, 1, 1, {8}, "1f1b", 4));
  EXPECT_NEAR(dp4.at("pipeline_s").get<double>(), 6 * 3e-3, 1e-12);
  EXPECT_NEAR(dp4.at("cpu_slowdown").get<double>(), 2.0, 1e-12);
  // pp = 2 alone: two workers on two cores run at full speed, half the profiled times.
  const auto pp2 = sim(f.plan(2, 1, 4, {4, 4}, "1f1b"));
  EXPECT_NEAR(pp2.at("pipeline_s").get<double>(), 45e-3 / 2, 1e-12);
  EXPECT_NEAR(pp2.at("cpu_slowdown").get<double>(), 1.0, 1e-12);
  // dp = 2 x pp = 2: both stages busy 8 of the 5 x 9 ms slots (in full-speed units), i.e. 1.6
  // pipeline ranks of two processes each on average: a fixed point at 1.6 times full speed.
  const auto both = sim(f.plan(2, 1, 4, {4, 4}, "1f1b", 2));
  EXPECT_NEAR(both.at("cpu_slowdown").get<double>(), 1.6, 1e-3);
  EXPECT_NEAR(both.at("pipeline_s").get<double>(), 45e-3 / 2 * 1.6, 1e-4);
}

TEST(SimulateCommand, UsesMeasuredTensorParallelStages) {
  Fixture f;
  // The measured tp = 2 block (F 0.5 ms, B 1 ms, all-reduces included) replaces the estimate;
  // four workers at once as profiled (dp 2 x tp 2): 2 micro-batches x 6 blocks x 1.5 ms.
  const auto doc =
      run_json(fmt::format("simulate --plan {} --model gpt2-tiny --seq 16 --profile {}",
                           f.plan(1, 1, 2, {8}, "1f1b", 2, 2), f.shared_profile()));
  EXPECT_NEAR(doc.at("pipeline_s").get<double>(), 2 * 6 * 1.5e-3, 1e-12);
  // Without the measurement: tp = 1 times scaled and modelled all-reduces, another estimate.
  const auto est = run_json(f.base(f.plan(1, 1, 2, {8}, "1f1b", 2, 2)));
  EXPECT_GT(std::abs(est.at("pipeline_s").get<double>() - 2 * 6 * 1.5e-3), 1e-4);
}

TEST(SimulateCommand, SlowStageAndJitter) {
  Fixture f;
  const std::string plan = f.base(f.plan(2, 1, 4, {4, 4}, "1f1b"));
  const auto even = run_json(plan);
  const auto slow = run_json(plan + " --slow-stage 1:2");
  EXPECT_GT(slow.at("pipeline_s").get<double>(), even.at("pipeline_s").get<double>() * 1.5);
  const auto jitter = run_json(plan + " --jitter 0.2 --seed 7");
  EXPECT_NE(jitter.at("pipeline_s").get<double>(), even.at("pipeline_s").get<double>());
  EXPECT_THROW(run(plan + " --slow-stage 2:1.5"), ConfigError);
  EXPECT_THROW(run(plan + " --slow-stage one:1.5"), ConfigError);
  EXPECT_THROW(run(plan + " --schedule pipedream"), ConfigError);
  EXPECT_THROW(run(plan + " --jitter 1.5"), ConfigError);
}

TEST(SimulateCommand, ReportsPeakActivationMemoryPerStage) {
  Fixture f;
  const auto model = model::ModelConfig::preset("gpt2-tiny");
  const auto doc = run_json(f.base(f.plan(2, 1, 4, {4, 4}, "1f1b")));
  // 1F1B: stage 0 holds 2 micro-batches (emb + 3 blocks), stage 1 one (3 blocks + head).
  const double stage0 =
      planner::stage_activation_bytes(model, 0, 4, 1, 16, 1, planner::Precision::fp32,
                                      model::Recompute::none, false)
          .per_slot;
  const double stage1 =
      planner::stage_activation_bytes(model, 4, 8, 1, 16, 1, planner::Precision::fp32,
                                      model::Recompute::none, false)
          .per_slot;
  const auto& st = doc.at("stages");
  EXPECT_EQ(st[0].at("peak_in_flight").get<int>(), 2);
  EXPECT_EQ(st[1].at("peak_in_flight").get<int>(), 1);
  EXPECT_NEAR(st[0].at("peak_activation_bytes").get<double>(), 2 * stage0, 1e-6);
  EXPECT_NEAR(st[1].at("peak_activation_bytes").get<double>(), stage1, 1e-6);
}

TEST(SimulateCommand, TakesATrainConfigOrAPlanDocument) {
  Fixture f;
  const auto cfg = f.write("train.yaml", R"(model: {preset: gpt2-tiny}
data: {path: none.tok, seq_len: 16}
training: {steps: 1, global_batch: 8, micro_batch: 2}
parallel: {pp: 2, schedule: gpipe}
)");
  const auto doc = run_json(fmt::format("simulate --config {} --profile {}", cfg, f.profile));
  const auto plan = layout::plan_from_json(doc.at("plan"));
  EXPECT_EQ(plan.pp, 2);
  EXPECT_EQ(plan.micro_batches, 4);
  EXPECT_EQ(plan.schedule, layout::ScheduleKind::gpipe);
  EXPECT_EQ(plan.layers_per_stage,
            layout::default_layers_per_stage(model::ModelConfig::preset("gpt2-tiny"), 2, 1));
  EXPECT_EQ(doc.at("precision"), "fp32");
  EXPECT_GT(doc.at("step_s").get<double>(), 0);

  // `tessel plan --json` output goes straight in (model and seq from the document).
  const auto planned = f.write(
      "planned.json", run("plan --model gpt2-124m --cluster dgx-a100 --gpus 8 --global-batch 32 "
                          "--seq 512 --json"));
  const auto sim = run_json("simulate --plan " + planned + " --cluster dgx-a100");
  EXPECT_EQ(sim.at("seq").get<int>(), 512);
  EXPECT_EQ(sim.at("precision"), "bf16");
  EXPECT_GT(sim.at("step_s").get<double>(), 0);
  EXPECT_THROW(run("simulate --plan " + planned + " --config " + cfg), ConfigError);
  EXPECT_THROW(run("simulate --plan " + f.plan(2, 1, 4, {4, 4}, "1f1b") + " --seq 16 --profile " +
                   f.profile),
               ConfigError);  // no --model
}

}  // namespace
}  // namespace tessel::cli
