#include "tessel/schedule/zero_bubble.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tessel/core/error.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/validate.h"

namespace tessel::schedule {
namespace {

std::string compute_order(const std::vector<Instruction>& list) {
  std::string s;
  for (const Instruction& in : list)
    if (is_compute(in.op)) s += (s.empty() ? "" : " ") + to_string(in);
  return s;
}

TEST(ZbH1, ReferenceOrderFourStagesSixMicroBatches) {
  Schedule s = zb_h1(4, 6);
  // Stage 0: 1F1B warmup, no deferred Bw.
  EXPECT_EQ(compute_order(s.per_stage[0]),
            "F0.0 F1.0 F2.0 F3.0 Bi0.0 Bw0.0 F4.0 Bi1.0 Bw1.0 F5.0 Bi2.0 Bw2.0 "
            "Bi3.0 Bw3.0 Bi4.0 Bw4.0 Bi5.0 Bw5.0");
  // Stage 2: one warmup forward, two F Bi pairs whose Bw waits until the end.
  EXPECT_EQ(compute_order(s.per_stage[2]),
            "F0.0 F1.0 Bi0.0 F2.0 Bi1.0 F3.0 Bi2.0 Bw0.0 F4.0 Bi3.0 Bw1.0 F5.0 Bi4.0 Bw2.0 "
            "Bi5.0 Bw3.0 Bw4.0 Bw5.0");
  // The gradient goes out right after the Bi that produces it.
  const auto& list = s.per_stage[2];
  auto bi = std::find(list.begin(), list.end(), Instruction{Op::backward_input, 0, 0, -1});
  ASSERT_NE(bi, list.end());
  EXPECT_EQ(*(bi + 1), (Instruction{Op::send_grad, 0, 0, 1}));
  EXPECT_EQ(*(bi - 1), (Instruction{Op::recv_grad, 0, 0, 3}));
}

TEST(ZbH1, SingleStageRunsEachMicroBatchThrough) {
  Schedule s = zb_h1(1, 2);
  EXPECT_EQ(to_string(s),
            "schedule zb-h1 stages=1 micro_batches=2 chunks=1\n"
            "stage 0: F0.0 Bi0.0 Bw0.0 F1.0 Bi1.0 Bw1.0 step\n");
}

// Validates on a grid, holds at most min(p, m) activations on every stage (1F1B's stage-0
// peak), and with unit costs reaches the bubble formula in zero_bubble.h, a third of 1F1B's
// when m >= p.
TEST(ZbH1, ValidatesOnGridWithOneFOneBMemoryAndItsBubble) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(fmt::format("p={} m={}", p, m));
      DryRun r = validate(zb_h1(p, m));
      DryRun f = validate(one_f_one_b(p, m));
      EXPECT_EQ(*std::max_element(r.peak_in_flight.begin(), r.peak_in_flight.end()),
                *std::max_element(f.peak_in_flight.begin(), f.peak_in_flight.end()));
      for (int s = 0; s < p; ++s) EXPECT_EQ(r.peak_in_flight[s], std::min(p, m));
      EXPECT_NEAR(r.bubble_fraction(), zb_h1_bubble_fraction(p, m), 1e-12);
      if (m >= p) {
        EXPECT_DOUBLE_EQ(r.makespan, 3.0 * m + p - 1);
        // Idle per stage: p - 1 units against 1F1B's 3 (p - 1).
        for (int s = 0; s < p; ++s) {
          EXPECT_DOUBLE_EQ(r.makespan - r.busy[s], p - 1.0);
          EXPECT_DOUBLE_EQ(f.makespan - f.busy[s], 3.0 * (p - 1));
        }
      }
    }
}

// The paper's ZB-H1 bubble with unequal times: every stage idles (p - 1)(T_F + T_Bi - T_Bw).
TEST(ZbH1, IdleTimeMatchesPaperWithUnequalTimes) {
  for (DryRunCosts c : {DryRunCosts{1, 0, 1, 0.5}, DryRunCosts{1, 0, 1.5, 0.75},
                        DryRunCosts{2, 0, 2, 1}, DryRunCosts{1.25, 0, 1, 1}})
    for (int p = 2; p <= 8; p += 3)
      for (int m : {p, 2 * p + 1, 16}) {
        SCOPED_TRACE(fmt::format("p={} m={} F={} Bi={} Bw={}", p, m, c.forward, c.backward_input,
                                 c.backward_weight));
        DryRun r = validate(zb_h1(p, m), c);
        double work = m * (c.forward + c.backward_input + c.backward_weight);
        for (int s = 0; s < p; ++s) EXPECT_DOUBLE_EQ(r.busy[s], work);
        EXPECT_NEAR(r.makespan - work, (p - 1) * (c.forward + c.backward_input - c.backward_weight),
                    1e-9);
      }
}

