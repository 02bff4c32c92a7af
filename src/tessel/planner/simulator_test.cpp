#include "tessel/planner/simulator.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tessel/core/error.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/validate.h"
#include "tessel/schedule/zero_bubble.h"

namespace tessel::planner {
namespace {

using schedule::Op;
using schedule::Schedule;
using ::testing::HasSubstr;

constexpr int kStages[] = {1, 2, 3, 4, 8};
constexpr int kMicroBatches[] = {1, 2, 4, 8, 16};

// F = 1, B = 2, Bi = Bw = 1 (StageCosts' defaults, the same as validate's DryRunCosts), free
// communication.
SimConfig unit(int stages, int chunks = 1) {
  return uniform_config(stages, chunks, StageCosts{});
}

int compute_count(const Schedule& s, int stage) {
  const auto& list = s.per_stage[size_t(stage)];
  return int(std::count_if(list.begin(), list.end(),
                           [](const schedule::Instruction& in) { return is_compute(in.op); }));
}

// Checks what must hold for any run: per stage, the timeline holds every compute plus one step
// in time order without overlap, busy is its total, and the makespan is the last end.
void expect_consistent(const SimResult& r, const Schedule* s = nullptr) {
  ASSERT_EQ(r.timeline.size(), size_t(r.stages));
  double last = 0;
  for (int stage = 0; stage < r.stages; ++stage) {
    const auto& t = r.timeline[size_t(stage)];
    if (s) {
      EXPECT_EQ(int(t.size()), compute_count(*s, stage) + 1) << "stage " << stage;
    }
    double busy = 0, clock = 0;
    for (const TimelineEntry& e : t) {
      EXPECT_GE(e.start, clock) << "stage " << stage;
      EXPECT_GE(e.end, e.start);
      busy += e.end - e.start;
      clock = e.end;
    }
    ASSERT_FALSE(t.empty());
    EXPECT_EQ(t.back().op, Op::optimizer_step);
    EXPECT_NEAR(r.busy[size_t(stage)], busy, 1e-9);
    last = std::max(last, clock);
  }
  EXPECT_DOUBLE_EQ(r.makespan, last);
}

// Acceptance: with no jitter, equal stages and free communication the simulated bubble equals
// the analytic one for every generator, and the run agrees with validate()'s independent dry run.
TEST(Simulator, BubbleEqualsAnalyticForEveryScheduleOnGrid) {
  for (int p : kStages)
    for (int m : kMicroBatches) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      struct Case {
        Schedule schedule;
        double analytic;
      };
      std::vector<Case> cases = {
          {schedule::gpipe(p, m), schedule::bubble_fraction(p, m)},
          {schedule::one_f_one_b(p, m), schedule::bubble_fraction(p, m)},
          {schedule::zb_h1(p, m), schedule::zb_h1_bubble_fraction(p, m)},
      };
      if (m % p == 0)
        for (int v : {2, 3})
          cases.push_back(
              {schedule::interleaved_one_f_one_b(p, m, v), schedule::bubble_fraction(p, m, v)});
      for (const Case& c : cases) {
        SCOPED_TRACE(fmt::format("{} v={}", c.schedule.name, c.schedule.chunks));
        SimConfig config = unit(p, c.schedule.chunks);
        for (StageCosts& sc : config.costs) sc.activation_bytes = 3;
        SimResult r = simulate(c.schedule, config);
        EXPECT_NEAR(r.bubble_fraction(), c.analytic, 1e-9);
        schedule::DryRun d = schedule::validate(c.schedule);
        EXPECT_DOUBLE_EQ(r.makespan, d.makespan);
        EXPECT_EQ(r.busy, d.busy);
        EXPECT_EQ(r.peak_in_flight, d.peak_in_flight);
        for (int s = 0; s < p; ++s)
          EXPECT_DOUBLE_EQ(r.peak_activation_bytes[size_t(s)], 3.0 * d.peak_in_flight[size_t(s)]);
        expect_consistent(r, &c.schedule);
      }
    }
}

TEST(Simulator, TimelineOfTwoStagesWithCommunicationByHand) {
  // One micro-batch over two stages: F on 0, message, F and B on 1, message, B on 0.
  SimConfig c = uniform_config(2, 1, {.forward = 1, .backward = 2, .output_bytes = 100});
  c.links.assign(4, Link{});
  c.links[0 * 2 + 1] = {.latency = 0.5, .bandwidth = 100};  // 1.5 for the activation
  c.links[1 * 2 + 0] = {.latency = 0.25, .bandwidth = 50};  // 2.25 for the gradient
  c.optimizer_step = {0.5, 0.125};
  SimResult r = simulate(schedule::one_f_one_b(2, 1), c);
  using E = TimelineEntry;
  EXPECT_EQ(r.timeline[0], (std::vector<E>{{Op::forward, 0, 0, 0, 1},
                                           {Op::backward, 0, 0, 7.75, 9.75},
                                           {Op::optimizer_step, -1, -1, 9.75, 10.25}}));
  EXPECT_EQ(r.timeline[1], (std::vector<E>{{Op::forward, 0, 0, 2.5, 3.5},
                                           {Op::backward, 0, 0, 3.5, 5.5},
                                           {Op::optimizer_step, -1, -1, 5.5, 5.625}}));
  EXPECT_DOUBLE_EQ(r.makespan, 10.25);
  EXPECT_EQ(r.busy, (std::vector<double>{3.5, 3.125}));
  EXPECT_DOUBLE_EQ(r.bubble_fraction(), 1 - 6.625 / 20.5);
  // The greedy dispatcher has no choice here and must agree.
  SimResult g = simulate_greedy({.stages = 2, .micro_batches = 1, .memory_cap = 1}, c);
  EXPECT_EQ(g.timeline, r.timeline);
}

TEST(Simulator, ChunksOfOneStageHandOverLocally) {
  // p = 1: no messages, so link costs must not matter.
  SimConfig c = unit(1, 3);
  c.link = {.latency = 100, .bandwidth = 1};
  for (StageCosts& sc : c.costs) sc.output_bytes = 1000;
  SimResult r = simulate(schedule::interleaved_one_f_one_b(1, 2, 3), c);
  EXPECT_DOUBLE_EQ(r.makespan, 2 * 3 * 3.0);
  EXPECT_DOUBLE_EQ(r.bubble_fraction(), 0);
}

TEST(Simulator, PeakBytesFollowPerVirtualStageSizes) {
  // GPipe holds all m micro-batches; interleaved holds chunks of different sizes at once.
  SimConfig c = unit(2);
  c.costs[0].activation_bytes = 10;
  c.costs[1].activation_bytes = 7;
  SimResult g = simulate(schedule::gpipe(2, 4), c);
  EXPECT_EQ(g.peak_in_flight, (std::vector<int>{4, 4}));
  EXPECT_EQ(g.peak_activation_bytes, (std::vector<double>{40, 28}));

  SimConfig ci = unit(2, 2);
  for (int vs = 0; vs < 4; ++vs) ci.costs[size_t(vs)].activation_bytes = 1 << vs;  // 1 2 4 8
  Schedule s = schedule::interleaved_one_f_one_b(2, 2, 2);
  SimResult r = simulate(s, ci);
  // Recount from the timeline: +bytes at each F's start, -bytes at each B's end.
  for (int stage = 0; stage < 2; ++stage) {
    std::vector<std::pair<double, double>> deltas;  // (time, change); releases sort first
    for (const TimelineEntry& e : r.timeline[size_t(stage)]) {
      if (e.op != Op::forward && e.op != Op::backward) continue;  // chunk -1 for the step
      double bytes = 1 << (e.chunk * 2 + stage);
      if (e.op == Op::forward) deltas.push_back({e.start, bytes});
      if (e.op == Op::backward) deltas.push_back({e.end, -bytes});
    }
    std::sort(deltas.begin(), deltas.end());
    double now = 0, peak = 0;
    for (auto [t, d] : deltas) peak = std::max(peak, now += d);
    EXPECT_DOUBLE_EQ(r.peak_activation_bytes[size_t(stage)], peak) << "stage " << stage;
    EXPECT_GT(peak, 0);
  }
}

TEST(Simulator, SlowdownScalesEveryComputeOfItsStage) {
  SimConfig c = unit(3);
  c.slowdown = {1, 2.5, 1};
  c.optimizer_step = {1, 1, 1};
  Schedule s = schedule::one_f_one_b(3, 4);
  SimResult r = simulate(s, c);
  EXPECT_DOUBLE_EQ(r.busy[0], 4 * 3 + 1);
  EXPECT_DOUBLE_EQ(r.busy[1], 2.5 * (4 * 3 + 1));
  for (const TimelineEntry& e : r.timeline[1]) {
    if (e.op == Op::forward) {
      EXPECT_DOUBLE_EQ(e.end - e.start, 2.5);
    }
  }
  // The slow stage cannot start before stage 0's first forward.
  EXPECT_GE(r.makespan, 1 + r.busy[1]);
  EXPECT_GT(r.makespan, simulate(s, unit(3)).makespan);
  expect_consistent(r, &s);
}

TEST(Simulator, JitterIsDeterministicPerSeedAndBounded) {
  Schedule s = schedule::one_f_one_b(4, 8);
  SimConfig c = unit(4);
  c.jitter = 0.2;
  c.seed = 7;
  SimResult a = simulate(s, c), b = simulate(s, c);
  EXPECT_EQ(a.timeline, b.timeline);
  EXPECT_EQ(a.makespan, b.makespan);
  c.seed = 8;
  SimResult other = simulate(s, c);
  EXPECT_NE(other.timeline, a.timeline);
  // Every duration is within 20% of its cost, and they do vary.
  double lo = 10, hi = 0;
  for (const auto& stage : a.timeline)
    for (const TimelineEntry& e : stage) {
      if (e.op == Op::optimizer_step) continue;
      double base = e.op == Op::forward ? 1 : 2;
      double f = (e.end - e.start) / base;
      lo = std::min(lo, f);
      hi = std::max(hi, f);
    }
  EXPECT_GE(lo, 0.8);
  EXPECT_LT(hi, 1.2);
  EXPECT_GT(hi - lo, 0.1);
  // No jitter: exactly the plain costs whatever the seed.
  c.jitter = 0;
  EXPECT_DOUBLE_EQ(simulate(s, c).makespan, 3.0 * (8 + 4 - 1));
}

TEST(Simulator, JitRecomputeHoldsOneMicroBatchAndCostsItsForwards) {
  const Schedule keep = schedule::one_f_one_b(3, 6);
  const Schedule jit = schedule::with_jit_recompute(keep);
  SimConfig c = unit(3);
  c.costs.assign(3, StageCosts{.activation_bytes = 100});
  const SimResult a = simulate(keep, c), b = simulate(jit, c);
  // 1F1B holds p - s micro-batches; with jit recomputation every stage holds one.
  EXPECT_THAT(a.peak_in_flight, ::testing::ElementsAre(3, 2, 1));
  EXPECT_THAT(b.peak_in_flight, ::testing::ElementsAre(1, 1, 1));
  EXPECT_THAT(b.peak_activation_bytes, ::testing::ElementsAre(100, 100, 100));
  // Each R costs a forward: stage 0 is busier by one forward per recomputation.
  int recomputes = 0;
  for (const auto& in : jit.per_stage[0]) recomputes += in.op == Op::recompute;
  EXPECT_GT(recomputes, 0);
  EXPECT_DOUBLE_EQ(b.busy[0], a.busy[0] + recomputes * 1.0);
  EXPECT_GE(b.makespan, a.makespan);
  expect_consistent(b, &jit);
}

TEST(Simulator, StageJitterVariesOnlyItsStage) {
  Schedule s = schedule::one_f_one_b(3, 8);
  SimConfig c = unit(3);
  c.stage_jitter = {0, 0.5, 0};
  SimResult r = simulate(s, c);
  for (int stage = 0; stage < 3; ++stage) {
    double lo = 10, hi = 0;
    for (const TimelineEntry& e : r.timeline[size_t(stage)]) {
      if (e.op == Op::optimizer_step) continue;
      const double f = (e.end - e.start) / (e.op == Op::forward ? 1 : 2);
      lo = std::min(lo, f);
      hi = std::max(hi, f);
    }
    if (stage == 1) {
      EXPECT_GE(lo, 0.5);
      EXPECT_LT(hi, 1.5);
      EXPECT_GT(hi - lo, 0.3);
    } else {
      EXPECT_DOUBLE_EQ(lo, 1) << stage;
      EXPECT_DOUBLE_EQ(hi, 1) << stage;
    }
  }
  c.stage_jitter = {0, 0.5};
  EXPECT_THROW(simulate(s, c), ConfigError);
  c.stage_jitter = {0, 1, 0};
  EXPECT_THROW(simulate(s, c), ConfigError);
}

TEST(Simulator, RecordTimelineOffKeepsTheNumbers) {
  Schedule s = schedule::interleaved_one_f_one_b(4, 8, 2);
  SimConfig c = unit(4, 2);
  c.jitter = 0.1;
  SimResult full = simulate(s, c);
  c.record_timeline = false;
  SimResult lean = simulate(s, c);
  EXPECT_TRUE(lean.timeline.empty());
  EXPECT_EQ(lean.makespan, full.makespan);
  EXPECT_EQ(lean.busy, full.busy);
  EXPECT_EQ(lean.peak_in_flight, full.peak_in_flight);
  SimResult greedy =
      simulate_greedy({.stages = 4, .micro_batches = 8, .chunks = 2, .memory_cap = 8}, c);
  EXPECT_TRUE(greedy.timeline.empty());
  EXPECT_TRUE(greedy.executed.per_stage.empty());
}

TEST(Simulator, RejectsConfigThatDoesNotFit) {
  Schedule s = schedule::one_f_one_b(2, 2);
  auto problem = [&](SimConfig c) -> std::string {
    try {
      simulate(s, c);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_THAT(problem(unit(3)), HasSubstr("costs has 3 entries, needs one per virtual stage"));
  SimConfig c = unit(2);
  c.costs[1].forward = -1;
  EXPECT_THAT(problem(c), HasSubstr("costs of virtual stage 1 must be finite and >= 0"));
  c = unit(2);
  c.slowdown = {1, 0};
  EXPECT_THAT(problem(c), HasSubstr("slowdown factors must be finite and > 0"));
  c = unit(2);
  c.jitter = 1;
  EXPECT_THAT(problem(c), HasSubstr("jitter must be in [0, 1)"));
  c = unit(2);
  c.links.resize(3);
  EXPECT_THAT(problem(c), HasSubstr("links has 3 entries"));
  c = unit(2);
  c.link.bandwidth = 0;
  EXPECT_THAT(problem(c), HasSubstr("bandwidth > 0"));
  c = unit(2);
  c.optimizer_step = {1};
  EXPECT_THAT(problem(c), HasSubstr("optimizer_step has 1 entries"));
}

TEST(Simulator, ReportsDeadlockAndComputeBeforeItsInput) {
  auto problem = [](const std::string& text) -> std::string {
    try {
      simulate(schedule::parse_schedule(text), uniform_config(2, 1, {}));
    } catch (const InvalidArgumentError& e) {
      return e.what();
    }
    return "";
  };
  // Both stages wait for a gradient before anyone sends one.
  EXPECT_THAT(problem("schedule bad stages=2 micro_batches=1 chunks=1\n"
                      "stage 0: recvG0.0<1 F0.0 sendA0.0>1 B0.0 step\n"
                      "stage 1: recvA0.0<0 F0.0 B0.0 sendG0.0>0 step\n"),
              HasSubstr("deadlocks"));
  EXPECT_THAT(problem("schedule bad stages=2 micro_batches=1 chunks=1\n"
                      "stage 0: F0.0 sendA0.0>1 recvG0.0<1 B0.0 step\n"
                      "stage 1: F0.0 recvA0.0<0 B0.0 sendG0.0>0 step\n"),
              HasSubstr("stage 1 instruction 0 (F0.0) runs before its recv_activation"));
}

// ---- Greedy dispatcher ----------------------------------------------------------------------

TEST(Greedy, CapOfStagesReachesOneFOneBMakespanWithEqualCosts) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      SimResult g = simulate_greedy({.stages = p, .micro_batches = m, .memory_cap = p}, unit(p));
      EXPECT_DOUBLE_EQ(g.makespan, simulate(schedule::one_f_one_b(p, m), unit(p)).makespan);
      EXPECT_NEAR(g.bubble_fraction(), schedule::bubble_fraction(p, m), 1e-9);
    }
}

TEST(Greedy, OneFOneBCapsReproduceOneFOneBTimeline) {
  for (int p : kStages)
    for (int m : kMicroBatches) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      GreedyOptions o{.stages = p, .micro_batches = m, .memory_cap = p};
      for (int s = 0; s < p; ++s) o.stage_memory_caps.push_back(p - s);
      SimResult g = simulate_greedy(o, unit(p));
      EXPECT_EQ(g.timeline, simulate(schedule::one_f_one_b(p, m), unit(p)).timeline);
    }
}

