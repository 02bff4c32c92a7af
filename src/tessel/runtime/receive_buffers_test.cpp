// The pipeline executor's boundary buffers (pipeline_executor.h: receive_buffers): bounded by the
// receive lookahead and the schedule's activations in flight, never by the number of
// micro-batches -- before, every (chunk, micro-batch) had its own receive buffer per direction,
// which at a 1T model's micro-batch counts was tens of GB per rank that no memory model counted.
// That the walk equals what the executor takes is checked on every pipelined training run: the
// executor allocates exactly receive_buffers() and throws an internal error past it.
#include <gtest/gtest.h>

#include "tessel/layout/plan.h"
#include "tessel/planner/memory_model.h"
#include "tessel/runtime/pipeline_executor.h"
#include "tessel/schedule/instruction.h"

namespace tessel::runtime {
namespace {

layout::Plan make_plan(const std::string& schedule, int pp, int v, int64_t m, bool jit = false) {
  layout::Plan p;
  p.pp = pp;
  p.virtual_stages = v;
  p.micro_batches = m;
  p.micro_batch = 1;
  p.schedule = layout::parse_schedule(schedule);
  p.v_shape = schedule == "zb-v";
  p.jit_recompute = jit;
  return p;
}

struct Case {
  std::string schedule;
  int v;
  bool jit;
};

TEST(ReceiveBuffers, DoNotGrowWithTheMicroBatches) {
  for (const Case& c : {Case{"1f1b", 1, false}, Case{"1f1b", 1, true}, Case{"zb-h1", 1, false},
                        Case{"interleaved-1f1b", 2, false}, Case{"interleaved-1f1b", 3, true},
                        Case{"zb-v", 2, false}, Case{"adaptive", 1, false}, Case{"gpipe", 1, false},
                        Case{"gpipe", 1, true}}) {
    for (int pp : {2, 3, 4}) {
      SCOPED_TRACE(c.schedule + " v=" + std::to_string(c.v) + " jit=" + std::to_string(c.jit) +
                   " pp=" + std::to_string(pp));
      for (int rank = 0; rank < pp; ++rank) {
        const int at_4p = receive_buffers(make_plan(c.schedule, pp, c.v, 4 * pp, c.jit), rank);
        const int at_16p = receive_buffers(make_plan(c.schedule, pp, c.v, 16 * pp, c.jit), rank);
        // GPipe holds every micro-batch in flight; under just-in-time recomputation it keeps
        // each one's input (one boundary buffer, not its activations) until the backward.
        if (c.schedule != "gpipe" || !c.jit) {
          EXPECT_EQ(at_4p, at_16p) << "rank " << rank;
        }
        // The memory model's bound, which the planner counts as workspace.
        const auto plan = make_plan(c.schedule, pp, c.v, 16 * pp, c.jit);
        EXPECT_LE(at_16p, planner::receive_buffer_bound(plan, rank)) << "rank " << rank;
        EXPECT_LT(at_16p, 2 * 16 * pp * c.v) << "rank " << rank << ": no better than before";
      }
    }
  }
}

// Send buffers are given back when the peer's next message arrives (it sent that after
// receiving them): a bounded number, where one per message of the step grew with M.
TEST(SendBuffers, DoNotGrowWithTheMicroBatches) {
  for (const Case& c :
       {Case{"1f1b", 1, false}, Case{"1f1b", 1, true}, Case{"zb-h1", 1, false},
        Case{"interleaved-1f1b", 2, false}, Case{"zb-v", 2, false}, Case{"gpipe", 1, false}}) {
    for (int pp : {2, 3, 4}) {
      SCOPED_TRACE(c.schedule + " v=" + std::to_string(c.v) + " jit=" + std::to_string(c.jit) +
                   " pp=" + std::to_string(pp));
      const auto at_4p = pipeline_schedule(make_plan(c.schedule, pp, c.v, 4 * pp, c.jit));
      const auto at_16p = pipeline_schedule(make_plan(c.schedule, pp, c.v, 16 * pp, c.jit));
      for (int rank = 0; rank < pp; ++rank) {
        const int n = send_buffers(at_16p, rank);
        EXPECT_GE(n, 1) << "rank " << rank;
        EXPECT_LE(n,
                  planner::send_buffer_bound(make_plan(c.schedule, pp, c.v, 16 * pp, c.jit), rank))
            << "rank " << rank;
        // GPipe's drain sends every gradient before any message comes back.
        if (c.schedule != "gpipe") {
          EXPECT_EQ(send_buffers(at_4p, rank), n) << "rank " << rank;
        }
        // Every send is freed after it (or at the end), never before.
        const auto release = send_release_points(at_16p, rank);
        for (size_t i = 0; i < release.size(); ++i)
          if (release[i] >= 0) {
            EXPECT_GT(release[i], int(i)) << "rank " << rank;
          }
      }
    }
  }
}

TEST(ReceiveBuffers, TheFirstStageOfAPlainPipelineNeedsOnlyItsGradients) {
  // 1F1B, rank 0 of 2, m = 8: it receives only gradients, one per backward, and each is read by
  // the backward that follows its wait; while it waits for one, the next kReceiveLookahead are
  // posted too.
  EXPECT_EQ(receive_buffers(make_plan("1f1b", 2, 1, 8), 0), schedule::kReceiveLookahead + 1);
  // A single stage receives nothing.
  EXPECT_EQ(receive_buffers(make_plan("1f1b", 1, 1, 8), 0), 0);
}

}  // namespace
}  // namespace tessel::runtime