TEST(ZbH1, BubbleFormulaAgreesWithOneFOneBShapes) {
  // m >= p: (p - 1) / (3m + p - 1), i.e. 1F1B's formula with three units per micro-batch.
  EXPECT_DOUBLE_EQ(zb_h1_bubble_fraction(4, 8), bubble_fraction(4, 3 * 8));
  EXPECT_DOUBLE_EQ(zb_h1_bubble_fraction(4, 8), 3.0 / 27.0);
  EXPECT_DOUBLE_EQ(zb_h1_bubble_fraction(1, 5), 0.0);
  EXPECT_DOUBLE_EQ(zb_h1_bubble_fraction(8, 2), 1.0 - 6.0 / 19.0);
}

TEST(ZbH1, RejectsSizesBelowOne) {
  EXPECT_THROW(zb_h1(0, 4), ConfigError);
  EXPECT_THROW(zb_h1(4, 0), ConfigError);
  EXPECT_THROW(zb_h1_bubble_fraction(4, -1), ConfigError);
}

}  // namespace
}  // namespace tessel::schedule

namespace tessel::schedule {
namespace {

// ZB-V for every p <= 8 and m <= 32: valid (every F, Bi, Bw, send and receive, no deadlock, the
// V placement's peers: rank p-1 passes chunk 0 to chunk 1 locally, rank 0 holds the loss), within
// 1F1B's memory (2p chunk activations, p micro-batches of a whole stage), and with unit times
// never more than p - 1 units above its lower bound 6m + p - 1 when m >= p, where it also beats
// ZB-H1's bubble (the same work in chunks half as long).
TEST(ZbV, ValidWithinOneFOneBsMemoryAndNearItsBound) {
  for (int p = 1; p <= 8; ++p)
    for (int m : {1, 2, 3, 4, 5, 8, 13, 16, 32}) {
      SCOPED_TRACE(testing::Message() << "p=" << p << " m=" << m);
      const Schedule s = zb_v(p, m);
      EXPECT_EQ(s.placement, Placement::v_shape);
      EXPECT_EQ(s.chunks, 2);
      const DryRun r = validate(s, {1, 2, 1, 1});
      for (int peak : r.peak_in_flight) EXPECT_LE(peak, 2 * p);
      for (double busy : r.busy) EXPECT_EQ(busy, 6.0 * m);
      const double bound = 6.0 * m + p - 1;
      EXPECT_GE(r.makespan, bound);
      EXPECT_NEAR(zb_v_bubble_fraction(p, m), 1 - 6.0 * m / bound, 1e-12);
      if (m >= p) {
        EXPECT_LE(r.makespan, bound + p - 1);
        if (p > 1) {
          EXPECT_LT(r.bubble_fraction(),
                    validate(zb_h1(p, m), {1, 2, 1, 1}).bubble_fraction() + 1e-12);
        }
      }
      // The text form keeps the placement.
      EXPECT_EQ(parse_schedule(to_string(s)), s);
    }
}

// Where the bound is reached: p = 2, m = 8 and p = 8, m = 8 (makespans 49 and 55); p = 4, m = 8
// is one unit above it (52 against 51).
TEST(ZbV, ReachesItsBoundOnSomeShapes) {
  EXPECT_EQ(validate(zb_v(2, 8), {1, 2, 1, 1}).makespan, 49);
  EXPECT_EQ(validate(zb_v(8, 8), {1, 2, 1, 1}).makespan, 55);
  EXPECT_EQ(validate(zb_v(4, 8), {1, 2, 1, 1}).makespan, 52);
}

// The V placement's map: rank s holds virtual stages s and 2p - 1 - s.
TEST(ZbV, VShapedPlacement) {
  constexpr auto V = Placement::v_shape;
  EXPECT_EQ(virtual_stage(4, 0, 0, V), 0);
  EXPECT_EQ(virtual_stage(4, 0, 1, V), 7);
  EXPECT_EQ(virtual_stage(4, 3, 0, V), 3);
  EXPECT_EQ(virtual_stage(4, 3, 1, V), 4);
  for (int vs = 0; vs < 8; ++vs)
    EXPECT_EQ(virtual_stage(4, stage_of(4, vs, V), chunk_of(4, vs, V), V), vs);
  EXPECT_THROW(zb_v(0, 4), ConfigError);
  EXPECT_THROW(zb_v(4, 0), ConfigError);
}

}  // namespace
}  // namespace tessel::schedule