// Every run finishes and the cap holds on every stage whatever the costs (exactly with one chunk,
// within cap + v - 1 with v), and the executed order is a valid schedule that the list simulator
// replays to the same timeline (jittered durations are keyed by instruction, not by the order
// they run in).
TEST(Greedy, NeverExceedsCapAndReplaysAsValidSchedule) {
  int over_cap = 0;
  for (int p : {1, 2, 3, 4})
    for (int v : {1, 2})
      for (int m : {1, 3, 8})
        for (bool split : {false, true})
          for (int cap : {v, v + 1, p * v, p * v + 2}) {
            SCOPED_TRACE(fmt::format("p={} v={} m={} split={} cap={}", p, v, m, split, cap));
            SimConfig c = unit(p, v);
            c.jitter = 0.3;
            c.seed = uint64_t(p * 1000 + m * 10 + cap);
            c.slowdown.assign(size_t(p), 1.0);
            c.slowdown[0] = 1.7;
            c.link = {.latency = 0.2, .bandwidth = 10};
            for (StageCosts& sc : c.costs) sc.output_bytes = 3;
            SimResult g = simulate_greedy({.stages = p,
                                           .micro_batches = m,
                                           .chunks = v,
                                           .memory_cap = cap,
                                           .split_backward = split},
                                          c);
            for (int s = 0; s < p; ++s) {
              EXPECT_LE(g.peak_in_flight[size_t(s)], cap + v - 1);
              if (v == 1) {
                EXPECT_LE(g.peak_in_flight[size_t(s)], cap);
              }
              if (g.peak_in_flight[size_t(s)] > cap) ++over_cap;
            }
            EXPECT_EQ(g.executed.per_stage.size(), size_t(p));
            schedule::DryRun d = schedule::validate(g.executed);
            EXPECT_EQ(d.peak_in_flight, g.peak_in_flight);
            SimResult replay = simulate(g.executed, c);
            EXPECT_EQ(replay.timeline, g.timeline);
            EXPECT_DOUBLE_EQ(replay.makespan, g.makespan);
            expect_consistent(g, &g.executed);
          }
  EXPECT_GT(over_cap, 0);  // the bound above the cap was reached, not only the cap
}

