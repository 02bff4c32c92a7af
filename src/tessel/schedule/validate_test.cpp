#include "tessel/schedule/validate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tessel/core/error.h"
#include "tessel/schedule/generators.h"

namespace tessel::schedule {
namespace {

using ::testing::HasSubstr;

constexpr const char* kHeader2x1 = "schedule hand stages=2 micro_batches=1 chunks=1\n";
constexpr const char* kGoodStage1 = "stage 1: recvA0.0<0 F0.0 B0.0 sendG0.0>0 step\n";

// Validates `text` and returns the message it throws, or "" when it validates.
std::string problem(const std::string& text) {
  try {
    validate(parse_schedule(text));
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

std::string problem(const Schedule& s) {
  return problem(to_string(s));
}

TEST(Validate, AcceptsMinimalTwoStageSchedule) {
  Schedule s = parse_schedule(std::string(kHeader2x1) +
                              "stage 0: F0.0 sendA0.0>1 recvG0.0<1 B0.0 step\n" + kGoodStage1);
  DryRun r = validate(s);
  EXPECT_EQ(r.peak_in_flight, (std::vector<int>{1, 1}));
  EXPECT_EQ(r.busy, (std::vector<double>{3, 3}));
  EXPECT_DOUBLE_EQ(r.makespan, 6);  // F0 F1 B1 B0 in sequence
  EXPECT_DOUBLE_EQ(r.bubble_fraction(), 0.5);
}

TEST(Validate, CatchesMissingReceive) {
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.0 sendA0.0>1 recvG0.0<1 B0.0 step\n" +
                      "stage 1: F0.0 B0.0 sendG0.0>0 step\n"),
              HasSubstr("stage 1: micro_batch 0 chunk 0 has 0 recvA instruction(s), expected 1"));
}

TEST(Validate, CatchesMissingSend) {
  EXPECT_THAT(
      problem(std::string(kHeader2x1) + "stage 0: F0.0 recvG0.0<1 B0.0 step\n" + kGoodStage1),
      HasSubstr("stage 0: micro_batch 0 chunk 0 has 0 sendA instruction(s), expected 1"));
}

TEST(Validate, CatchesBackwardBeforeForward) {
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=1\nstage 0: B0.0 F0.0 step"),
              HasSubstr("stage 0 instruction 0 (B0.0) runs before its F"));
}

TEST(Validate, CatchesComputeBeforeItsReceive) {
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.0 sendA0.0>1 recvG0.0<1 B0.0 step\n"
                                                "stage 1: F0.0 recvA0.0<0 B0.0 sendG0.0>0 step\n"),
              HasSubstr("stage 1 instruction 0 (F0.0) runs before its recv_activation"));
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.0 sendA0.0>1 B0.0 recvG0.0<1 step\n" +
                      kGoodStage1),
              HasSubstr("(B0.0) runs before its recv_grad"));
}

TEST(Validate, CatchesSendBeforeItsCompute) {
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: sendA0.0>1 F0.0 recvG0.0<1 B0.0 step\n" +
                      kGoodStage1),
              HasSubstr("stage 0 instruction 0 (sendA0.0>1) runs before the F that produces it"));
}

TEST(Validate, CatchesCyclicWait) {
  // Stage 0 waits for the gradient before sending the activation that stage 1 waits for.
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.0 recvG0.0<1 sendA0.0>1 B0.0 step\n" +
                      kGoodStage1),
              HasSubstr("schedule 'hand' deadlocks: stage 0 waits at instruction 1 (recvG0.0<1) "
                        "for sendG0.0>0 on stage 1; stage 1 waits at instruction 0 (recvA0.0<0) "
                        "for sendA0.0>1 on stage 0"));
}

TEST(Validate, CatchesDeadlockAcrossMicroBatches) {
  // Stage 1 waits for micro-batch 2 before it returns micro-batch 0's gradient, but 1F1B's
  // stage 0 sends micro-batch 2 only after that gradient has arrived.
  Schedule s = one_f_one_b(2, 4);
  s.per_stage[1] = parse_schedule(
                       "schedule x stages=2 micro_batches=4 chunks=1\nstage 0:\n"
                       "stage 1: recvA0.0<0 F0.0 recvA2.0<0 F2.0 B0.0 sendG0.0>0 recvA1.0<0 F1.0 "
                       "B1.0 sendG1.0>0 B2.0 sendG2.0>0 recvA3.0<0 F3.0 B3.0 sendG3.0>0 step\n")
                       .per_stage[1];
  EXPECT_THAT(problem(s), HasSubstr("deadlocks: stage 0 waits at instruction 4 (recvG0.0<1) for "
                                    "sendG0.0>0 on stage 1; stage 1 waits at instruction 2 "
                                    "(recvA2.0<0)"));
}

TEST(Validate, CatchesWrongPeerAndOutOfRangeFields) {
  EXPECT_THAT(problem("schedule hand stages=3 micro_batches=1 chunks=1\n"
                      "stage 0: F0.0 sendA0.0>2 recvG0.0<1 B0.0 step\nstage 1:\nstage 2:\n"),
              HasSubstr("peer must be 1, the rank of virtual stage 1"));
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F1.0 step\nstage 1: step\n"),
              HasSubstr("micro_batch out of range [0, 1)"));
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.1 step\nstage 1: step\n"),
              HasSubstr("chunk out of range [0, 1)"));
  // Virtual stage 0 has no previous stage to receive from.
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: recvA0.0<1 F0.0 step\nstage 1: step\n"),
              HasSubstr("has no previous virtual stage on another rank"));
  // With one stage every neighbour is local: no communication at all.
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=2\n"
                      "stage 0: F0.0 sendA0.0>0 F0.1 B0.1 B0.0 step\n"),
              HasSubstr("has no next virtual stage on another rank"));
}

