// Memory model: the bytes one device holds at its peak under a plan, by kind, per pipeline rank.
//
// Model state per parameter (one tp rank's share of its pipeline rank's units):
//   fp32:         4 parameter + 4 gradient + 8 optimizer (Adam m, v)
//   bf16 / fp16:  2 parameter + 2 gradient + 12 optimizer (fp32 master copy, Adam m, v)
//   ZeRO-1 divides the optimizer bytes by dp.
// With tied embeddings and pp > 1 the rank holding the head keeps its own copy of the token
// embedding (model/stage_range.h).
//
// Activations: exactly the storage model::Transformer allocates (model/transformer.h, "Memory"),
// in elements of the training precision except the head's logits, losses and loss statistics,
// which stay fp32. A pipeline stage (one Transformer: units [begin, end)) holds, with n = b*s
// tokens, h, D (head dim), and per tp rank Hq, Hkv (kv heads split, or one replicated), F, Vp:
//   per block and slot  O = n*h (output), A = n*(3h + (Hq + 2Hkv)*D + Hq*D + 2F + 4) (gpt2) or
//                       n*(3h + (Hq + 2Hkv)*D + Hq*D + 3F + 2) (llama), P = b*Hq*s^2 (probs;
//                       none with flash_attention), of which X = n*(2h + Hq*D + F) are the
//                       inputs of the block's linears:
//                         none: O + A + P;  selective: O + A;  full: O
//   once per stage      what recomputation refills: selective P; full A + P (A - X + P with
//                       split backward)
//   per slot            the stage input x0 (n*h); on the head stage the final norm (n*h + 2n
//                       gpt2, n*h + n llama), logits n*Vp, losses n, with tp > 1 the loss
//                       statistics 3n
//   split backward      per block and slot G = n*(2h + (Hq + 2Hkv)*D + F) + 4h (gpt2 with biases;
//                       2h without) or n*(2h + (Hq + 2Hkv)*D + 2F) + 2h (llama), and under full
//                       recomputation X; per slot d(x0) n*h on the first stage and the final
//                       norm's weight gradients (2h, or h) on the head stage
//   scratch (once)      proj, dres, dln 3*n*h; with blocks d(attention output) n*Hq*D, and
//                       without split backward dqkv n*(Hq + 2Hkv)*D and the MLP gradients 2*n*F
//                       (gpt2) or 3*n*F (llama), with it d(activation) n*F only; 2*n_kv_head*D*h
//                       to reduce replicated kv heads' gradients
// The model rounds each buffer up to 64 bytes, so its activation_bytes() exceeds this figure (in
// fp32) by at most 60 bytes per buffer, 0 when every buffer is a multiple of 16 floats. It also
// holds int32 token ids per slot and the targets once (outside activation_bytes()).
// A plan's activation bytes on a pipeline rank are, summed over its chunks, the micro-batches in
// flight times the per-slot bytes (token ids included); the once-per-stage bytes (recomputed
// buffers, scratch, targets) are its workspace.
//
// Micro-batches alive at a pipeline rank's peak (rank r of p, m micro-batches):
//   gpipe             m
//   1f1b              min(m, p - r)
//   interleaved-1f1b  min(v*m, 2*(p - r - 1) + (v - 1)*p + 1) chunk forwards, issued p at a time
//                     per chunk (Megatron-LM's warm-up), so rank 0 holds about
//                     (1 + (p - 1)/(p*v)) times the 1f1b amount.
// The pipeline's boundary buffers (receive_buffer_bound below) are workspace. The device's
// reserved bytes (runtime context, communication buffers) are subtracted from its capacity.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/model/recompute.h"
#include "tessel/planner/cluster.h"

