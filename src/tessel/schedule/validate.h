// Structural check and dry run of a schedule (conventions in instruction.h).
//
// validate() throws InvalidArgumentError describing the first problem it finds:
//   - sizes: stages, micro_batches, chunks >= 1 and one instruction list per stage;
//   - fields: micro_batch and chunk in range, peer = the rank of the neighbouring virtual stage
//     for sends and receives (and -1 for compute), no send or receive where there is no remote
//     neighbour;
//   - counts: every (micro_batch, chunk) of every stage has exactly one F and either one B or
//     one Bi plus one Bw, exactly one of each send and receive its neighbours require, and one
//     optimizer_step, which is the last instruction;
//   - a dry run: all stages run their lists in order; a receive waits until its peer has run
//     the matching send (sends are buffered and never wait). Running a compute before its local
//     inputs (the receive, the previous virtual stage on this rank, its own F, Bi before Bw) or
//     a send before the compute that produces it is an error, and so is a state where every
//     unfinished stage waits on a receive (deadlock; the message lists each waiting stage).
//
// The dry run also times the lists with fixed per-instruction costs and free communication. This
// is a logical check of the order (for example that a generator reaches its analytic bubble),
// not the planner's cost-model simulator.
#pragma once

#include <vector>

#include "tessel/schedule/instruction.h"

namespace tessel::schedule {

// Duration of one compute instruction (one micro-batch through one model chunk).
struct DryRunCosts {
  double forward = 1;
  double backward = 2;
  double backward_input = 1;
  double backward_weight = 1;
};

struct DryRun {
  // Per stage, the most activations held at once, counted in (micro_batch, chunk) units: an F
  // adds one, its B (or its Bw, which still needs the stored inputs) releases it.
  std::vector<int> peak_in_flight;
  std::vector<double> busy;  // per stage, total compute time
  double makespan = 0;       // when the last stage finishes
  // Idle share of all stages' time: 1 - sum(busy) / (stages * makespan).
  double bubble_fraction() const;
};

DryRun validate(const Schedule& schedule, const DryRunCosts& costs = {});

}  // namespace tessel::schedule
