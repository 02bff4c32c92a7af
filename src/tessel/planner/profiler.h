// Profiler: measures this machine with the real kernels and the real communicator, so that the
// cost model predicts what `tessel train` will do here (`tessel profile` writes the result).
//
// What is measured, and how:
//   - Compute, per micro-batch size b (seq = the profile's sequence length): model::Transformer
//     stages on the "cpu" backend, as the runtime builds them -- a stage of `block_group` blocks
//     (time divided by the count: one block's weights alone would stay warm in cache, which a
//     real stage's do not), the embedding alone and the head alone -- each timed in
//     forward_stage and backward_stage. The stage-boundary buffers hold random values.
//   - Achieved GEMM rate (kernels::sgemm, 1024^3) and the per-call overhead of a small GEMM.
//   - The optimizer phase the runtime runs after the backward: sum_of_squares over the gradients
//     and one adamw_update pass (with zero_grad), over min(parameters, 2^25) elements.
//   - Point-to-point (ping-pong between two processes, one-way time after a barrier) and
//     all-reduce (Communicator::all_reduce_sum) over loopback TCP, by message size, for every
//     group size g in 2..max(2, workers), with workers / g groups communicating at once when g
//     divides the workers (the dp or tp groups of a layout do). Every all-reduce follows a burst
//     of collective_burst_s of GEMMs on every rank, as in a training step, so its time includes
//     waking the idle transport threads and the ranks arriving apart; the time is the mean over
//     the ranks of group 0 of their medians.
//   - Tensor-parallel stages (measure_tp): for every such g the model can be split by, the same
//     stages sharded g ways over the group's communicator, their Megatron all-reduces included.
// Everything runs in forked child processes, forked before anything creates a Gloo context; the
// calling process never runs OpenMP or Gloo itself. The compute runs in min(workers, cores /
// threads) children AT ONCE, each with `threads` OpenMP threads, in lockstep through a
// process-shared barrier, each holding compute_communicators idle communicators as a training
// worker does, so the times include what workers share (memory bandwidth, caches, the transport
// and watchdog threads). When workers * threads exceeds the cores, workers time-slice them: the
// times are then scaled by that oversubscription, workers * threads / cores, to what a worker
// takes while all compute at once (short lockstep passes in more processes than cores would let
// some run alone and others late; see cpu_oversubscription).
// Every measurement is `warmup` untimed runs, then `repeats` timed ones; the median counts (and,
// across concurrent workers, the median of their medians), so outliers drop out.
//
// Output: a JSON document with exactly the fields from_profile_json (cluster.h) and
// compute_profile_from_json (cost_model.h) read, plus the raw measurements:
//   {"format": "tessel-profile", "version": 1, "name": "this-machine",
//    "workers": N, "threads_per_worker": t, "cores": c, "seq": T,
//    "cpu_oversubscription": max(1, N t / c)  (the factor every time below includes),
//    "model": {"name", "family", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden",
//              "vocab_size", "max_seq_len"},
//    "memory_bytes": physical memory / N, "reserved_bytes": 0,
//    "memory_bandwidth_bytes_per_s": 32 bytes per parameter / the optimizer phase's time per
//        parameter (the cost model's fp32 optimizer_step streams 32 bytes a parameter, so it
//        reproduces the measured phase),
//    "flops": {"fp32": achieved SGEMM FLOP/s}, "gemm_half_time_s": small-GEMM overhead,
//    "p2p": {"bandwidth_bytes_per_s", "latency_s", "points": [{"bytes", "seconds"}, ...]},
//    "all_reduce": {"bus_bandwidth_bytes_per_s", "latency_s"   (fit over every group size),
//                   "by_group": [{"ranks", "bus_bandwidth_bytes_per_s", "latency_s",
//                                 "concurrent_groups", "points": [{"bytes", "seconds"}]}, ...]},
//    "optimizer": {"elements", "grad_norm_s", "adamw_s", "seconds_per_param"},
//    "layer_times": {"seq": T, "tp": 1, "threads": t, "concurrent_workers", "block_group",
//                    "cpu_oversubscription",
//                    "points": [{"micro_batch", "forward_s", "backward_s", "embedding_forward_s",
//                                "embedding_backward_s", "head_forward_s", "head_backward_s",
//                                "block_activation_bytes", "embedding_activation_bytes",
//                                "head_activation_bytes"}, ...]},
//    "tp_layer_times": [{"seq": T, "tp": g, "concurrent_groups", "cpu_oversubscription",
//                        "points": [the layer_times time fields, for one tp rank]}, ...],
//    "peak_rss_bytes": the largest resident set of a compute worker,
//    "repeats": r, "seconds": wall time of the whole profile}
// (p2p, all_reduce and tp_layer_times only with measure_comm.) Each tp_layer_times entry is
// itself a layer_times section: compute_profile_from_json({"layer_times": entry}) reads it.
// Bandwidth and latency come from a least-squares fit of time = latency + bytes / bandwidth
// (all-reduce: latency + 2 (g - 1) / g * bytes / bus_bandwidth) weighted by 1 / time^2, i.e. in
// relative error, so small and large messages count alike.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessel/model/model_config.h"

