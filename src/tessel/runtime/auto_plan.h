// Plans chosen by the planner for a number of local workers (timeline entries `workers: N`,
// parallel.workers). Deterministic: every process computes the same plan from the same config.
#pragma once

#include "tessel/layout/plan.h"
#include "tessel/runtime/train_config.h"

namespace tessel::runtime {

// The planner's best plan (planner/search.h) for `workers` worker processes on this machine,
// training `cfg`'s model in fp32 with its global batch and sequence length: the cluster is one
// host of `workers` CPU devices sharing its memory, with nominal rates (only their ratios steer
// the choice). Restricted to what the multi-worker runtime runs: ZeRO 0 or 1, no activation
// recompute. Throws ConfigError with the planner's reason when no layout fits.
layout::Plan plan_for_workers(const TrainConfig& cfg, int workers);

}  // namespace tessel::runtime
