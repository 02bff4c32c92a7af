#include "tessel/schedule/instruction.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"

namespace tessel::schedule {
namespace {

using ::testing::HasSubstr;

TEST(Instruction, TextForm) {
  EXPECT_EQ(to_string(Instruction{Op::forward, 3, 1}), "F3.1");
  EXPECT_EQ(to_string(Instruction{Op::backward_input, 0, 2}), "Bi0.2");
  EXPECT_EQ(to_string(Instruction{Op::backward_weight, 7, 0}), "Bw7.0");
  EXPECT_EQ(to_string(Instruction{Op::send_activation, 2, 0, 1}), "sendA2.0>1");
  EXPECT_EQ(to_string(Instruction{Op::recv_grad, 2, 0, 3}), "recvG2.0<3");
  EXPECT_EQ(to_string(Instruction{Op::optimizer_step}), "step");
}

TEST(Instruction, VirtualStageNumbering) {
  // 4 stages, chunk 1 of stage 3 is virtual stage 7; virtual stage 4 is chunk 1 of stage 0.
  EXPECT_EQ(virtual_stage(4, 3, 1), 7);
  EXPECT_EQ(stage_of(4, 4), 0);
  EXPECT_EQ(chunk_of(4, 4), 1);
}

TEST(Schedule, TextRoundTripsForEveryGenerator) {
  for (const Schedule& s : {gpipe(3, 4), one_f_one_b(4, 6), interleaved_one_f_one_b(2, 4, 3),
                            interleaved_one_f_one_b(1, 2, 2)})
    EXPECT_EQ(parse_schedule(to_string(s)), s) << to_string(s);
}

TEST(Schedule, ParsesSplitBackwardAndEmptyStages) {
  Schedule s = parse_schedule(
      "schedule zb stages=2 micro_batches=1 chunks=1\n\nstage 0: F0.0 Bi0.0 Bw0.0 step\nstage "
      "1:\n");
  EXPECT_EQ(s.name, "zb");
  ASSERT_EQ(s.per_stage.size(), 2u);
  EXPECT_EQ(s.per_stage[0][1], (Instruction{Op::backward_input, 0, 0, -1}));
  EXPECT_TRUE(s.per_stage[1].empty());
}

TEST(Schedule, ParseErrorsNameLineAndToken) {
  auto message = [](const std::string& text) {
    try {
      parse_schedule(text);
    } catch (const InvalidArgumentError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string header = "schedule x stages=1 micro_batches=1 chunks=1\n";
  EXPECT_THAT(message(header + "stage 0: F0.0 Bx0.0 step\n"),
              HasSubstr("line 2: bad instruction 'Bx0.0'"));
  EXPECT_THAT(message(header + "stage 0: sendA0.0 step\n"),
              HasSubstr("bad instruction 'sendA0.0'"));
  EXPECT_THAT(message(header + "stage 0: F0.0<1\n"), HasSubstr("bad instruction 'F0.0<1'"));
  EXPECT_THAT(message(header + "stage 0: F-1.0\n"), HasSubstr("bad instruction 'F-1.0'"));
  EXPECT_THAT(message(header + "stage 1: F0.0\n"), HasSubstr("line 2: expected 'stage 0:'"));
  EXPECT_THAT(message("schedule x stages=1 micro_batches=1\n"), HasSubstr("line 1: expected"));
  EXPECT_THAT(message("schedule x stages=one micro_batches=1 chunks=1\n"),
              HasSubstr("expected stages=<int>, got 'stages=one'"));
  EXPECT_THAT(message(""), HasSubstr("no 'schedule' header"));
}

TEST(Bubble, AnalyticFractions) {
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 8), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 8, 2), 3.0 / 19.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 5, 3), 0.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(8, 1), 7.0 / 8.0);
  EXPECT_THROW(bubble_fraction(0, 8), ConfigError);
  EXPECT_THROW(bubble_fraction(4, 0), ConfigError);
  EXPECT_THROW(bubble_fraction(4, 8, 0), ConfigError);
}

}  // namespace
}  // namespace tessel::schedule