TEST(Validate, CatchesDuplicateAndMissingOptimizerStep) {
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=1\nstage 0: F0.0 F0.0 "
                      "B0.0 step\n"),
              HasSubstr("has 2 F instruction(s), expected 1"));
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=1\nstage 0: F0.0 B0.0\n"),
              HasSubstr("needs exactly one optimizer_step, as its last instruction"));
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=1\nstage 0: F0.0 step B0.0\n"),
              HasSubstr("needs exactly one optimizer_step"));
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=1 chunks=1\nstage 0:\n"),
              HasSubstr("has 0 F instruction(s)"));
}

TEST(Validate, CatchesWrongListCountAndSizes) {
  EXPECT_THAT(problem(std::string(kHeader2x1) + "stage 0: F0.0 B0.0 step\n"),
              HasSubstr("has 1 instruction lists for 2 stages"));
  EXPECT_THAT(problem("schedule hand stages=1 micro_batches=0 chunks=1\nstage 0: step\n"),
              HasSubstr("must be >= 1"));
}

TEST(Validate, SplitBackwardHoldsActivationUntilWeightGradient) {
  // Zero-bubble style: Bi sends the gradient on at once, Bw runs later.
  Schedule s = parse_schedule(
      "schedule zb stages=2 micro_batches=2 chunks=1\n"
      "stage 0: F0.0 sendA0.0>1 F1.0 sendA1.0>1 recvG0.0<1 Bi0.0 "
      "recvG1.0<1 Bi1.0 Bw0.0 Bw1.0 step\n"
      "stage 1: recvA0.0<0 F0.0 Bi0.0 sendG0.0>0 recvA1.0<0 F1.0 Bi1.0 "
      "sendG1.0>0 Bw0.0 Bw1.0 step\n");
  DryRun r = validate(s);
  EXPECT_EQ(r.peak_in_flight, (std::vector<int>{2, 2}));
  EXPECT_EQ(r.busy, (std::vector<double>{6, 6}));
}

TEST(Validate, CatchesMixedAndMisorderedSplitBackward) {
  const std::string h = "schedule hand stages=1 micro_batches=1 chunks=1\nstage 0: ";
  EXPECT_THAT(problem(h + "F0.0 Bi0.0 B0.0 step"), HasSubstr("has 1 B, 1 Bi and 0 Bw"));
  EXPECT_THAT(problem(h + "F0.0 Bw0.0 Bi0.0 step"), HasSubstr("(Bw0.0) runs before its Bi"));
  EXPECT_EQ(problem(h + "F0.0 Bi0.0 Bw0.0 step"), "");
}

TEST(Validate, CatchesChunkOrderOnOneStage) {
  const std::string h = "schedule hand stages=1 micro_batches=1 chunks=2\nstage 0: ";
  EXPECT_THAT(problem(h + "F0.1 F0.0 B0.1 B0.0 step"),
              HasSubstr("(F0.1) runs before the F of the previous chunk"));
  EXPECT_THAT(problem(h + "F0.0 F0.1 B0.0 B0.1 step"),
              HasSubstr("(B0.0) runs before the B of the next chunk"));
  EXPECT_EQ(problem(h + "F0.0 F0.1 B0.1 B0.0 step"), "");
}

// Dropping any one instruction of a valid schedule must be reported.
TEST(Validate, CatchesEveryDroppedInstruction) {
  Schedule good = interleaved_one_f_one_b(2, 2, 2);
  ASSERT_EQ(problem(good), "");
  for (int stage = 0; stage < 2; ++stage)
    for (size_t i = 0; i < good.per_stage[stage].size(); ++i) {
      Schedule bad = good;
      bad.per_stage[stage].erase(bad.per_stage[stage].begin() + long(i));
      EXPECT_NE(problem(bad), "") << "dropped stage " << stage << " instruction " << i;
    }
}

// Swapping two neighbouring instructions of the same (micro_batch, chunk) breaks a data
// dependency (receive -> compute -> send, F -> B); swapping the optimizer step moves it off the
// end. Both must be reported.
TEST(Validate, CatchesEverySwapOfDependentNeighbours) {
  for (const Schedule& good : {one_f_one_b(3, 3), gpipe(2, 2), interleaved_one_f_one_b(2, 2, 2),
                               interleaved_one_f_one_b(1, 2, 2)}) {
    ASSERT_EQ(problem(good), "");
    int swaps = 0;
    for (int stage = 0; stage < good.stages; ++stage)
      for (size_t i = 0; i + 1 < good.per_stage[stage].size(); ++i) {
        const Instruction &a = good.per_stage[stage][i], &b = good.per_stage[stage][i + 1];
        bool dependent =
            (a.micro_batch == b.micro_batch && a.chunk == b.chunk) || b.op == Op::optimizer_step;
        if (!dependent) continue;
        Schedule bad = good;
        std::swap(bad.per_stage[stage][i], bad.per_stage[stage][i + 1]);
        EXPECT_NE(problem(bad), "") << good.name << " stage " << stage << " swap at " << i;
        ++swaps;
      }
    EXPECT_GT(swaps, good.stages);
  }
}

}  // namespace
}  // namespace tessel::schedule