// A slow last stage paces both the same way: no worse (and no better) than 1F1B.
TEST(Greedy, SlowLastStageMatchesOneFOneB) {
  for (int p = 2; p <= 6; ++p)
    for (int m : kMicroBatches)
      for (double f : {1.25, 2.0, 3.0}) {
        SCOPED_TRACE(fmt::format("p={} m={} slowdown={}", p, m, f));
        SimConfig c = unit(p);
        c.slowdown.assign(size_t(p), 1.0);
        c.slowdown.back() = f;
        double fixed = simulate(schedule::one_f_one_b(p, m), c).makespan;
        double greedy =
            simulate_greedy({.stages = p, .micro_batches = m, .memory_cap = p}, c).makespan;
        EXPECT_NEAR(greedy, fixed, 1e-9);
      }
}

TEST(Greedy, BeatsOneFOneBWithASlowMiddleStage) {
  // p = 3, stage 1 half again as slow. 1F1B's stage 1 holds at most 2 activations, so after F1
  // (t = 4) it idles until B0's gradient arrives (t = 5.5) although F2's input is there. Cap 3
  // lets the dispatcher run F2 in that gap, at the price of a third activation on stage 1.
  SimConfig c = unit(3);
  c.slowdown = {1, 1.5, 1};
  SimResult fixed = simulate(schedule::one_f_one_b(3, 6), c);
  SimResult greedy = simulate_greedy({.stages = 3, .micro_batches = 6, .memory_cap = 3}, c);
  EXPECT_DOUBLE_EQ(fixed.makespan, 31.5);
  EXPECT_DOUBLE_EQ(greedy.makespan, 30);
  EXPECT_EQ(fixed.peak_in_flight[1], 2);
  EXPECT_EQ(greedy.peak_in_flight[1], 3);
  EXPECT_EQ(greedy.timeline[1][2], (TimelineEntry{Op::forward, 2, 0, 4, 5.5}));
}

