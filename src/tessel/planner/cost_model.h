// Cost model: how long one micro-batch takes on each unit of the model (embedding, transformer
// block, head), per pass, on one tensor-parallel rank, and how long the communication of a plan
// takes. Times are seconds.
//
// Notation: b micro-batch, s sequence length, n = b*s tokens, h = n_embd, F = ffn_hidden,
// a = n_head, D = h / a, V = padded vocabulary, t = tp. A multiply-add is 2 FLOPs. Attention is
// counted over the full s x s score matrix (as Megatron-LM does; the causal half is not skipped).
//
// FLOPs of one block's forward on one tp rank:
//   GEMMs  2 * n * P_gemm / t, one call per linear, where the block's weight count is
//            gpt2:  P_gemm = 3h*h (qkv) + h*h (proj) + h*F (fc) + F*h (proj) = 4h^2 + 2hF
//            llama: P_gemm = 2*h*h (q, o) + 2*h*Dkv (k, v) + 3*h*F (gate, up, down)
//          with Dkv = n_kv_head * D split over t (or one kv head per rank when t > n_kv_head).
//   attention  2 * n * s * h / t for Q K^T plus the same for P V (two batched calls).
//   So gpt2 with F = 4h: 24 n h^2 / t + 4 n s h / t (Megatron's 24Bsh^2 + 4Bs^2h).
// Backward-input: every linear's dX = dY W (the GEMM FLOPs again) plus attention's backward,
//   2x its forward (dP, dV, dQ, dK: four batched calls).
// Backward-weight: every linear's dW = dY^T X (the GEMM FLOPs again, one call per linear).
// Recompute: the forward once more (activation recomputation re-runs the block).
// Head: logits 2 * n * h * V / t forward, the same for backward-input and backward-weight.
// Embedding: a gather, no FLOPs.
//
// Each GEMM's time comes from the device's EfficiencyCurve (cluster.h): FLOPs at the saturated
// rate plus a per-call overhead. Memory-bound work (norms, residual adds, activation function,
// softmax, cross-entropy, gathers) streams its elements through the device's memory bandwidth:
//   block forward   10*n*h (2 norms read+write, 2 residual adds read 2 write 1)
//                   + act*n*F/t (gelu: 2 read+write, swiglu: 3) + 2*n*s*a/t (softmax)
//                   elements; backward twice that; recompute once.
//   head            2*n*h (final norm) + 2*n*V/t fp32 logits (softmax, loss) per pass
//   embedding       n*h forward (gather), 2*n*h backward (scatter-add)
//
// Communication (ring algorithms, alpha-beta):
//   all-reduce of S bytes over g ranks: 2 (g-1)/g * S / bus_bandwidth + latency
//   reduce-scatter or all-gather: (g-1)/g * S / bus_bandwidth + latency
//   point-to-point: S / bandwidth + latency
// Tensor parallel (Megatron): 2 all-reduces of n*h activations in a block's forward (after the
// attention projection and after the MLP), 2 in its backward-input, 2 more in a recompute; the
// embedding's forward and the head's backward-input one each. tp groups sit on one host.
// Pipeline: n*h activations (one per tp rank) to the next stage per micro-batch forward, and
// their gradient back per backward. Data parallel: gradients all-reduced (ZeRO-0) or
// reduce-scattered and the updated parameters all-gathered (ZeRO-1). A group that spans hosts runs
// at min(intra bandwidth, k * inter bandwidth) with k of its members per host (each device brings
// its own NIC), at the inter-host latency.
//
// A ComputeProfile (measured per-unit times by micro-batch size) replaces the FLOP estimate of the
// compute part when given: times are interpolated linearly in the micro-batch size and scaled by
// the analytic model when the sequence length or tp differ from the profiled ones; the tp
// communication is added from the link model.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessel/model/model_config.h"
#include "tessel/planner/cluster.h"

namespace tessel::planner {

// One unit's times for one micro-batch on one tp rank (seconds).
struct PassTimes {
  double forward = 0;          // compute + tp communication of the forward
  double backward_input = 0;   // input gradients + tp communication of the backward
  double backward_weight = 0;  // weight gradients (no communication)
  double recompute = 0;        // the forward re-run before the backward when recompute is on

