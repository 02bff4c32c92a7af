// Plans chosen by the planner for a number of local workers (timeline entries `workers: N`,
// parallel.workers, `tessel ctl scale N`, recoveries). Deterministic: every process computes the
// same plan from the same inputs.
#pragma once

#include <cstdint>
#include <string>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"

namespace tessel::planner {

struct LocalPlanRequest {
  model::ModelConfig model;
  int64_t global_batch = 0;  // samples per optimizer step
  int seq = 0;               // tokens per sample
  int workers = 0;           // worker processes on this machine
  std::string source;        // where the request comes from (a config file), for messages
  // A recovery's survivors hold activations for micro-batches of this size (0: no preference).
  // The best layout (dp, tp, pp, schedule, ZeRO) stays; its micro-batching keeps this size when
  // that is predicted within kKeepMicroBatchSlack of the best: a recovery is not prepared ahead,
  // and re-sizing the activations means touching fresh memory during the pause
  // (bench/README.md, cluster).
  int prefer_micro_batch = 0;
};

inline constexpr double kKeepMicroBatchSlack = 0.02;

// The planner's best plan (planner/search.h) for `r.workers` worker processes on this machine,
// training `r.model` in fp32: the cluster is one host of `workers` CPU devices sharing its memory,
// with nominal rates (only their ratios steer the choice). Restricted to what the multi-worker
// runtime runs: ZeRO 0 or 1, no activation recompute (with r.prefer_micro_batch, see above).
// Throws ConfigError with the planner's reason when no layout fits.
layout::Plan plan_for_workers(const LocalPlanRequest& r);

}  // namespace tessel::planner
