#include "tessel/schedule/dispatcher.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <queue>
#include <random>
#include <string>
#include <utility>

#include "tessel/core/error.h"
#include "tessel/schedule/named.h"

namespace tessel::schedule {
namespace {

using ::testing::HasSubstr;

std::string order_string(const std::vector<Instruction>& list) {
  std::string s;
  for (const Instruction& in : list)
    if (is_compute(in.op)) s += (s.empty() ? "" : " ") + to_string(in);
  return s;
}

// One stage alone: every compute finishes before the next is asked for.
std::string run_alone(const DispatchOptions& o) {
  StageDispatcher d(o);
  std::vector<Instruction> order;
  while (auto in = d.next()) {
    order.push_back(*in);
    d.finished(*in);
  }
  EXPECT_TRUE(d.done()) << d.describe();
  return order_string(order);
}

TEST(StageDispatcher, OneStageAlternatesForwardAndBackward) {
  DispatchOptions o{.chunks = 1, .micro_batches = 4, .memory_cap = 1};
  o.first_chunk = o.last_chunk = 0;
  EXPECT_EQ(run_alone(o), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0");
  // Split: Bw holds the activations, so with cap 1 it must run before the next forward.
  o.split_backward = true;
  EXPECT_EQ(run_alone(o), "F0.0 Bi0.0 Bw0.0 F1.0 Bi1.0 Bw1.0 F2.0 Bi2.0 Bw2.0 F3.0 Bi3.0 Bw3.0");
  // Cap 2: one stage is the first virtual stage, whose backward unblocks no other stage, so a
  // forward the cap admits goes first, and a pending Bw (it frees memory) before the next Bi.
  o.memory_cap = 2;
  EXPECT_EQ(run_alone(o), "F0.0 F1.0 Bi0.0 Bw0.0 F2.0 Bi1.0 Bw1.0 F3.0 Bi2.0 Bw2.0 Bi3.0 Bw3.0");
  // A backward cap of 1 holds the second forward until the first Bi has run; the memory cap's
  // second slot then keeps one Bw pending (ZB-H1's deferred weight pass).
  o.backward_cap = 1;
  EXPECT_EQ(run_alone(o), "F0.0 Bi0.0 F1.0 Bw0.0 Bi1.0 F2.0 Bw1.0 Bi2.0 F3.0 Bw2.0 Bi3.0 Bw3.0");
}

// One stage holding both chunks (p = 1, v = 2): chunk 0 feeds chunk 1 locally and chunk 1's
// backward feeds chunk 0's. Returns the computes in order and the most activations held.
std::pair<std::string, int> run_one_stage_two_chunks(int memory_cap) {
  DispatchOptions o{.chunks = 2, .micro_batches = 2, .memory_cap = memory_cap};
  o.first_chunk = 0;
  o.last_chunk = 1;
  StageDispatcher d(o);
  std::vector<Instruction> order;
  int peak = 0;
  while (!d.done()) {
    auto in = d.next();
    if (!in) {
      ADD_FAILURE() << "stalled: " << d.describe();
      break;
    }
    order.push_back(*in);
    peak = std::max(peak, d.in_flight());
    d.finished(*in);
    if (in->op == Op::forward && in->chunk == 0) d.forward_ready(in->micro_batch, 1);
    if (in->op == Op::backward && in->chunk == 1) d.backward_ready(in->micro_batch, 0);
  }
  return {order_string(order), peak};
}

// Past the first virtual stage the rule is backward first: chunk 1 runs its backward as soon as
// it is ready. F0.1's backward (chunk 1) goes before F1.1; chunk 0's backwards wait for the
// forwards.
TEST(StageDispatcher, LaterVirtualStagesRunBackwardFirst) {
  EXPECT_EQ(run_one_stage_two_chunks(4).first, "F0.0 F0.1 B0.1 F1.0 F1.1 B1.1 B0.0 B1.0");
}

TEST(StageDispatcher, OneStageTwoChunksUsesTheOldestMicroBatchExemption) {
  // With cap 1, F0.1 is admitted although F0.0 fills the cap, because micro-batch 0 is the
  // oldest held: without that it would never run.
  const auto [order, peak] = run_one_stage_two_chunks(1);
  EXPECT_EQ(order, "F0.0 F0.1 B0.1 B0.0 F1.0 F1.1 B1.1 B1.0");
  EXPECT_EQ(peak, 2);  // cap + v - 1
}

// ---- An event-driven pipeline of StageDispatchers ------------------------------------------

struct Pipeline {
  int p = 1, m = 1, v = 1;
  Placement placement = Placement::interleaved;
  std::vector<int> caps;           // per stage
  std::vector<int> backward_caps;  // per stage, empty: none
  bool split = false;
  // Random: every compute takes 0.1 .. 10 (log-uniform) and every message 0 .. 5 (uniform, so
  // later data can overtake earlier data). Otherwise computes take `forward` / `backward` (Bi
  // and Bw half of it) and messages `delay`.
  bool random = false;
  uint64_t seed = 0;
  double forward = 1, backward = 2, delay = 0;
};

struct PipelineRun {
  std::vector<std::vector<Instruction>> order;  // per stage, in the order started
  std::vector<int> peak;                        // per stage: most activations held
  std::vector<std::string> unfinished;          // describe() of stages not done at the end
};

PipelineRun run_pipeline(const Pipeline& c) {
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int last = c.p * c.v - 1;
  std::vector<StageDispatcher> stages;
  for (int s = 0; s < c.p; ++s) {
    DispatchOptions o{.chunks = c.v,
                      .micro_batches = c.m,
                      .memory_cap = c.caps[size_t(s)],
                      .backward_cap = c.backward_caps.empty() ? 0 : c.backward_caps[size_t(s)],
                      .split_backward = c.split};
    if (stage_of(c.p, 0, c.placement) == s) o.first_chunk = chunk_of(c.p, 0, c.placement);
    if (stage_of(c.p, last, c.placement) == s) o.last_chunk = chunk_of(c.p, last, c.placement);
    stages.emplace_back(o);
  }
  struct Event {
    double time;
    uint64_t seq;
    int stage;
    Instruction what;  // a finished compute, or forward / backward: its data arrived
    bool done;
  };
  auto later = [](const Event& a, const Event& b) {
    return a.time != b.time ? a.time > b.time : a.seq > b.seq;
  };
  std::priority_queue<Event, std::vector<Event>, decltype(later)> events(later);
  uint64_t seq = 0;
  auto delay = [&] { return c.random ? 5 * unit(rng) : c.delay; };
  auto duration = [&](Op op) {
    if (c.random) return 0.1 * std::pow(100.0, unit(rng));
    return op == Op::forward ? c.forward : op == Op::backward ? c.backward : c.backward / 2;
  };

  PipelineRun r;
  r.order.resize(size_t(c.p));
  r.peak.assign(size_t(c.p), 0);
  double now = 0;
  for (;;) {
    for (int s = 0; s < c.p; ++s) {
      StageDispatcher& d = stages[size_t(s)];
      if (d.running() || d.done()) continue;
      auto in = d.next();
      if (!in) continue;
      r.order[size_t(s)].push_back(*in);
      r.peak[size_t(s)] = std::max(r.peak[size_t(s)], d.in_flight());
      events.push({now + duration(in->op), seq++, s, *in, true});
    }
    if (events.empty()) break;
    // Everything that happens at the next time lands before any stage picks.
    now = events.top().time;
    while (!events.empty() && events.top().time == now) {
      const Event e = events.top();
      events.pop();
      const Instruction& in = e.what;
      if (!e.done) {
        if (in.op == Op::forward)
          stages[size_t(e.stage)].forward_ready(in.micro_batch, in.chunk);
        else
          stages[size_t(e.stage)].backward_ready(in.micro_batch, in.chunk);
        continue;
      }
      stages[size_t(e.stage)].finished(in);
      const int vs = virtual_stage(c.p, e.stage, in.chunk, c.placement);
      auto send = [&](Op op, int to_vs) {
        const int to = stage_of(c.p, to_vs, c.placement);
        events.push({now + delay(), seq++, to,
                     Instruction{op, in.micro_batch, chunk_of(c.p, to_vs, c.placement)}, false});
      };
      if (in.op == Op::forward && vs < last) send(Op::forward, vs + 1);
      if ((in.op == Op::backward || in.op == Op::backward_input) && vs > 0)
        send(Op::backward, vs - 1);
    }
  }
  for (int s = 0; s < c.p; ++s)
    if (!stages[size_t(s)].done())
      r.unfinished.push_back(fmt::format("stage {}: {}", s, stages[size_t(s)].describe()));
  return r;
}

// Per chunk, each kind of compute runs in micro-batch order, every compute runs once, and a Bw
// comes after its Bi.
void expect_ordered(const Pipeline& c, const std::vector<Instruction>& order, int stage) {
  std::vector<int> next_forward(size_t(c.v), 0), next_backward(size_t(c.v), 0),
      next_weight(size_t(c.v), 0);
  std::vector<char> input_done(size_t(c.m * c.v), 0);
  for (const Instruction& in : order) {
    const size_t k = size_t(in.chunk);
    switch (in.op) {
      case Op::forward:
        EXPECT_EQ(in.micro_batch, next_forward[k]++) << "stage " << stage << ": " << to_string(in);
        break;
      case Op::backward:
      case Op::backward_input:
        EXPECT_EQ(in.op, c.split ? Op::backward_input : Op::backward);
        EXPECT_EQ(in.micro_batch, next_backward[k]++) << "stage " << stage << ": " << to_string(in);
        input_done[size_t(in.micro_batch * c.v) + k] = 1;
        break;
      case Op::backward_weight:
        EXPECT_TRUE(c.split);
        EXPECT_EQ(in.micro_batch, next_weight[k]++) << "stage " << stage << ": " << to_string(in);
        EXPECT_TRUE(input_done[size_t(in.micro_batch * c.v) + k])
            << "stage " << stage << ": " << to_string(in) << " before its Bi";
        break;
      default:
        ADD_FAILURE() << "stage " << stage << " ran " << to_string(in);
    }
  }
  for (int k = 0; k < c.v; ++k) {
    EXPECT_EQ(next_forward[size_t(k)], c.m) << "stage " << stage << " chunk " << k;
    EXPECT_EQ(next_backward[size_t(k)], c.m) << "stage " << stage << " chunk " << k;
    EXPECT_EQ(next_weight[size_t(k)], c.split ? c.m : 0) << "stage " << stage << " chunk " << k;
  }
}

TEST(StageDispatcher, PipelineAlwaysFinishesInOrderWithinTheCap) {
  int runs = 0, over_cap = 0;
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 2, 3, 5, 8})
      for (auto [v, placement] : {std::pair{1, Placement::interleaved},
                                  {2, Placement::interleaved},
                                  {2, Placement::v_shape},
                                  {3, Placement::interleaved}})
        for (int cap : {1, 2, p, 2 * p})
          for (bool split : {false, true})
            for (uint64_t seed = 0; seed < 6; ++seed) {
              // Seed 0: unit computes and free messages (many ties); the others random. Odd
              // seeds add 1F1B's backward caps p - s (ZB-H1's discipline under `cap`).
              Pipeline c{.p = p,
                         .m = m,
                         .v = v,
                         .placement = placement,
                         .caps = std::vector<int>(size_t(p), cap),
                         .backward_caps = {},
                         .split = split,
                         .random = seed > 0,
                         .seed = seed * 7919 + uint64_t(p * 100 + m * 10 + cap)};
              if (seed % 2 == 1)
                for (int s = 0; s < p; ++s) c.backward_caps.push_back(p - s);
              SCOPED_TRACE(fmt::format("p={} m={} v={} {} cap={} split={} seed={}", p, m, v,
                                       placement == Placement::v_shape ? "v_shape" : "interleaved",
                                       cap, split, seed));
              PipelineRun r = run_pipeline(c);
              ++runs;
              EXPECT_THAT(r.unfinished, ::testing::IsEmpty()) << "deadlock";
              for (int s = 0; s < p; ++s) {
                expect_ordered(c, r.order[size_t(s)], s);
                EXPECT_LE(r.peak[size_t(s)], cap + v - 1) << "stage " << s;
                if (v == 1) {
                  EXPECT_LE(r.peak[size_t(s)], cap) << "stage " << s;
                }
                if (r.peak[size_t(s)] > cap) ++over_cap;
              }
              if (::testing::Test::HasFailure()) return;  // one failing case says enough
            }
  EXPECT_EQ(runs, 4 * 5 * 4 * 4 * 2 * 6);
  // The exemption was needed (cap 1 with two chunks cannot finish without it), so the bound
  // above was exercised beyond the cap.
  EXPECT_GT(over_cap, 0);
}

// With equal stages and 1F1B's own budget (p - s on stage s), the rule reproduces 1F1B's order
// for any ratio of forward to backward time and any (equal) message delay. The cap stops stage
// s's warmup after p - s forwards, 1F1B's warmup plus its first steady forward. In the steady
// state the stage is full after each forward, so a backward must follow, as in 1F1B; and when
// that backward ends the next gradient is not back yet (it needs the forward sent just before
// the backward to go downstream, run a forward and a backward there and come back), so the
// freed slot goes to the next forward, as in 1F1B. The drain is backwards in order in both.
TEST(StageDispatcher, OneFOneBCapsReproduceOneFOneBOrder) {
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 12; ++m)
      for (auto [forward, backward] : {std::pair{1.0, 2.0}, {1.0, 1.0}, {2.0, 1.0}})
        for (double delay : {0.0, 0.5, 3.0}) {
          SCOPED_TRACE(fmt::format("p={} m={} F={} B={} delay={}", p, m, forward, backward, delay));
          Pipeline c{.p = p,
                     .m = m,
                     .caps = {},
                     .backward_caps = {},
                     .forward = forward,
                     .backward = backward,
                     .delay = delay};
          for (int s = 0; s < p; ++s) c.caps.push_back(p - s);
          PipelineRun r = run_pipeline(c);
          ASSERT_THAT(r.unfinished, ::testing::IsEmpty());
          Schedule fixed = make_schedule("1f1b", p, m);
          for (int s = 0; s < p; ++s)
            EXPECT_EQ(order_string(r.order[size_t(s)]), order_string(fixed.per_stage[size_t(s)]))
                << "stage " << s;
        }
}

