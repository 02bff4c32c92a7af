#include "tessel/schedule/generators.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tessel/core/error.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/validate.h"

namespace tessel::schedule {
namespace {

using ::testing::HasSubstr;

// The compute instructions of one stage, space separated ("F0.0 F1.0 B0.0 ...").
std::string compute_order(const std::vector<Instruction>& list) {
  std::string s;
  for (const Instruction& in : list)
    if (is_compute(in.op)) s += (s.empty() ? "" : " ") + to_string(in);
  return s;
}

std::string joined(const std::vector<Instruction>& list) {
  std::string s;
  for (const Instruction& in : list) s += (s.empty() ? "" : " ") + to_string(in);
  return s;
}

TEST(Gpipe, AllForwardsThenAllBackwards) {
  Schedule s = gpipe(2, 2);
  EXPECT_EQ(to_string(s),
            "schedule gpipe stages=2 micro_batches=2 chunks=1\n"
            "stage 0: F0.0 sendA0.0>1 F1.0 sendA1.0>1 recvG0.0<1 B0.0 recvG1.0<1 B1.0 step\n"
            "stage 1: recvA0.0<0 F0.0 recvA1.0<0 F1.0 B0.0 sendG0.0>0 B1.0 sendG1.0>0 step\n");
}

TEST(OneFOneB, MegatronOrderFourStagesEightMicroBatches) {
  Schedule s = one_f_one_b(4, 8);
  // Stage 0 warms up with p - 1 = 3 forwards, then alternates, then drains.
  EXPECT_EQ(compute_order(s.per_stage[0]),
            "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 F6.0 B3.0 F7.0 B4.0 B5.0 B6.0 B7.0");
  EXPECT_EQ(joined(s.per_stage[0]),
            "F0.0 sendA0.0>1 F1.0 sendA1.0>1 F2.0 sendA2.0>1 F3.0 sendA3.0>1 recvG0.0<1 B0.0 "
            "F4.0 sendA4.0>1 recvG1.0<1 B1.0 F5.0 sendA5.0>1 recvG2.0<1 B2.0 F6.0 sendA6.0>1 "
            "recvG3.0<1 B3.0 F7.0 sendA7.0>1 recvG4.0<1 B4.0 recvG5.0<1 B5.0 recvG6.0<1 B6.0 "
            "recvG7.0<1 B7.0 step");
  // Stage 2 warms up with one forward.
  EXPECT_EQ(compute_order(s.per_stage[2]),
            "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 F4.0 B3.0 F5.0 B4.0 F6.0 B5.0 F7.0 B6.0 B7.0");
  // The last stage runs each micro-batch's backward right after its forward.
  std::string last;
  for (int mb = 0; mb < 8; ++mb)
    last += fmt::format("recvA{0}.0<2 F{0}.0 B{0}.0 sendG{0}.0>2 ", mb);
  EXPECT_EQ(joined(s.per_stage[3]) + " ", last + "step ");
}

TEST(OneFOneB, FewerMicroBatchesThanStagesIsAllWarmup) {
  Schedule s = one_f_one_b(4, 2);
  EXPECT_EQ(compute_order(s.per_stage[0]), "F0.0 F1.0 B0.0 B1.0");
  EXPECT_EQ(compute_order(s.per_stage[3]), "F0.0 B0.0 F1.0 B1.0");
}

TEST(Interleaved, MegatronOrderFourStagesTwoChunksEightMicroBatches) {
  Schedule s = interleaved_one_f_one_b(4, 8, 2);
  // Stage 0: warmup 2 * 3 + 4 = 10 forwards in groups of 4 micro-batches per chunk, 6 steady
  // pairs, backwards by group with the chunks reversed.
  EXPECT_EQ(compute_order(s.per_stage[0]),
            "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 "
            "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 "
            "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0");
  // Stage 3 holds the last virtual stage (chunk 1): warmup 4, then 12 steady pairs.
  EXPECT_EQ(compute_order(s.per_stage[3]),
            "F0.0 F1.0 F2.0 F3.0 "
            "F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0 F6.0 B2.0 F7.0 B3.0 "
            "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 "
            "B4.0 B5.0 B6.0 B7.0");
  // Chunk 0 of the last stage feeds chunk 1 of stage 0, and the gradient flows back.
  const auto& last = s.per_stage[3];
  EXPECT_NE(std::find(last.begin(), last.end(), Instruction{Op::send_activation, 0, 0, 0}),
            last.end());
  const auto& first = s.per_stage[0];
  EXPECT_NE(std::find(first.begin(), first.end(), Instruction{Op::recv_activation, 0, 1, 3}),
            first.end());
  EXPECT_NE(std::find(first.begin(), first.end(), Instruction{Op::send_grad, 0, 1, 3}),
            first.end());
  // Virtual stage 0 receives nothing, the last one sends nothing forward.
  for (const Instruction& in : first)
    EXPECT_FALSE(in.chunk == 0 && (in.op == Op::recv_activation || in.op == Op::send_grad));
  for (const Instruction& in : last)
    EXPECT_FALSE(in.chunk == 1 && (in.op == Op::send_activation || in.op == Op::recv_grad));
}

TEST(Interleaved, OneChunkIsOneFOneB) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      Schedule a = interleaved_one_f_one_b(p, m, 1), b = one_f_one_b(p, m);
      EXPECT_EQ(a.per_stage, b.per_stage) << "p=" << p << " m=" << m;
    }
}

