// One training step of a plan, run through the discrete-event simulator (simulator.h) on the cost
// model's per-stage times, as tessel's runtime executes it: what `tessel simulate` prints
// (cli/simulate_command.h) and what `scripts/bench calibrate` compares with `tessel train`.
//
// The schedule is the plan's or the request's, made by name (schedule/named.h: gpipe, 1f1b,
// interleaved-1f1b, zb-h1), or "greedy": the dispatcher of simulate_greedy with per-stage
// activation caps p - s (1F1B's budget; interleaved 1F1B's with virtual stages) or memory_cap.
// zb-h1 splits every backward into input and weight gradients (simulation only: the runtime does
// not run it yet).
//
// The step (simulate_step):
//   pipeline   the simulated makespan of the schedule's lists. Virtual stage costs are the sums
//              of their units' CostModel times (tp communication included; recompute added to
//              the backward), or, for a tp the profile measured, its measured tp stages; a
//              stage-to-stage message of b*s*h activations takes the pipeline link's latency +
//              bytes / bandwidth and overlaps compute.
//   CPU sharing (a profile of this machine: cores, threads_per_worker, cpu_oversubscription)
//              workers time-slice the cores while more worker threads compute than there are
//              cores: compute takes max(1, k * threads / cores) times its full-speed time with k
//              processes computing. The profile's times hold for all its workers at once; the
//              simulation scales them to full speed and then by the slowdown at the simulated
//              mean number of busy processes (busy pipeline ranks x dp x tp), a fixed point. The
//              optimizer step runs on all workers at once.
//   dp sync    ZeRO-0: the runtime all-reduces each chunk's gradients in buckets of bucket_bytes
//              cut from the end of its buffer, each as soon as the last backward completes it;
//              the buckets after the chunk's first unit can hide up to dp_overlap of their time
//              behind that backward, the rest (and every bucket's latency) follows it. ZeRO-1:
//              the reduce-scatter after the pipeline and the all-gather after the optimizer,
//              both exposed.
//   then       the tied embedding's gradient sum (pp > 1), the gradient norm's all-reduces over
//              tp and pp (and dp with ZeRO-1), the optimizer step of the fullest rank
//              (CostModel::optimizer_step), and the loss all-reduce over the world plus the
//              valid-token count's over dp (latency-bound).
// Collectives of a group size the profile measured (all_reduce.by_group) use that measurement,
// others the cluster's collective link. Every rank waits at the norm's all-reduce, so the step is
//   max over ranks of (its last backward end + its exposed dp sync [+ tied sum]) + the rest.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/simulator.h"

namespace tessel::planner {

struct SimulateRequest {
  model::ModelConfig model;
  ClusterSpec cluster;  // resized to the plan's world
  std::optional<ComputeProfile> profile;
  Precision precision = Precision::fp32;
  layout::Plan plan;  // layers_per_stage: the split to simulate; empty: balanced by cost
  int seq = 0;
  // "" (the plan's), "gpipe", "1f1b", "interleaved-1f1b", "zb-h1" or "greedy".
  std::string schedule;
  int memory_cap = 0;  // greedy: activations in flight per stage; 0: p - s on stage s
  double jitter = 0;
  uint64_t seed = 0;
  std::vector<double> slowdown;      // per pipeline rank, empty for none
  std::vector<double> stage_jitter;  // per pipeline rank, empty: `jitter` everywhere
  double dp_overlap = CostOptions{}.dp_overlap;
  // The runtime's data-parallel gradient buckets (parallel.bucket_mb); 0: one all-reduce per
  // chunk, all of it but the chunk's first unit hideable.
  double bucket_bytes = 25.0 * (1 << 20);
  // Worker processes sharing CPU cores (a profile of this machine; cores = 0: not modelled).
  struct Cpu {
    int cores = 0;
    int threads_per_worker = 1;
    double profile_oversubscription = 1;  // the slowdown the profile's times already include
  } cpu;
  // All-reduce bus bandwidth and latency measured per group size (bandwidth, latency of a
  // LinkSpec), used for the groups of those sizes instead of the cluster's collective link.
  std::map<int, LinkSpec> collectives;
  // Per-unit times measured with tensor parallelism (their all-reduces included), by tp size; used
  // for a plan of that tp at the profiled sequence length.
  std::map<int, ComputeProfile> tp_profiles;
  // Per virtual stage, costs that replace the cost model's (an operator graph's,
  // graph_costs.h). The plan must then give layers_per_stage: the units those stages hold decide
  // the parameters each rank syncs over dp and updates. Empty: the cost model's.
  std::vector<StageCosts> stage_costs;
};

struct SimulatedStep {
  layout::Plan plan;  // with layers_per_stage
  std::string schedule;
  std::vector<StageCosts> costs;  // per virtual stage
  SimResult sim;                  // the pipeline phase (no optimizer step)
  double analytic_bubble = 0;     // of the schedule with equal stages, free links
  double pipeline_s = 0;          // sim.makespan
  double dp_exposed_s = 0;        // dp sync past the pipeline (the step's critical rank)
  double collectives_s = 0;       // tied sum, norm, loss and token-count all-reduces
  double optimizer_s = 0;         // the fullest rank's optimizer step
  double cpu_slowdown = 1;        // compute slowdown from workers sharing cores
  double step_s = 0;
  std::vector<double> rank_params;  // parameters (one tp shard) per pipeline rank
};

// Throws ConfigError when the plan does not validate against the model, its own global batch and
// the cluster resized to its world, for a sequence outside the model, an unknown schedule, gpipe,
// 1f1b or zb-h1 on a plan with virtual_stages > 1, a slowdown list that is not one factor per
// pipeline rank, stage_costs without layers_per_stage or not one per virtual stage, and what the
// simulator throws (simulator.h).
SimulatedStep simulate_step(const SimulateRequest& request);

}  // namespace tessel::planner