TEST(Greedy, MatchesOneFOneBWithASlowFirstStage) {
  // p = 2, stage 0 half again as slow (F 1.5, B 3). At t = 7.5 stage 0 could run B1 (its
  // gradient is back) or F2. Backward first would run B1 and only then F2, leaving stage 1 idle
  // until t = 12 (makespan 18); but the first virtual stage's backward unblocks no other stage,
  // so there a forward the cap admits goes first: F2, whose stage 1 F2 and B2 overlap stage 0's
  // B1, as in 1F1B.
  SimConfig c = unit(2);
  c.slowdown = {1.5, 1};
  EXPECT_DOUBLE_EQ(simulate(schedule::one_f_one_b(2, 3), c).makespan, 15);
  SimResult g = simulate_greedy({.stages = 2, .micro_batches = 3, .memory_cap = 2}, c);
  EXPECT_DOUBLE_EQ(g.makespan, 15);
  std::vector<std::string> order;
  for (const TimelineEntry& e : g.timeline[0])
    order.push_back(schedule::to_string(schedule::Instruction{e.op, e.micro_batch, e.chunk}));
  EXPECT_EQ(order,
            (std::vector<std::string>{"F0.0", "F1.0", "B0.0", "F2.0", "B1.0", "B2.0", "step"}));
}

