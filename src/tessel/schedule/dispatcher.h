// The adaptive dispatcher's rule for one pipeline stage: instead of a fixed instruction list, the
// stage picks its next compute from what has actually become ready. The planner's simulator
// (simulate_greedy) and the runtime's executor both ask this class, so the rule they run is one.
//
// The rule, whenever the stage is idle:
//   1. with a backward cap (below): the ready forward with the lowest (micro_batch, chunk) that
//      the caps admit -- 1F1B's own order, whose warm-up and steady state put the forward first
//      while the stage is within its budget;
//   2. the ready backward (B, or Bi when split) with the lowest micro-batch, for equal
//      micro-batches the later chunk (it is nearer the loss) -- except the first virtual
//      stage's, which unblocks no other stage (step 5);
//   3. the ready forward the caps admit (as in 1);
//   4. (split backward only) the oldest pending Bw: weight gradients fill idle time, and free
//      memory;
//   5. the first virtual stage's oldest ready backward;
//   6. else nothing: the stage waits for data (or, after its last compute, is done).
// Why not backward first everywhere, as the simplest greedy rule would have it: with equal
// stages it trails ZB-H1's fixed lists by a forward or two per step (a middle stage that runs a
// backward while its forward's successor idles), and on a slow first stage it loses to 1F1B (the
// forward that feeds the next stage waits behind a backward nobody needs). With these caps and
// order, at equal stage times the dispatcher's makespan is ZB-H1's (planner's simulator_test),
// and under delays it adapts.
//
// Memory cap: `memory_cap` micro-batches' activations held on the stage at once, summed over its
// chunks (a forward holds them until its B, or its Bw when split). Backward cap: at most
// `backward_cap` micro-batches whose backward (B or Bi) has not ended (0: none); with split
// backward the room between the two caps is for deferred weight passes. A forward the caps
// refuse is still admitted when its micro-batch is no newer than the oldest micro-batch holding
// activations here. Why: the globally oldest unfinished micro-batch then always finds room
// wherever it goes next (every micro-batch holding memory on that stage is at least as new), so
// the pipeline always progresses, for any p, m, v and caps >= 1 and whatever the timings. With
// one chunk the exception never applies (a stage holding the oldest micro-batch has already run
// its forward), so the caps are exact; with v chunks it only ever admits a later chunk of the
// oldest micro-batch held here (that micro-batch's earlier chunks hold memory until its backward
// passes them), so the stage holds at most cap + v - 1.
//
// Determinism: per chunk, forwards run in micro-batch order, backwards likewise, and Bw passes
// in the order of their Bi. So every parameter's gradient sums its micro-batches in the same
// order as 1F1B's, and the dispatcher's losses and gradients are bit-identical to it. Inputs
// normally arrive in that order anyway (from a stage that runs them in that order over a FIFO
// link, and vs 0 has them all at once), but the dispatcher does not rely on it: a forward (or
// backward) counts as ready only once every earlier micro-batch of its chunk has started its
// forward (backward) here, so data overtaking earlier data on the way is held back until the
// earlier one arrives. (The progress argument above needs only the oldest micro-batch, which
// has no earlier one to wait for.)
//
// Not thread-safe: one thread drives a stage's dispatcher.
#pragma once

#include <cstddef>
#include <optional>
#include <queue>
#include <string>
#include <vector>

#include "tessel/schedule/instruction.h"

namespace tessel::schedule {

struct DispatchOptions {
  int chunks = 1;         // local chunks on this stage
  int micro_batches = 1;  // of the step
  int memory_cap = 1;     // micro-batches of activations held, >= 1
  // Micro-batches whose backward (B, or Bi when split) has not ended, at once; 0: no such cap.
  // With split backward, memory_cap above it leaves room for deferred weight passes only:
  // ZB-H1's discipline (backward_cap p - s, memory_cap p) rather than more forwards in flight.
  int backward_cap = 0;
  bool split_backward = false;  // Bi then Bw instead of B
  // The local chunk that is virtual stage 0 (reads the batch: its forwards are ready at once),
  // and the one that is the last virtual stage (its backward is ready when its forward ends);
  // -1 when this stage holds neither.
  int first_chunk = -1;
  int last_chunk = -1;
};

class StageDispatcher {
 public:
  // Throws ConfigError for sizes < 1, a cap < 1, or first/last chunks out of range.
  explicit StageDispatcher(const DispatchOptions& options);

  // Data arrived: the forward of (mb, chunk) may run (its input activation is here), or the
  // backward may (its output gradient is here). Each at most once per (mb, chunk); throws
  // InvalidArgumentError otherwise, for indexes out of range, for a forward of the first chunk
  // (ready from the start) or a backward of the last chunk (made ready by its forward's end),
  // and for a backward whose forward has not finished here (its gradient cannot exist yet).
  void forward_ready(int micro_batch, int chunk);
  void backward_ready(int micro_batch, int chunk);

  // The next compute by the rule above, marked started (a forward takes its memory at once), or
  // nullopt when nothing may run now. At most one compute runs at a time: call finished() on it
  // before the next call (throws InvalidArgumentError otherwise).
  std::optional<Instruction> next();

  // The running compute ended: a forward of the last chunk makes its backward ready; a Bi queues
  // its Bw; B and Bw free the micro-batch's memory. Throws InvalidArgumentError when `compute`
  // is not the one running.
  void finished(const Instruction& compute);

  // Every compute of the step has run (the optimizer step may follow).
  bool done() const;
  bool running() const { return running_; }
  int in_flight() const { return in_flight_; }
  int awaiting_backward() const { return awaiting_; }
  int computes_run() const { return started_; }
  int computes_total() const;
  // For stall messages: "k of n computes run, h activations held of cap c, f forwards ready".
  std::string describe() const;

 private:
  size_t index(int mb, int chunk) const { return size_t(mb) * size_t(o_.chunks) + size_t(chunk); }
  void check_indexes(const char* what, int micro_batch, int chunk) const;
  bool admits(int micro_batch) const;
  int oldest_held() const;  // the lowest micro-batch holding activations here; needs in_flight_ > 0

  DispatchOptions o_;
  // Per (mb, chunk): the data arrived (or, for the first chunk's forwards, is there from the
  // start), and the forward ended (so its backward may come).
  std::vector<char> forward_seen_, backward_seen_, forward_done_;
  // Per chunk: the micro-batch whose forward / backward runs next there (order is enforced).
  std::vector<int> next_forward_, next_backward_;
  std::queue<Instruction> weight_;  // pending Bw in the order of their Bi
  std::vector<int> held_;           // micro-batches holding activations here: count per micro-batch
  mutable int oldest_ = 0;    // no micro-batch below it holds activations (a lazy lower bound)
  int forwards_waiting_ = 0;  // arrived, not started
  int in_flight_ = 0;
  int awaiting_ = 0;  // forwards started whose backward has not ended
  int started_ = 0;
  bool running_ = false;
  Instruction current_;  // the running compute
};

}  // namespace tessel::schedule