TEST(StageDispatcher, RejectsBadOptionsAndCalls) {
  EXPECT_THROW(StageDispatcher({.memory_cap = 0}), ConfigError);
  EXPECT_THROW(StageDispatcher({.chunks = 0}), ConfigError);
  EXPECT_THROW(StageDispatcher({.micro_batches = 0}), ConfigError);
  EXPECT_THROW(StageDispatcher({.chunks = 2, .first_chunk = 2}), ConfigError);
  EXPECT_THROW(StageDispatcher({.chunks = 2, .last_chunk = -2}), ConfigError);

  auto problem = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const InvalidArgumentError& e) {
      return e.what();
    }
    return "";
  };
  StageDispatcher d({.chunks = 2, .micro_batches = 2, .memory_cap = 2, .first_chunk = 0});
  EXPECT_THAT(problem([&] { d.forward_ready(0, 2); }), HasSubstr("out of range"));
  EXPECT_THAT(problem([&] { d.forward_ready(2, 1); }), HasSubstr("out of range"));
  EXPECT_THAT(problem([&] { d.backward_ready(-1, 0); }), HasSubstr("out of range"));
  EXPECT_THAT(problem([&] { d.forward_ready(0, 0); }), HasSubstr("ready from the start"));
  d.forward_ready(0, 1);
  EXPECT_THAT(problem([&] { d.forward_ready(0, 1); }), HasSubstr("reported twice"));
  EXPECT_THAT(problem([&] { d.backward_ready(0, 1); }), HasSubstr("before its forward finished"));

  auto f = d.next();
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(to_string(*f), "F0.0");
  EXPECT_TRUE(d.running());
  EXPECT_THAT(problem([&] { d.next(); }), HasSubstr("F0.0 is still running"));
  EXPECT_THAT(problem([&] {
                d.finished({Op::forward, 1, 0});
              }),
              HasSubstr("F1.0 is not the running compute (F0.0)"));
  d.finished(*f);
  EXPECT_THAT(problem([&] { d.finished(*f); }), HasSubstr("not the running compute (none)"));
  EXPECT_EQ(d.describe(), "1 of 8 computes run, 1 activations held of cap 2, 2 forwards ready");
  EXPECT_FALSE(d.done());
}

}  // namespace
}  // namespace tessel::schedule
