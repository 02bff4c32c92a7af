// Automatic plan search: the fastest layout of a model on a cluster that fits in memory.
//
// Searched: every dp x tp x pp factorisation of the device count with tp dividing the devices of
// a host (tensor-parallel groups stay on NVLink), tp dividing n_head, ffn_hidden and the padded
// vocabulary and dividing n_kv_head or being a multiple of it, pp at most the n_layer + 2 units,
// dp dividing the global batch; every micro-batch size dividing the per-replica batch; schedules
// gpipe, 1f1b and interleaved-1f1b (v = 2..max_virtual_stages chunks per rank, micro-batches a
// multiple of pp; gpipe only with pp > 1, where it differs from 1f1b), and with pp > 1 zb-h1,
// zb-v (untied embeddings) and the adaptive dispatcher (one chunk per rank at 1F1B's memory, and
// on zb-v's V); ZeRO stage 0 and 1 (1 only with dp > 1); recompute off and on, and just-in-time
// recomputation (Varuna) for gpipe, 1f1b and interleaved-1f1b with pp > 1.
//
// Stage boundaries: balance_stages cuts the units (embedding, blocks, head, each with its own
// cost) into pp * v contiguous, non-empty stages minimising the largest stage's forward + backward
// (+ recompute) time: an exact dynamic programme, cached per (stages, tp, micro-batch, recompute).
//
// Step time estimate (seconds):
//   pipeline  v*m * max over stages of (F + B [+ R] + 2 * p2p) * stretch, where stretch is the
//             schedule's time over its busy time with equal stages: (v*m + p - 1) / (v*m) for
//             gpipe and 1f1b, the analytic bubbles of the zero-bubble schedules, and for the
//             dispatcher and just-in-time recomputation a simulation on unit stages
//             (search.cpp: Searcher::stretch); the largest stage sets the pace, not the average
//   + max over pipeline ranks of (the data-parallel gradient sync left after hiding up to
//     dp_overlap of it behind the rank's last backward and its drain slack, plus the optimizer)
//   + the tied embedding's gradient sum between the first and last rank (pp > 1)
// Ranked by step time, then memory, then the simpler setting (ZeRO 0, no recompute, fewer chunks);
// the table keeps the best of each (dp, tp, pp, v, micro-batch, schedule). MFU =
// model_flops_per_sample * global_batch / (step time * devices * peak); recompute is not counted as
// useful work.
//
// Pruning: a (tp, pp) whose parameters, gradients and optimizer state alone exceed the device is
// skipped; micro-batch sizes stop growing once the most frugal settings (1f1b, recompute, ZeRO-1)
// no longer fit.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/memory_model.h"

namespace tessel::planner {

// The min-max contiguous partition of `unit_costs` into `stages` non-empty parts.
struct StageSplit {
  std::vector<int> units_per_stage;
  double max_cost = 0;  // the largest part's sum
};
// Exact (dynamic programming with the monotone split point of the min-max partition, O(stages *
// units)). Costs must be non-negative. Throws InvalidArgumentError when stages is outside
// [1, units].
StageSplit balance_stages(std::span<const double> unit_costs, int stages);

struct SearchOptions {
  int top_k = 10;  // alternatives returned (distinct dp, tp, pp, v, micro-batch, schedule)
  int max_virtual_stages = 8;  // interleaved-1f1b chunks per rank tried: 2..max
  std::vector<layout::ScheduleKind> schedules = {layout::ScheduleKind::gpipe,
                                                 layout::ScheduleKind::one_f_one_b,
                                                 layout::ScheduleKind::interleaved_one_f_one_b,
                                                 layout::ScheduleKind::zb_h1,
                                                 layout::ScheduleKind::zb_v,
                                                 layout::ScheduleKind::adaptive};
  std::vector<int> zero_stages = {0, 1};
  std::vector<bool> recompute = {false, true};
  std::vector<bool> jit_recompute = {false, true};
  int64_t max_micro_batch = 0;  // 0: no limit
};

struct SearchRequest {
  model::ModelConfig model;
  ClusterSpec cluster;  // its device count is the world size
  int64_t global_batch = 0;
  int seq = 0;
  Precision precision = Precision::bf16;
  CostOptions cost;  // cost.precision is overwritten with `precision`
  MemoryOptions memory;
  SearchOptions options;
  std::optional<ComputeProfile> profile;
};

struct Candidate {
  layout::Plan plan;        // layers_per_stage filled; validates against the request
  double step_s = 0;        // predicted step time
  double pipeline_s = 0;    // of which the pipeline (compute, tp and pp communication, bubble)
  double dp_exposed_s = 0;  // data-parallel sync left on the critical path
  double optimizer_s = 0;
  double max_stage_s = 0;  // the slowest stage's slot: forward + backward (+ recompute) + p2p
  double bubble = 0;       // idle share of the pipeline with equal stages (1 - 1 / stretch)
  double tokens_per_s = 0;
  double mfu = 0;
  double memory_bytes = 0;  // peak per device (the fullest pipeline rank)
  double capacity_bytes = 0;
};

struct SearchResult {
  std::vector<Candidate> ranked;  // best first, at most options.top_k; empty when nothing fits
  std::string infeasible;         // why nothing fits and what would; empty when ranked is not
  int64_t evaluated = 0;          // candidates whose time and memory were estimated
  int64_t rejected_memory = 0;    // of which did not fit
  int64_t balance_runs = 0;       // stage-balancing DPs run (not served from the cache)
  double seconds = 0;             // search wall time

  bool feasible() const { return !ranked.empty(); }
  // The best candidate; throws ConfigError carrying `infeasible` when there is none.
  const Candidate& best() const;
};

// Throws ConfigError for requests that cannot be searched at all (a non-positive batch or
// sequence, a sequence beyond the model's max_seq_len, a precision the device lacks, an invalid
// model or cluster). Everything else, including "nothing fits", is answered in the result.
SearchResult search(const SearchRequest& request);

// Scores one given plan the way the search ranks candidates (its layers_per_stage, or the balanced
// split when empty); memory_bytes may exceed capacity_bytes. Throws ConfigError when the plan does
// not validate against the request's model, global batch and device count.
Candidate predict(const SearchRequest& request, const layout::Plan& plan);

// A candidate as JSON: {"plan": to_json(plan), "step_s", "tokens_per_s", "mfu", "memory_gib",
// ...}.
nlohmann::json to_json(const Candidate& c);

}  // namespace tessel::planner