TEST(Interleaved, SingleStageRunsChunksInOrderLocally) {
  Schedule s = interleaved_one_f_one_b(1, 2, 3);
  EXPECT_EQ(joined(s.per_stage[0]),
            "F0.0 F0.1 F0.2 B0.2 F1.0 B0.1 F1.1 B0.0 F1.2 B1.2 B1.1 B1.0 step");
}

// Every generator's output validates on a grid of sizes, holds the expected number of
// activations, and with free communication reaches the analytic bubble.
TEST(Generators, ValidateOnGridWithExpectedMemoryAndBubble) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      DryRun g = validate(gpipe(p, m));
      DryRun f = validate(one_f_one_b(p, m));
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(g.peak_in_flight[s], m);
        EXPECT_EQ(f.peak_in_flight[s], std::min(m, p - s));
      }
      EXPECT_NEAR(g.bubble_fraction(), bubble_fraction(p, m), 1e-12);
      EXPECT_NEAR(f.bubble_fraction(), bubble_fraction(p, m), 1e-12);
      EXPECT_DOUBLE_EQ(f.makespan, 3.0 * (m + p - 1));  // F = 1, B = 2
    }
}

TEST(Interleaved, ValidatesOnGridWithMegatronMemoryAndBubble) {
  for (int p = 1; p <= 8; ++p)
    for (int v = 2; v <= 4; ++v)
      for (int m = p; m <= 16; m += p) {
        SCOPED_TRACE(fmt::format("p={} v={} m={}", p, v, m));
        DryRun r = validate(interleaved_one_f_one_b(p, m, v));
        for (int s = 0; s < p; ++s) {
          int warmup = m == p ? v * m : std::min(2 * (p - s - 1) + (v - 1) * p, v * m);
          EXPECT_EQ(r.peak_in_flight[s], std::min(warmup + 1, v * m)) << "stage " << s;
        }
        EXPECT_NEAR(r.bubble_fraction(), bubble_fraction(p, m, v), 1e-12);
      }
}

TEST(Interleaved, NeedsMicroBatchesMultipleOfStages) {
  try {
    interleaved_one_f_one_b(4, 6, 2);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("micro_batches (6) must be a multiple of stages (4)"));
    EXPECT_THAT(e.what(), HasSubstr("round micro_batches up to 8"));
  }
  EXPECT_THROW(interleaved_one_f_one_b(4, 2, 2), ConfigError);
  EXPECT_NO_THROW(interleaved_one_f_one_b(4, 6, 1));
}

TEST(Generators, RejectSizesBelowOne) {
  for (auto [p, m] : {std::pair{0, 4}, {4, 0}, {-1, 4}, {4, -2}}) {
    EXPECT_THROW(gpipe(p, m), ConfigError);
    EXPECT_THROW(one_f_one_b(p, m), ConfigError);
    EXPECT_THROW(interleaved_one_f_one_b(p, m, 2), ConfigError);
  }
  EXPECT_THROW(interleaved_one_f_one_b(4, 8, 0), ConfigError);
}

TEST(JitRecompute, RecomputesRightBeforeWaitingForTheGradient) {
  const Schedule s = with_jit_recompute(one_f_one_b(2, 3));
  EXPECT_EQ(s.name, "1f1b+jit");
  // Stage 0's forwards overwrite each other's activations: every backward but the one right
  // after its forward recomputes first, before waiting for its gradient.
  EXPECT_EQ(joined(s.per_stage[0]),
            "F0.0 sendA0.0>1 F1.0 sendA1.0>1 R0.0 recvG0.0<1 B0.0 F2.0 sendA2.0>1 R1.0 "
            "recvG1.0<1 B1.0 R2.0 recvG2.0<1 B2.0 step");
  // The last stage runs each backward right after its forward: nothing to recompute.
  EXPECT_EQ(compute_order(s.per_stage[1]), "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0");
  // Under GPipe the last forward's activations are gone by its backward too (R0 took the slot).
  EXPECT_EQ(compute_order(with_jit_recompute(gpipe(2, 3)).per_stage[1]),
            "F0.0 F1.0 F2.0 R0.0 B0.0 R1.0 B1.0 R2.0 B2.0");
  // The text form carries it.
  EXPECT_EQ(parse_schedule(to_string(s)), s);
}

TEST(JitRecompute, ValidatesOnGridAndNeedsWholeBackwards) {
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 2, 4, 8}) {
      validate(with_jit_recompute(gpipe(p, m)));
      validate(with_jit_recompute(one_f_one_b(p, m)));
      if (m % p == 0 && p > 1) validate(with_jit_recompute(interleaved_one_f_one_b(p, m, 2)));
    }
  Schedule zb = one_f_one_b(2, 2);
  for (auto& list : zb.per_stage)
    for (auto& in : list)
      if (in.op == Op::backward) in.op = Op::backward_input;
  EXPECT_THROW(with_jit_recompute(zb), ConfigError);
  // A recomputation after its backward, or twice, is refused.
  Schedule late = with_jit_recompute(one_f_one_b(2, 3));
  auto& list = late.per_stage[0];
  auto r = std::find_if(list.begin(), list.end(),
                        [](const Instruction& in) { return in.op == Op::recompute; });
  ASSERT_NE(r, list.end());
  const Instruction moved = *r;
  list.erase(r);
  list.insert(list.end() - 1, moved);
  EXPECT_THROW(validate(late), InvalidArgumentError);
  Schedule twice = with_jit_recompute(one_f_one_b(2, 3));
  auto& l2 = twice.per_stage[0];
  auto r2 = std::find_if(l2.begin(), l2.end(),
                         [](const Instruction& in) { return in.op == Op::recompute; });
  l2.insert(r2, *r2);
  EXPECT_THROW(validate(twice), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::schedule
