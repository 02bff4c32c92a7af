#include "tessel/planner/search.h"

#include "tessel/schedule/named.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "tessel/core/error.h"
#include "tessel/planner/simulator.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/named.h"

namespace tessel::planner {
namespace {

using layout::ScheduleKind;

// Every way to cut `costs` into `stages` non-empty contiguous parts; the best largest part.
double brute_force(const std::vector<double>& costs, int stages) {
  const int U = int(costs.size());
  double best = 1e300;
  std::function<void(int, int, double)> go = [&](int begin, int left, double worst) {
    if (left == 1) {
      double sum = 0;
      for (int u = begin; u < U; ++u) sum += costs[u];
      best = std::min(best, std::max(worst, sum));
      return;
    }
    double sum = 0;
    for (int end = begin + 1; end <= U - (left - 1); ++end) {
      sum += costs[end - 1];
      go(end, left - 1, std::max(worst, sum));
    }
  };
  go(0, stages, 0);
  return best;
}

void check_split(const std::vector<double>& costs, int stages, const StageSplit& s) {
  ASSERT_EQ(int(s.units_per_stage.size()), stages);
  int begin = 0;
  double worst = 0;
  for (int n : s.units_per_stage) {
    ASSERT_GE(n, 1);
    double sum = 0;
    for (int u = begin; u < begin + n; ++u) sum += costs[u];
    worst = std::max(worst, sum);
    begin += n;
  }
  EXPECT_EQ(begin, int(costs.size()));
  EXPECT_NEAR(worst, s.max_cost, 1e-9 * std::max(1.0, worst));
}

TEST(BalanceStages, OptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.0, 10.0);
  std::uniform_int_distribution<int> pick(0, 3);
  for (int trial = 0; trial < 400; ++trial) {
    const int U = 1 + trial % 11;
    std::vector<double> costs(U);
    for (auto& c : costs) {
      // A mix of distinct values, repeats (like identical layers) and zeros, to hit ties.
      const int kind = pick(rng);
      c = kind == 0 ? 0.0 : kind == 1 ? 1.0 : cost(rng);
    }
    for (int S = 1; S <= U; ++S) {
      const StageSplit s = balance_stages(costs, S);
      check_split(costs, S, s);
      EXPECT_NEAR(s.max_cost, brute_force(costs, S), 1e-9) << "trial " << trial << " S " << S;
    }
  }
}

TEST(BalanceStages, EmbeddingAndHeadHaveTheirOwnCosts) {
  // Embedding worth half a block, 11 blocks, a head worth 1.5 blocks, 4 stages. Under 3.5 the
  // stages could hold at most 2 + 3 + 3 + 1 blocks < 11, and 3.5 is reached only by
  // emb + 3 | 3 | 3 | 2 + head: uneven, the head's stage with fewer blocks.
  std::vector<double> costs(13, 1.0);
  costs[0] = 0.5;
  costs[12] = 1.5;
  const StageSplit s = balance_stages(costs, 4);
  EXPECT_DOUBLE_EQ(s.max_cost, 3.5);
  EXPECT_EQ(brute_force(costs, 4), 3.5);
  EXPECT_EQ(s.units_per_stage, (std::vector<int>{4, 3, 3, 3}));
  EXPECT_THROW(balance_stages(costs, 15), InvalidArgumentError);
  EXPECT_THROW(balance_stages(costs, 0), InvalidArgumentError);
  costs[3] = -1;
  EXPECT_THROW(balance_stages(costs, 2), InvalidArgumentError);
}

// Four CPU-like workers on one machine (the shape `tessel profile` describes).
ClusterSpec cpu_workers(int workers = 4, double memory_gib = 16) {
  nlohmann::json doc = {
      {"workers", workers},
      {"memory_bytes", int64_t(memory_gib * 1024 * 1024 * 1024)},
      {"memory_bandwidth_bytes_per_s", 2e10},
      {"flops", {{"fp32", 3e11}}},
      {"p2p", {{"bandwidth_bytes_per_s", 4e9}, {"latency_s", 3e-5}}},
      {"all_reduce", {{"bus_bandwidth_bytes_per_s", 1.5e9}, {"latency_s", 8e-5}}},
  };
  return from_profile_json(doc);
}

SearchRequest gpt2_on_cpus() {
  SearchRequest r;
  r.model = model::ModelConfig::preset("gpt2-124m");
  r.cluster = cpu_workers();
  r.global_batch = 16;
  r.seq = 256;
  r.precision = Precision::fp32;
  return r;
}

TEST(Search, FindsAFeasiblePlanForGpt2OnFourCpus) {
  const SearchRequest req = gpt2_on_cpus();
  const SearchResult res = search(req);
  ASSERT_TRUE(res.feasible()) << res.infeasible;
  EXPECT_GT(res.evaluated, 0);
  EXPECT_LE(int(res.ranked.size()), req.options.top_k);
  for (size_t i = 0; i < res.ranked.size(); ++i) {
    const Candidate& c = res.ranked[i];
    SCOPED_TRACE(c.plan.describe());
    EXPECT_NO_THROW(c.plan.validate(req.model, req.global_batch, 4));
    EXPECT_LE(c.memory_bytes, c.capacity_bytes);
    if (i > 0) {
      EXPECT_GE(c.step_s, res.ranked[i - 1].step_s);
    }
    EXPECT_GT(c.mfu, 0);
    EXPECT_LE(c.mfu, 1);
    EXPECT_NEAR(c.tokens_per_s, 16.0 * 256 / c.step_s, 1e-6 * c.tokens_per_s);
    // The pipeline runs v*m slots of the slowest stage stretched by the schedule's bubble (for
    // gpipe, 1F1B and interleaved 1F1B: v*m + p - 1 slots); dp sync and optimizer follow. The
    // named schedules' bubbles are analytic; the dispatcher's and just-in-time recomputation's
    // are simulated (Search.SimulatedBubbles...).
    EXPECT_NEAR(
        c.pipeline_s,
        double(c.plan.virtual_stages * c.plan.micro_batches) * c.max_stage_s / (1 - c.bubble),
        1e-12 * c.pipeline_s);
    if (c.plan.schedule != ScheduleKind::adaptive && !c.plan.jit_recompute) {
      EXPECT_NEAR(c.bubble,
                  schedule::analytic_bubble(layout::schedule_name(c.plan.schedule), c.plan.pp,
                                            int(c.plan.micro_batches), c.plan.virtual_stages),
                  1e-12);
    }
    if (c.plan.schedule == ScheduleKind::one_f_one_b && !c.plan.jit_recompute) {
      EXPECT_NEAR(c.pipeline_s, double(c.plan.micro_batches + c.plan.pp - 1) * c.max_stage_s,
                  1e-12 * c.pipeline_s);
    }
    EXPECT_GE(c.step_s, c.pipeline_s + c.dp_exposed_s + c.optimizer_s - 1e-12);
    // The memory agrees with the memory model on the returned plan.
    const auto mem = estimate_memory(req.model, c.plan, req.seq, req.precision, req.cluster.device);
    EXPECT_DOUBLE_EQ(mem.peak().total(), c.memory_bytes);
    // Scoring the returned plan again gives the same prediction.
    EXPECT_NEAR(predict(req, c.plan).step_s, c.step_s, 1e-12 * c.step_s);
  }
  // The best plan's JSON is what the runtime reads back.
  const layout::Plan& best = res.best().plan;
  const layout::Plan back =
      layout::plan_from_json(nlohmann::json::parse(layout::to_json(best).dump()));
  EXPECT_EQ(back, best);
  EXPECT_NO_THROW(back.validate(req.model, req.global_batch, 4));
  const auto j = to_json(res.best());
  EXPECT_EQ(layout::plan_from_json(j.at("plan")), best);
  EXPECT_DOUBLE_EQ(j.at("step_s").get<double>(), res.best().step_s);
}

TEST(Search, PredictBalancesAnEmptySplitAndRejectsInvalidPlans) {
  const SearchRequest req = gpt2_on_cpus();
  layout::Plan p;
  p.pp = 4;
  p.micro_batch = 2;
  p.micro_batches = 8;
  const Candidate c = predict(req, p);
  EXPECT_EQ(c.plan.layers_per_stage.size(), 4u);
  EXPECT_GT(c.step_s, 0);
  // Uneven balanced split beats (or ties) the default one.
  layout::Plan d = p.with_defaults(req.model);
  EXPECT_LE(c.step_s, predict(req, d).step_s + 1e-12);
  // The slowest stage sets the pace: piling the blocks onto stage 0 is slower.
  layout::Plan lopsided = p;
  lopsided.layers_per_stage = {11, 1, 1, 1};
  const Candidate l = predict(req, lopsided);
  EXPECT_GT(l.max_stage_s, 1.5 * c.max_stage_s);
  EXPECT_GT(l.step_s, c.step_s);
  EXPECT_GT(l.memory_bytes, c.memory_bytes);
  p.micro_batches = 7;  // 2 x 7 != 16
  EXPECT_THROW(predict(req, p), ConfigError);
}

TEST(Search, OptionsRestrictTheSpace) {
  SearchRequest req = gpt2_on_cpus();
  req.options.schedules = {ScheduleKind::gpipe};
  req.options.zero_stages = {0};
  req.options.recompute = {true};
  req.options.max_micro_batch = 2;
  req.options.top_k = 3;
  const SearchResult res = search(req);
  ASSERT_TRUE(res.feasible()) << res.infeasible;
  EXPECT_LE(res.ranked.size(), 3u);
  for (const auto& c : res.ranked) {
    EXPECT_EQ(c.plan.schedule, ScheduleKind::gpipe);
    EXPECT_EQ(c.plan.zero_stage, 0);
    EXPECT_EQ(c.plan.recompute, model::Recompute::full);
    EXPECT_LE(c.plan.micro_batch, 2);
  }
}

// The zero-bubble schedules' pipelines are their analytic bubbles over the same slots: a
// pipeline plan of ZB-H1 predicts less pipeline time than the same plan under 1F1B, ZB-V (two
// half-size chunks as a V) less again; ZB-V is never offered for a tied model (rank 0 would hold
// the embedding twice) and every plan the search returns validates.
TEST(Search, ZeroBubbleSchedulesShortenThePipeline) {
  SearchRequest req = gpt2_on_cpus();
  req.model.tie_embeddings = false;
  req.options.schedules = {ScheduleKind::one_f_one_b, ScheduleKind::zb_h1, ScheduleKind::zb_v};
  req.options.zero_stages = {0};
  req.options.recompute = {false};
  req.options.top_k = 200;
  const SearchResult res = search(req);
  ASSERT_TRUE(res.feasible()) << res.infeasible;
  std::map<std::tuple<int, int, int, int64_t>, std::map<ScheduleKind, double>> pipeline;
  bool zb_v = false;
  for (const auto& c : res.ranked) {
    EXPECT_NO_THROW(c.plan.validate(req.model, req.global_batch, 4)) << c.plan.describe();
    if (c.plan.schedule == ScheduleKind::zb_v) {
      zb_v = true;
      EXPECT_EQ(c.plan.virtual_stages, 2);
    }
    if (c.plan.virtual_stages == 1 || c.plan.schedule == ScheduleKind::zb_v)
      pipeline[{c.plan.dp, c.plan.tp, c.plan.pp, c.plan.micro_batch}][c.plan.schedule] =
          c.pipeline_s;
  }
  EXPECT_TRUE(zb_v);
  int compared = 0;
  for (const auto& [layout, by] : pipeline) {
    if (!by.contains(ScheduleKind::one_f_one_b) || !by.contains(ScheduleKind::zb_h1)) continue;
    EXPECT_LT(by.at(ScheduleKind::zb_h1), by.at(ScheduleKind::one_f_one_b));
    ++compared;
  }
  EXPECT_GT(compared, 0);
  req.model.tie_embeddings = true;
  for (const auto& c : search(req).ranked) EXPECT_NE(c.plan.schedule, ScheduleKind::zb_v);
}

// The dispatcher and just-in-time recomputation have no closed-form bubble: the search simulates
// them (the dispatcher on unit stages, F = Bi = Bw = 1, B = 2; the recomputations on the plan's
// stages and links) and, beyond m = 9p, extends the makespan linearly from m = 8p + m mod p.
// Checked here against a direct simulation at the full m, and against the named schedules at
// the same layout: the dispatcher, at 1F1B's memory with split backward, is faster than 1F1B and
// not faster than ZB-H1 (which holds more on later ranks); just-in-time recomputation is slower
// than keeping activations and faster than full recomputation, which recomputes inside every
// backward, the last stage's included; and the slower the links, the more of it the wait for
// the gradient hides.
layout::Plan pipeline_plan(ScheduleKind s, int64_t m) {
  layout::Plan p;
  p.pp = 4;
  p.dp = 1;
  p.tp = 1;
  p.micro_batch = 1;
  p.micro_batches = m;
  p.schedule = s;
  return p;
}

TEST(Search, DispatcherAndJustInTimeRecomputeHaveSimulatedBubbles) {
  SearchRequest req = gpt2_on_cpus();
  for (int64_t m : {int64_t(16), int64_t(64)}) {
    req.global_batch = m;
    SCOPED_TRACE(m);
    const auto one_f_one_b = predict(req, pipeline_plan(ScheduleKind::one_f_one_b, m));
    const auto zb_h1 = predict(req, pipeline_plan(ScheduleKind::zb_h1, m));
    const auto adaptive = predict(req, pipeline_plan(ScheduleKind::adaptive, m));
    auto jit_plan = pipeline_plan(ScheduleKind::one_f_one_b, m);
    jit_plan.jit_recompute = true;
    const auto jit = predict(req, jit_plan);
    auto full_plan = pipeline_plan(ScheduleKind::one_f_one_b, m);
    full_plan.recompute = model::Recompute::full;
    const auto full = predict(req, full_plan);

    // The same as simulating the whole step (the linear extension is exact: the steady state
    // repeats every p micro-batches).
    GreedyOptions g;
    g.stages = 4;
    g.micro_batches = int(m);
    g.split_backward = true;
    for (int r = 0; r < 4; ++r) g.stage_memory_caps.push_back(adaptive.plan.dispatch_cap(r));
    SimConfig cfg = uniform_config(4, 1, StageCosts{});
    EXPECT_NEAR(adaptive.bubble, 1 - 3.0 * double(m) / simulate_greedy(g, cfg).makespan, 1e-12);
    EXPECT_LT(adaptive.pipeline_s, one_f_one_b.pipeline_s);
    EXPECT_GE(adaptive.pipeline_s, zb_h1.pipeline_s * (1 - 1e-12));
    EXPECT_LE(adaptive.memory_bytes, zb_h1.memory_bytes);
    EXPECT_GT(jit.pipeline_s, one_f_one_b.pipeline_s);
    EXPECT_LT(jit.pipeline_s, full.pipeline_s);
    EXPECT_LT(jit.memory_bytes, one_f_one_b.memory_bytes);
    EXPECT_TRUE(jit.plan.jit_recompute);

    SearchRequest slow = req;
    nlohmann::json doc = {
        {"workers", 4},
        {"memory_bytes", int64_t(16) << 30},
        {"memory_bandwidth_bytes_per_s", 2e10},
        {"flops", {{"fp32", 3e11}}},
        {"p2p", {{"bandwidth_bytes_per_s", 4e7}, {"latency_s", 3e-3}}},
        {"all_reduce", {{"bus_bandwidth_bytes_per_s", 1.5e9}, {"latency_s", 8e-5}}},
    };
    slow.cluster = from_profile_json(doc);
    const double jit_cost = jit.pipeline_s / one_f_one_b.pipeline_s;
    const double slow_jit_cost =
        predict(slow, jit_plan).pipeline_s /
        predict(slow, pipeline_plan(ScheduleKind::one_f_one_b, m)).pipeline_s;
    EXPECT_LT(slow_jit_cost, jit_cost);
  }
}

// `tessel plan` chooses them where they are the fastest that fits: the dispatcher over 1F1B when
// the zero-bubble lists are not among the choices, and just-in-time recomputation when keeping
// every micro-batch's activations does not fit.
TEST(Search, ChoosesTheDispatcherAndJustInTimeRecomputeWhereTheyWin) {
  SearchRequest req = gpt2_on_cpus();
  req.options.schedules = {ScheduleKind::one_f_one_b, ScheduleKind::adaptive};
  req.options.jit_recompute = {false};
  req.options.top_k = 200;
  const SearchResult res = search(req);
  ASSERT_TRUE(res.feasible()) << res.infeasible;
  // Per pipelined layout, the dispatcher ranks before 1F1B.
  std::map<std::tuple<int, int, int, int64_t, int>, size_t> first;
  for (size_t i = 0; i < res.ranked.size(); ++i) {
    const auto& p = res.ranked[i].plan;
    if (p.pp > 1) first.try_emplace({p.dp, p.tp, p.pp, p.micro_batch, int(p.schedule)}, i);
  }
  int compared = 0;
  for (const auto& [k, i] : first) {
    const auto& [dp, tp, pp, b, s] = k;
    if (s != int(ScheduleKind::one_f_one_b)) continue;
    auto it = first.find({dp, tp, pp, b, int(ScheduleKind::adaptive)});
    if (it == first.end()) continue;
    EXPECT_LT(it->second, i) << res.ranked[i].plan.describe();
    ++compared;
  }
  EXPECT_GT(compared, 0);

  // Memory for 1F1B keeping activations at pp 4, m 16, but not for the micro-batches after the
  // first on rank 0: just-in-time recomputation fits and beats full recomputation.
  req = gpt2_on_cpus();
  req.global_batch = 16;
  req.options.schedules = {ScheduleKind::one_f_one_b};
  req.options.zero_stages = {0};
  req.options.max_micro_batch = 1;
  req.options.top_k = 200;
  const auto keep = predict(req, pipeline_plan(ScheduleKind::one_f_one_b, 16));
  auto jit_plan = pipeline_plan(ScheduleKind::one_f_one_b, 16);
  jit_plan.jit_recompute = true;
  const auto jit = predict(req, jit_plan);
  ASSERT_LT(jit.memory_bytes, keep.memory_bytes);
  const double gib = 1024.0 * 1024 * 1024;
  req.cluster = cpu_workers(
      4, (jit.memory_bytes + 0.25 * (keep.memory_bytes - jit.memory_bytes)) / gib / 0.9);
  // The device's usable share: from_profile_json keeps 10% back (checked, not assumed).
  const double usable = double(req.cluster.device.usable_bytes());
  ASSERT_LT(jit.memory_bytes, usable);
  ASSERT_GT(keep.memory_bytes, usable);
  const SearchResult tight = search(req);
  ASSERT_TRUE(tight.feasible()) << tight.infeasible;
  bool any_jit = false;
  for (const auto& c : tight.ranked) {
    EXPECT_LE(c.memory_bytes, usable);
    if (c.plan.jit_recompute) {
      any_jit = true;
      EXPECT_EQ(c.plan.recompute, model::Recompute::none);
      EXPECT_NO_THROW(c.plan.validate(req.model, req.global_batch, 4));
    }
  }
  EXPECT_TRUE(any_jit);
  // The pipeline of 4 stages that `keep` was: just-in-time recomputation is its best variant.
  bool found = false;
  for (const auto& c : tight.ranked) {
    if (c.plan.pp != 4 || c.plan.dp != 1) continue;
    found = true;
    EXPECT_TRUE(c.plan.jit_recompute) << c.plan.describe();
  }
  EXPECT_TRUE(found);
}

TEST(Search, TensorParallelStaysOnAHost) {
  SearchRequest req;
  req.model = model::ModelConfig::preset("gpt2-350m");
  req.cluster = ClusterSpec::preset("dgx-a100").with_devices(32);
  req.global_batch = 64;
  req.seq = 1024;
  req.options.top_k = 50;
  const SearchResult res = search(req);
  ASSERT_TRUE(res.feasible()) << res.infeasible;
  for (const auto& c : res.ranked) {
    EXPECT_EQ(8 % c.plan.tp, 0) << c.plan.describe();
    EXPECT_NO_THROW(c.plan.validate(req.model, 64, 32));
    EXPECT_LE(c.memory_bytes, c.capacity_bytes);
  }
  // A 350M model fits one GPU: plain data parallelism is among the best.
  EXPECT_EQ(res.best().plan.pp * res.best().plan.tp, 1) << res.best().plan.describe();
}

TEST(Search, ModelThatFitsNowhereSaysWhatWouldFit) {
  SearchRequest req;
  req.model = model::ModelConfig::preset("gpt3-175b");
  req.cluster = ClusterSpec::preset("dgx-a100").with_devices(8);
  req.global_batch = 64;
  req.seq = 2048;
  const SearchResult res = search(req);
  ASSERT_FALSE(res.feasible());
  const std::string& msg = res.infeasible;
  EXPECT_NE(msg.find("no layout of model 'gpt3-175b' fits"), std::string::npos) << msg;
  // 8 devices: at most tp 8 x pp 1 or tp 1 x pp 8; the smallest is named with its parts.
  EXPECT_NE(msg.find("the smallest (tp "), std::string::npos) << msg;
  EXPECT_NE(msg.find("recompute"), std::string::npos) << msg;
  EXPECT_NE(msg.find("GiB per device on stage 0, has 78.0 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer"), std::string::npos) << msg;
  try {
    res.best();
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the smallest"), std::string::npos);
  }
  // The suggested device count really fits (with a batch its dp divides).
  // (Parsed by hand: GCC 12 warns inside <regex> under the sanitizers, and warnings are errors.)
  const std::string key = "use >= ";
  const size_t at = msg.find(key);
  ASSERT_NE(at, std::string::npos) << msg;
  ASSERT_NE(msg.find(" devices", at), std::string::npos) << msg;
  const int need = std::stoi(msg.substr(at + key.size()));
  EXPECT_GT(need, 8);
  req.cluster = ClusterSpec::preset("dgx-a100").with_devices(need);
  req.global_batch = need;
  EXPECT_TRUE(search(req).feasible()) << need;
  // and one host fewer does not.
  req.cluster = ClusterSpec::preset("dgx-a100").with_devices(need - 8);
  req.global_batch = need - 8;
  EXPECT_FALSE(search(req).feasible()) << need - 8;
}

// The hint is the search's own minimum for hosts of this kind, whatever part of a host was asked
// for: 1, 4 or 8 devices of a DGX give the same answer (whole 8-device hosts, tp up to 8).
TEST(Search, TheDeviceHintDoesNotDependOnThePartOfAHostAskedFor) {
  std::vector<std::string> hints;
  for (int devices : {1, 4, 8}) {
    SearchRequest req;
    req.model = model::ModelConfig::preset("gpt3-175b");
    req.cluster = ClusterSpec::preset("dgx-a100").with_devices(devices);
    req.global_batch = 8;
    req.seq = 2048;
    const auto res = search(req);
    ASSERT_FALSE(res.feasible());
    const size_t at = res.infeasible.find("use >= ");
    ASSERT_NE(at, std::string::npos) << res.infeasible;
    hints.push_back(res.infeasible.substr(at, res.infeasible.find(' ', at + 7) - at));
  }
  EXPECT_EQ(hints[0], hints[2]);
  EXPECT_EQ(hints[1], hints[2]);
}

TEST(Search, BatchThatDividesNoLayoutGetsTheValidValues) {
  // gpt2-tiny (8 units, 4 heads) on 64 devices: tp <= 4 and pp <= 8, so dp >= 2 — an odd
  // global batch divides no layout.
  SearchRequest req;
  req.model = model::ModelConfig::preset("gpt2-tiny");
  req.cluster = ClusterSpec::preset("dgx-a100").with_devices(64);
  req.global_batch = 3;
  req.seq = 64;
  const SearchResult res = search(req);
  ASSERT_FALSE(res.feasible());
  const std::string& msg = res.infeasible;
  EXPECT_NE(msg.find("global batch 3 does not divide"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dp in {2, 4, 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple of 2 (e.g. 2 or 4)"), std::string::npos) << msg;
  req.global_batch = 4;
  EXPECT_TRUE(search(req).feasible());
}

TEST(Search, RejectsRequestsThatCannotBeSearched) {
  SearchRequest req = gpt2_on_cpus();
  req.seq = 4096;
  try {
    search(req);
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("max_seq_len 1024"), std::string::npos) << e.what();
  }
  req = gpt2_on_cpus();
  req.global_batch = 0;
  EXPECT_THROW(search(req), ConfigError);
  req = gpt2_on_cpus();
  req.precision = Precision::bf16;  // the profile measured only fp32
  EXPECT_THROW(search(req), ConfigError);
  req = gpt2_on_cpus();
  req.options.zero_stages = {2};
  EXPECT_THROW(search(req), ConfigError);
}

TEST(Search, LessMemoryPushesTowardsFrugalPlans) {
  // With ample memory the best gpt2-124m plan needs no recompute; squeezed, every plan that is
  // left fits the smaller device.
  SearchRequest req = gpt2_on_cpus();
  req.global_batch = 64;
  const SearchResult roomy = search(req);
  ASSERT_TRUE(roomy.feasible());
  const double need = roomy.best().memory_bytes;
  req.cluster = cpu_workers(4, need * 0.6 / (1024.0 * 1024 * 1024));
  const SearchResult tight = search(req);
  ASSERT_TRUE(tight.feasible()) << tight.infeasible;
  EXPECT_LE(tight.best().memory_bytes, need * 0.6);
  EXPECT_GE(tight.best().step_s, roomy.best().step_s);
  EXPECT_GT(tight.rejected_memory, roomy.rejected_memory);
}

}  // namespace
}  // namespace tessel::planner
