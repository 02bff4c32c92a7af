// Device costs the sharding tests plan for (sharding_ilp_test, graph_sharding_test).
#pragma once

#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner::testing {

// An A100's tensor-parallel group: 150 TFLOP/s achieved, NVLink at 150 GB/s per device.
inline ShardingCosts nvlink_costs() {
  ShardingCosts c;
  c.flops_per_s = 150e12;
  c.bandwidth = 150e9;
  c.latency_s = 10e-6;
  return c;
}

// CPU workers (the shape of a `tessel profile` cluster): 300 GFLOP/s, 4 GB/s links.
inline ShardingCosts cpu_worker_costs() {
  ShardingCosts c;
  c.flops_per_s = 3e11;
  c.bandwidth = 4e9;
  c.latency_s = 3e-5;
  return c;
}

}  // namespace tessel::planner::testing