namespace tessel::planner {

struct MemoryOptions {
  // Attention that never stores the s x s probabilities (FlashAttention). tessel's own attention
  // kernel stores them, hence the default.
  bool flash_attention = false;
};

// Parameters of unit u (0 embedding, 1..n_layer blocks, n_layer + 1 head) held by one tp rank,
// not counting the tied embedding's copy. Summed over the units with tp = 1 this is
// ModelConfig::num_params().
int64_t unit_params(const model::ModelConfig& m, int unit, int tp);

// A pipeline stage's activation memory (see above), in bytes.
struct StageActivation {
  double per_slot = 0;    // what one micro-batch keeps from its forward to its backward
  double recomputed = 0;  // once: the buffers recomputation refills, shared by blocks and slots
  double scratch = 0;     // once: the backward's gradient scratch
  double token_ids = 0;   // int32 ids: per slot, and once more for the targets
  // model::Transformer::activation_bytes() of the stage built with `slots` activation slots (up
  // to its 64-byte rounding; fp32).
  double model_bytes(int64_t slots) const {
    return double(slots) * per_slot + recomputed + scratch;
  }
  // What the stage holds once, whatever its slots: the workspace of estimate_memory.
  double workspace() const { return recomputed + scratch + token_ids; }
};

// The activation memory of the stage made of units [unit_begin, unit_end) (0 embedding,
// 1..n_layer blocks, n_layer + 1 head), one tp rank's share, for micro-batches of micro_batch
// sequences of seq tokens. Throws InvalidArgumentError for an empty or out-of-range unit range.
StageActivation stage_activation_bytes(const model::ModelConfig& m, int unit_begin, int unit_end,
                                       int64_t micro_batch, int seq, int tp, Precision precision,
                                       model::Recompute recompute, bool split_backward,
                                       const MemoryOptions& options = {});

// Unit u's share of a stage's per-slot bytes: a block's kept activations (and its split-backward
// gradients), the head's final norm, logits and losses, the embedding's d(x0) under split
// backward (else 0). A stage's per_slot is the sum over its units plus its input x0 (n*h).
double unit_activation_bytes(const model::ModelConfig& m, int unit, int64_t micro_batch, int seq,
                             int tp, Precision precision, model::Recompute recompute,
                             bool split_backward = false, const MemoryOptions& options = {});

// Micro-batches whose activations pipeline rank `rank` holds at its peak, per chunk (v entries;
// see above). `memory_cap` is the adaptive schedule's cap on that rank (layout::Plan::dispatch_cap;
// ignored by the others). Throws InvalidArgumentError for a rank outside [0, pp).
std::vector<int64_t> in_flight_micro_batches(layout::ScheduleKind schedule, int pp, int v,
                                             int64_t micro_batches, int rank, int memory_cap = 1);

// Boundary buffers ([micro_batch, seq, hidden] fp32 each) a pipeline rank's executor holds for
// what it receives and passes between its own virtual stages (runtime/pipeline_executor.h:
// receive_buffers, which stays within this): the receives posted ahead
// (schedule::kReceiveLookahead per chunk) and the one being waited for and read, plus, under
// just-in-time recomputation, the input of every micro-batch in flight (its recompute reads it
// again), plus, on the rank holding a V's turn, a copy each way per micro-batch it holds; under
// the adaptive schedule only the turn's copies, 2 (dispatch_cap + v - 1). 0 without a pipeline.
// It does not grow with the micro-batches beyond the activations in flight.
int64_t receive_buffer_bound(const layout::Plan& plan, int rank);
// And for what it sends (a copy of each message until the peer is known to have it,
// runtime/pipeline_executor.h: send_buffers): at most the micro-batches in flight plus two per
// chunk (a message each way not yet acknowledged). 0 without a pipeline.
int64_t send_buffer_bound(const layout::Plan& plan, int rank);

struct RankMemory {
  int pipeline_rank = 0;
  double parameters = 0;
  double gradients = 0;
  double optimizer = 0;
  double activations = 0;
  double workspace = 0;
  double total() const { return parameters + gradients + optimizer + activations + workspace; }
};

struct MemoryEstimate {
  std::vector<RankMemory> ranks;  // by pipeline rank
  double capacity = 0;            // usable bytes per device (memory less reserved)
  double device_bytes = 0;        // the device's memory
  int worst = 0;                  // pipeline rank with the largest total
  int virtual_stages = 1;

  const RankMemory& peak() const { return ranks.at(worst); }
  bool fits() const { return peak().total() <= capacity; }
  // Why it does not fit, e.g. "needs 93.1 GiB per device on stage 0, has 78.0 GiB (80.0 GiB less
  // 2.0 GiB reserved): activations 61.0 GiB, optimizer 19.4 GiB, ..."; empty when it fits.
  std::string reason() const;
};

// The plan's memory per pipeline rank. Requires plan.layers_per_stage filled (num_stages() entries
// summing to n_layer + 2); throws ConfigError otherwise.
MemoryEstimate estimate_memory(const model::ModelConfig& model, const layout::Plan& plan, int seq,
                               Precision precision, const DeviceSpec& device,
                               const MemoryOptions& options = {});

// "93.1 GiB"
std::string format_gib(double bytes);

}  // namespace tessel::planner
