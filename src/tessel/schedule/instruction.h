// A pipeline schedule: for every pipeline stage (rank), the list of instructions it runs, in
// order. The runtime's executor runs these lists on real processes and the planner's simulator
// runs the same lists on a cost model, so a schedule is plain data built by pure functions
// (generators.h) and checked by validate.h.
//
// Conventions (used by every generator, the validator, the executor and the simulator):
//
//   p = stages, m = micro_batches, v = chunks (model chunks per stage, 1 unless interleaved or
//   V-shaped). The model's layers are cut into p * v consecutive *virtual stages*, placed on the
//   ranks in one of two ways:
//     interleaved (Megatron's):  vs = chunk * p + stage, so rank p-1's chunk c feeds rank 0's
//                                chunk c+1;
//     v_shape (ZB-V's, v = 2):   chunk 0 is vs = stage, chunk 1 is vs = 2p - 1 - stage: the model
//                                goes down the ranks and back up, so rank p-1 holds vs p-1 and p
//                                (its chunk 0 feeds its chunk 1 locally) and rank 0 holds both
//                                the first and the last virtual stage (embedding and loss).
//   Virtual stage vs lives on rank stage_of(vs) as its local chunk chunk_of(vs). Data flows
//   vs -> vs + 1 forward and vs + 1 -> vs backward.
//
//   Every instruction names the *local* (micro_batch, chunk) its data belongs to:
//     forward          F  runs virtual stage vs on micro_batch; vs = 0 reads the batch itself.
//     backward         B  input and weight gradients of vs together; the last virtual stage
//                         starts from the loss, the others from the received output gradient.
//     backward_input   Bi the input-gradient half of B (what the previous stage waits for).
//     backward_weight  Bw the weight-gradient half of B; runs after its Bi. A (micro_batch,
//                         chunk) has either one B, or one Bi and one Bw (zero-bubble schedules).
//     send_activation     sends F's output of vs to peer = the rank of vs + 1.
//     recv_activation     receives the input of vs from peer = the rank of vs - 1.
//     send_grad           sends B's (or Bi's) input gradient of vs to peer = the rank of vs - 1.
//     recv_grad           receives the output gradient of vs from peer = the rank of vs + 1.
//     optimizer_step      the last instruction of every stage (gradient all-reduce, update).
//     recompute        R  re-runs the F of (micro_batch, chunk) from its kept input, right before
//                         its B, because the forward's activations were dropped (just-in-time
//                         recomputation, Varuna's: placed before the receive of the gradient, it
//                         runs while the gradient is on its way). Costs one F.
//   A send on rank s for (mb, chunk c) matches the receive on its peer for the same mb whose
//   local chunk is the neighbouring virtual stage. When neighbouring virtual stages share a rank
//   (p == 1) the data stays local: there is no send or receive.
//
//   Execution model: a rank runs its list in order. Sends are asynchronous (buffered, never
//   wait for the receiver); a receive waits until its data has arrived. An executor may post a
//   receive earlier than its instruction, but must not use the data before it. Generators put a
//   receive right before the compute that consumes it and a send right after the compute that
//   produces it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tessel::schedule {

enum class Placement { interleaved, v_shape };

enum class Op {
  forward,
  backward,
  backward_input,
  backward_weight,
  send_activation,
  recv_activation,
  send_grad,
  recv_grad,
  optimizer_step,
  recompute,
};

// Unused fields stay -1: peer for compute, all three for optimizer_step.
struct Instruction {
  Op op = Op::forward;
  int micro_batch = -1;
  int chunk = -1;
  int peer = -1;
  bool operator==(const Instruction&) const = default;
};

struct Schedule {
  std::string name;  // one word, e.g. "1f1b"
  int stages = 0;
  int micro_batches = 0;
  int chunks = 1;
  std::vector<std::vector<Instruction>> per_stage;  // per_stage[stage]
  Placement placement = Placement::interleaved;
  bool operator==(const Schedule&) const = default;
};

// The placement's map between (rank, local chunk) and virtual stage (v_shape: 2 chunks).
inline int virtual_stage(int stages, int stage, int chunk,
                         Placement placement = Placement::interleaved) {
  if (placement == Placement::v_shape) return chunk == 0 ? stage : 2 * stages - 1 - stage;
  return chunk * stages + stage;
}
inline int stage_of(int stages, int virtual_stage, Placement placement = Placement::interleaved) {
  if (placement == Placement::v_shape)
    return virtual_stage < stages ? virtual_stage : 2 * stages - 1 - virtual_stage;
  return virtual_stage % stages;
}
inline int chunk_of(int stages, int virtual_stage, Placement placement = Placement::interleaved) {
  if (placement == Placement::v_shape) return virtual_stage < stages ? 0 : 1;
  return virtual_stage / stages;
}

// Receives a pipeline worker keeps posted ahead of the instruction that waits for them, per
// model chunk (runtime/pipeline_executor.h): enough to overlap each transfer with the computes
// before it, few enough that the receive buffers do not grow with the micro-batches.
inline constexpr int kReceiveLookahead = 4;

bool is_compute(Op op);  // forward, backward, backward_input, backward_weight, recompute
bool is_send(Op op);
bool is_recv(Op op);

// Text form, one line per stage, for debugging and for writing schedules by hand in tests:
//   schedule 1f1b stages=2 micro_batches=1 chunks=1     (a V-shaped one adds placement=v)
//   stage 0: F0.0 sendA0.0>1 recvG0.0<1 B0.0 step
//   stage 1: recvA0.0<0 F0.0 B0.0 sendG0.0>0 step
// A token is the op code (F B Bi Bw sendA recvA sendG recvG step), then micro_batch.chunk,
// then >peer for sends or <peer for receives.
std::string_view op_code(Op op);
std::string to_string(const Instruction& instruction);
std::string to_string(const Schedule& schedule);

// Parses to_string's form back. Throws InvalidArgumentError naming the line and token at fault.
// The result is not validated (see validate.h).
Schedule parse_schedule(std::string_view text);

}  // namespace tessel::schedule