  double backward() const { return backward_input + backward_weight; }
  // Forward + backward (+ recompute) of one micro-batch: a pipeline slot's worth of work.
  double step(bool with_recompute) const {
    return forward + backward() + (with_recompute ? recompute : 0);
  }
  PassTimes& operator+=(const PassTimes& o);
  PassTimes scaled(double f) const;
};

// FLOPs of one micro-batch's forward on one tp rank, split into the parts the model times
// differently.
struct ForwardFlops {
  double gemm = 0;       // linear layers
  int gemm_calls = 0;    // separate GEMM calls they take
  double attention = 0;  // Q K^T and P V
  int attention_calls = 0;
  double total() const { return gemm + attention; }
};
ForwardFlops block_forward_flops(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp);
ForwardFlops head_forward_flops(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp);
// The same GEMMs by shape, on one tp rank, as the runtime calls them: the linear layers (GPT-2:
// the fused qkv, proj, fc, fc2; LLaMA: q, k, v, o, gate, up, down), then attention's two batched
// GEMMs over the rank's heads (Q K^T, P V). Their FLOPs are block_forward_flops'.
struct BlockGemms {
  std::vector<GemmShape> linear, attention;
};
BlockGemms block_gemms(const model::ModelConfig& m, int64_t micro_batch, int seq, int tp);
// A GEMM C[m, n] = A[m, k] B[k, n]'s gradients: of A, dC B^T (m x k, over n); of B, A^T dC
// (k x n, over m).
inline GemmShape input_gradient_gemm(const GemmShape& g) {
  return {g.m, g.k, g.n, g.batch};
}
inline GemmShape weight_gradient_gemm(const GemmShape& g) {
  return {g.k, g.n, g.m, g.batch};
}
// FLOPs of one training sample (forward + backward, no recompute) through the whole model on all
// tp ranks together: 3x the forward. The numerator of MFU.
double model_flops_per_sample(const model::ModelConfig& m, int seq);

// Measured compute times, e.g. from `tessel profile`. JSON schema (profile["layer_times"]):
//   {"seq": 64, "tp": 1,
//    "points": [{"micro_batch": 1,
//                "forward_s": .., "backward_s": ..,            // one transformer block
//                "backward_input_s": .., "backward_weight_s": ..,   // optional split of backward_s
//                "embedding_forward_s": .., "embedding_backward_s": ..,
//                "head_forward_s": .., "head_backward_s": ..}, ...]}
// Without the split, backward_s is divided in the analytic ratio of input to weight gradients.
// The recompute time is the forward time.
struct ProfilePoint {
  int64_t micro_batch = 1;
  PassTimes block, embedding, head;
};
struct ComputeProfile {
  int seq = 0;
  int tp = 1;
  std::vector<ProfilePoint> points;  // sorted by micro_batch, distinct

  // Times at `micro_batch`: linear between the two nearest points, extrapolated along the
  // nearest segment outside them (proportionally with one point), never below zero.
  ProfilePoint at(int64_t micro_batch) const;
};
// Reads profile["layer_times"] (see above); the model is used to split backward times. Throws
// CorruptDataError naming a missing or malformed field.
ComputeProfile compute_profile_from_json(const nlohmann::json& profile,
                                         const model::ModelConfig& model);

struct CostOptions {
  Precision precision = Precision::bf16;
  // Share of the data-parallel gradient reduction that can run behind the backward pass.
  double dp_overlap = 0.8;
};

// How a communication group's ranks are connected.
struct GroupLink {
  double bandwidth = 0;  // bus bandwidth for collectives, bytes/s
  double latency = 0;    // per collective call, s
  bool cross_host = false;
  BusCurve bus_curve = {};  // measured by message size (cluster.h); empty: latency + bandwidth
  // Across hosts: the hosts a group's ranks spread over, and NCCL's model of its collectives
  // (collective_model.h) on `bandwidth`, where the link has one.
  int hosts = 1;
  NcclModel nccl = {};