// ZB-H1's budget -- memory for min(m, p) micro-batches on every stage, backwards for 1F1B's
// min(m, p - s) -- with split backward and equal stages: the dispatcher's makespan is ZB-H1's
// fixed lists', and with 1F1B's budget alone (memory p - s) the last stages' weight passes
// cannot wait for idle time, which costs.
TEST(Greedy, ZeroBubbleBudgetRunsAtZbH1sMakespan) {
  for (int p = 2; p <= 6; ++p)
    for (int m : {p, 2 * p, 3 * p + 1}) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      GreedyOptions o{.stages = p, .micro_batches = m, .split_backward = true};
      for (int s = 0; s < p; ++s) {
        o.stage_memory_caps.push_back(std::min(m, p));
        o.stage_backward_caps.push_back(std::min(m, p - s));
      }
      const SimResult g = simulate_greedy(o, unit(p));
      const SimResult zb = simulate(schedule::zb_h1(p, m), unit(p));
      EXPECT_NEAR(g.makespan, zb.makespan, 1e-9);
      for (int s = 0; s < p; ++s) EXPECT_LE(g.peak_in_flight[size_t(s)], std::min(m, p));
      GreedyOptions narrow = o;
      narrow.stage_memory_caps = narrow.stage_backward_caps;
      narrow.stage_backward_caps.clear();
      EXPECT_GT(simulate_greedy(narrow, unit(p)).makespan, g.makespan + 1e-9);
    }
}

