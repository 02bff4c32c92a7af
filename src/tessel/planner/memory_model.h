// Memory model: the bytes one device holds at its peak under a plan, by kind, per pipeline rank.
//
// Model state per parameter (one tp rank's share of its pipeline rank's units):
//   fp32:         4 parameter + 4 gradient + 8 optimizer (Adam m, v)
//   bf16 / fp16:  2 parameter + 2 gradient + 12 optimizer (fp32 master copy, Adam m, v)
//   ZeRO-1 divides the optimizer bytes by dp.
// With tied embeddings and pp > 1 the rank holding the head keeps its own copy of the token
// embedding (model/stage_range.h).
//
// Activations one micro-batch leaves stored in a transformer block between its forward and its
// backward, in elements of the training precision (n = b*s tokens, h, F, a heads, t = tp; the
// Korthikanti et al. 2022 count without dropout and without sequence parallelism):
//   4*n*h                 norm inputs and the inputs of the qkv and fc GEMMs (replicated)
//   n*(2h + 2*Dkv)/t      q, k, v and the attention output (Dkv: kv width per rank)
//   a*s*n/t               softmax probabilities (dropped with flash_attention)
//   2*n*F/t (gelu) or 3*n*F/t (swiglu)   MLP hidden activations
// With recompute only the block's input is kept: n*h elements. The head keeps its two norm inputs
// (2*n*h) and fp32 logits (4 bytes * n*V/t); the embedding the token ids.
//
// Micro-batches alive at a pipeline rank's peak (rank r of p, m micro-batches):
//   gpipe             m
//   1f1b              min(m, p - r)
//   interleaved-1f1b  min(v*m, 2*(p - r - 1) + (v - 1)*p + 1) chunk forwards, issued p at a time
//                     per chunk (Megatron-LM's warm-up), so rank 0 holds about
//                     (1 + (p - 1)/(p*v)) times the 1f1b amount.
// Workspace: the largest unit's full activations for one micro-batch (their gradients during its
// backward), twice that with recompute (the re-materialised activations as well). The device's
// reserved bytes (runtime context, communication buffers) are subtracted from its capacity.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
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

// Bytes one micro-batch leaves stored in unit u between its forward and its backward.
double unit_activation_bytes(const model::ModelConfig& m, int unit, int64_t micro_batch, int seq,
                             int tp, Precision precision, bool recompute,
                             const MemoryOptions& options = {});

// Micro-batches whose activations pipeline rank `rank` holds at its peak, per chunk (v entries;
// see above). Throws InvalidArgumentError for a rank outside [0, pp).
std::vector<int64_t> in_flight_micro_batches(layout::ScheduleKind schedule, int pp, int v,
                                             int64_t micro_batches, int rank);

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
