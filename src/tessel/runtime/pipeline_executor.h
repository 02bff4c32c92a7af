// Runs one optimizer step's pipeline instructions for one rank (schedule/instruction.h): the
// forwards and backwards of its chunks over the micro-batches, and the stage-boundary
// activations [B, T, C] and their gradients over the pp communicator, tagged with (micro-batch,
// sending virtual stage, kind).
//
// The instruction list is the plan's schedule for the rank's pipeline coordinate; each chunk has
// as many activation slots as its peak number of micro-batches in flight in that list (pp at
// most for 1F1B, M for GPipe), so no forward is ever recomputed. Every receive of the step is
// posted when the step starts, so transfers overlap compute.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/layout/plan.h"
#include "tessel/model/transformer.h"
#include "tessel/runtime/stage.h"
#include "tessel/schedule/instruction.h"

namespace tessel::runtime {

// The instruction list of pipeline rank `pp` of `plan` (its schedule over plan.micro_batches).
std::vector<schedule::Instruction> pipeline_program(const layout::Plan& plan, int pp);

// Per chunk of `program` (chunks of them), the most micro-batches in flight at once (forward
// run, backward not yet): the activation slots it needs. 1F1B needs at most pp, GPipe M.
std::vector<int> activation_peaks(const std::vector<schedule::Instruction>& program, int chunks);

struct PipelineStepResult {
  double loss_sum = 0;    // of the head stage's micro-batches (0 on other stages)
  double idle_s = 0;      // waiting for receives and for the last sends
  double pipeline_s = 0;  // the whole instruction list
};

class PipelineExecutor {
 public:
  // For chunk c's last backward of the step: what reports the gradients finished so far (the
  // overlapped dp all-reduce), or an empty function.
  using LastBackwardHook = std::function<model::Transformer::GradsReady(int chunk)>;

  // Pipeline rank `pp` of `plan` (defaults applied), with sequences of `seq_len` tokens and a
  // hidden size of `hidden`.
  PipelineExecutor(const layout::Plan& plan, int pp, int64_t seq_len, int64_t hidden);

  // The activation slots each chunk needs (activation_peaks of the program).
  const std::vector<int>& activation_slots() const { return slots_; }

  // Runs the step's instructions on `stage`: micro-batch mb's tokens and targets start at
  // inputs/targets + mb * B * T; the loss gradient of every micro-batch is scaled by `grad_scale`.
  PipelineStepResult run(Stage& stage, comm::Communicator& pp, const int32_t* inputs,
                         const int32_t* targets, float grad_scale,
                         const LastBackwardHook& last_backward);

  // Drops the step's pending transfers (a peer failed: the communicators are broken already).
  void abort() noexcept;

 private:
  double forward(Stage& stage, int c, int mb, const int32_t* inputs, const int32_t* targets,
                 float grad_scale);
  void backward(Stage& stage, int c, int mb, const LastBackwardHook& last_backward);
  void backward_input(Stage& stage, int c, int mb);
  void backward_weight(Stage& stage, int c, int mb, const LastBackwardHook& last_backward);
  void keep_input_grad(Chunk& ch, int mb);
  int begin_backward(Chunk& ch, int c, int mb);
  model::Transformer::GradsReady grads_ready(Chunk& ch, int c,
                                             const LastBackwardHook& last_backward);
  void release_slot(Chunk& ch, int mb);
  // Neighbouring virtual stages on this rank (the turn of zb-v's V) pass data by copy.
  bool local_next(int vs) const { return vs + 1 < num_vs_ && rank_of_vs_[size_t(vs + 1)] == pp_; }
  bool local_prev(int vs) const { return vs > 0 && rank_of_vs_[size_t(vs - 1)] == pp_; }
  int chunk_of_vs(int vs) const { return chunk_of_vs_[size_t(vs)]; }

  std::vector<schedule::Instruction> program_;
  std::vector<int> slots_;
  int num_vs_ = 1;
  int64_t B_ = 1, T_ = 1, C_ = 1, M_ = 1;  // micro-batch, seq_len, hidden, micro-batches
  int pp_ = 0;                             // this rank's pipeline coordinate
  std::vector<int> rank_of_vs_, chunk_of_vs_;
  std::vector<std::vector<float>> act_in_, grad_in_;  // [chunk * M + mb] received boundary data
  // The step's transfers. Members, not locals: when a step fails they must outlive the unwinding
  // until the communicators are broken, or destroying them would wait for peers that are
  // themselves stuck.
  std::deque<std::vector<float>> send_buffers_;
  std::vector<comm::Request> sends_;
  std::vector<std::optional<comm::Request>> recvs_;
};

}  // namespace tessel::runtime