TEST(Greedy, SmallCapsFinishInterleavedWithinCapPlusChunksMinusOne) {
  // Cap 1 with two chunks: stage 0 holds F0.0 when F0.1 arrives; it is the oldest micro-batch,
  // so it gets in above the cap (the dispatcher without that exemption stalled here). Cap 1 with
  // three chunks, and jittered durations at cap p * v (which stalled once v >= 3), finish too.
  for (int v : {2, 3})
    for (int cap : {1, 2, 2 * v}) {
      SCOPED_TRACE(fmt::format("v={} cap={}", v, cap));
      SimConfig c = unit(2, v);
      c.jitter = 0.5;
      c.seed = uint64_t(v * 10 + cap);
      SimResult g =
          simulate_greedy({.stages = 2, .micro_batches = 4, .chunks = v, .memory_cap = cap}, c);
      for (int s = 0; s < 2; ++s) EXPECT_LE(g.peak_in_flight[size_t(s)], cap + v - 1);
      EXPECT_EQ(g.timeline[0].size(), size_t(4 * v * 2 + 1));  // every compute and the step
      expect_consistent(g, &g.executed);
    }
  SimResult tight =
      simulate_greedy({.stages = 2, .micro_batches = 4, .chunks = 2, .memory_cap = 1}, unit(2, 2));
  EXPECT_EQ(tight.peak_in_flight, (std::vector<int>{2, 2}));
  EXPECT_THROW(simulate_greedy({.stages = 2, .micro_batches = 4, .memory_cap = 0}, unit(2)),
               ConfigError);
  EXPECT_THROW(
      simulate_greedy({.stages = 2, .micro_batches = 4, .stage_memory_caps = {2}}, unit(2)),
      ConfigError);
  EXPECT_THROW(
      simulate_greedy({.stages = 2, .micro_batches = 4, .stage_backward_caps = {1}}, unit(2)),
      ConfigError);
  EXPECT_THROW(
      simulate_greedy({.stages = 2, .micro_batches = 4, .stage_backward_caps = {1, -1}}, unit(2)),
      ConfigError);
}

TEST(Greedy, SplitBackwardRunsWeightGradientsInIdleTime) {
  // With one stage nothing waits: F Bi Bw per micro-batch fill the step and the cap of 1 holds
  // because Bw (which releases) must run before the next F.
  SimResult one = simulate_greedy(
      {.stages = 1, .micro_batches = 3, .memory_cap = 1, .split_backward = true}, unit(1));
  EXPECT_DOUBLE_EQ(one.makespan, 9);
  EXPECT_DOUBLE_EQ(one.bubble_fraction(), 0);
  // With p stages and cap p, splitting the backward beats the whole backward (1F1B's makespan)
  // because the deferred Bws fill part of the drain.
  for (int p : {2, 4, 8}) {
    int m = 2 * p;
    SimResult split = simulate_greedy(
        {.stages = p, .micro_batches = m, .memory_cap = p, .split_backward = true}, unit(p));
    SimResult whole = simulate_greedy({.stages = p, .micro_batches = m, .memory_cap = p}, unit(p));
    EXPECT_LT(split.makespan, whole.makespan) << "p=" << p;
  }
}

}  // namespace
}  // namespace tessel::planner