  // A group of `ranks` across hosts, `per_host` of them on each (when that divides; else one a
  // host, the worst), whose collectives run at `bandwidth` on `inter`'s latency or model.
  static GroupLink across(const LinkSpec& inter, double bandwidth, int ranks, int per_host);
};

class CostModel {
 public:
  // Throws ConfigError when the device has no peak rate for the precision.
  CostModel(model::ModelConfig model, ClusterSpec cluster, CostOptions options = {},
            std::optional<ComputeProfile> profile = std::nullopt);

  const model::ModelConfig& model() const { return model_; }
  const ClusterSpec& cluster() const { return cluster_; }
  const CostOptions& options() const { return options_; }
  double peak_flops() const { return peak_; }

  // Per-unit times for one micro-batch on one tp rank (tp communication included).
  PassTimes block(int64_t micro_batch, int seq, int tp) const;
  PassTimes embedding(int64_t micro_batch, int seq, int tp) const;
  PassTimes head(int64_t micro_batch, int seq, int tp) const;
  // Unit u of the n_layer + 2 units (0 embedding, 1..n_layer blocks, n_layer + 1 head).
  PassTimes unit(int u, int64_t micro_batch, int seq, int tp) const;

  // The same without communication (the analytic FLOP and memory-traffic estimate).
  PassTimes block_compute(int64_t micro_batch, int seq, int tp) const;
  PassTimes embedding_compute(int64_t micro_batch, int seq, int tp) const;
  PassTimes head_compute(int64_t micro_batch, int seq, int tp) const;

  // Collectives and point-to-point on a given link.
  static double all_reduce_time(double bytes, int ranks, const GroupLink& link);
  static double reduce_scatter_time(double bytes, int ranks, const GroupLink& link);
  static double all_gather_time(double bytes, int ranks, const GroupLink& link);

  // The link of a tp group (tp consecutive ranks: always one host when tp divides
  // devices_per_host).
  GroupLink tp_link(int tp) const;
  // The link of a dp group under rank order tp-dp-pp: dp ranks tp apart.
  GroupLink dp_link(int dp, int tp) const;
  // The slowest link between neighbouring pipeline stages of a world of `world` ranks.
  GroupLink pp_link(int world) const;

  // One tp all-reduce of a micro-batch's n*h activations.
  double tp_all_reduce(int64_t micro_batch, int seq, int tp) const;
  // One stage-to-stage transfer of a micro-batch's activations (or their gradient).
  double p2p(int64_t micro_batch, int seq, int world) const;

  // Data-parallel gradient synchronisation of `params` parameters (one tp rank's share of one
  // pipeline rank). `overlappable` can run behind the backward pass (all-reduce, or ZeRO-1's
  // reduce-scatter); `exposed` cannot (ZeRO-1's all-gather of updated parameters).
  struct DpSync {
    double overlappable = 0;
    double exposed = 0;
  };
  DpSync dp_sync(double params, int dp, int tp, int zero_stage) const;
  // What of a DpSync is left on the critical path when `window` seconds of backward (plus slack)
  // can hide up to options().dp_overlap of the overlappable part.
  double dp_exposed(const DpSync& sync, double window) const;
  // The optimizer step over `params` parameters held by one device (Adam, memory-bound).
  double optimizer_step(double params) const;
  // The same for parameters of `act_bytes` each on a device streaming `memory_bandwidth` bytes/s
  // (0: not modelled).
  static double adam_step_time(double params, int act_bytes, double memory_bandwidth);
  // Summing the tied embedding's gradient between the first and last pipeline ranks.
  double tied_embedding_sync(int tp, int pp, int world) const;

 private:
  PassTimes from_profile(int which, int64_t micro_batch, int seq, int tp) const;
  double stream(double elements, int bytes_per_element) const;

  model::ModelConfig model_;
  ClusterSpec cluster_;
  CostOptions options_;
  std::optional<ComputeProfile> profile_;
  double peak_ = 0;
  int act_bytes_ = 2;
};

}  // namespace tessel::planner