namespace tessel::planner {

struct ProfileOptions {
  model::ModelConfig model;
  int seq = 0;      // tokens per sample; 0: model.max_seq_len
  int workers = 1;  // worker processes a run on this machine will have (the profile's devices)
  int threads = 0;  // OpenMP threads per worker; 0: max(1, usable cores / workers), as the
                    // launcher gives them
  // Micro-batch sizes to time; empty: 1, 2, 4, ... up to max_micro_batch (and max_micro_batch
  // itself when it is no power of two).
  std::vector<int64_t> micro_batches = {};
  int64_t max_micro_batch = 8;
  int block_group = 4;  // blocks per timed stage (at most n_layer)
  int warmup = 1;
  int repeats = 5;
  // Also time tensor-parallel stages (with their all-reduces) over every communication group
  // size the model can be split by.
  bool measure_tp = true;
  bool measure_comm = true;  // false: p2p and all_reduce are left out (the profile then lacks
                             // fields from_profile_json needs; for compute-only profiles)
  // Message sizes in bytes for p2p and all-reduce; empty: 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB,
  // 16 MiB.
  std::vector<int64_t> message_bytes = {};
  // Communicators the compute workers connect among themselves before measuring (when more than
  // one measures), for the transport and watchdog threads a training worker runs beside its
  // compute (the runtime connects world, dp or tp or pp, and the gradient or embedding groups).
  int compute_communicators = 3;
  // Seconds of GEMMs every rank runs right before each timed all-reduce (see above); 0: none.
  double collective_burst_s = 2e-3;
  // Bound on each group of child processes (their start, rendezvous and measurements).
  std::chrono::milliseconds timeout{300000};
  // Called with one line per finished part (e.g. "compute: micro-batch 4 done"); may be empty.
  std::function<void(const std::string&)> progress = {};
};

// Usable cores of this process (its CPU affinity mask).
int usable_cores();

// Measures and returns the profile described above. Throws ConfigError for invalid options (a
// model that does not validate, seq outside [1, max_seq_len], sizes below 1), TimeoutError when a
// group of child processes does not finish within options.timeout (they are killed), and Error
// carrying a child's message when one fails (e.g. out of memory for a large micro-batch).
nlohmann::json profile(const ProfileOptions& options);

// The alpha-beta fit used above: time = latency + x / bandwidth over points (x, time), in
// relative error, with latency >= 0. When the times do not grow with x (or there is one point),
// latency is their weighted mean (one point: 0) and bandwidth max(x) / min(time), the rate the
// data bound from below. Throws InvalidArgumentError for no points, mismatched sizes, x <= 0 or
// times <= 0.
struct LinearFit {
  double latency = 0;
  double bandwidth = 0;  // x per second, finite and > 0
};
LinearFit fit_latency_bandwidth(const std::vector<double>& x, const std::vector<double>& seconds);

}  // namespace tessel::planner
