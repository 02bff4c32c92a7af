// A measured profile for tests: flat layer times (forward 1 ms, backward 2 ms = input 1 ms +
// weight 1 ms per layer and micro-batch), free point-to-point transfers and a slow all-reduce, so
// that a test can work out a schedule's step time by hand.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

namespace tessel::planner::testing {

inline nlohmann::json flat_profile_json() {
  return {{"workers", 8},
          {"memory_bytes", int64_t(8) << 30},
          {"flops", {{"fp32", 1e11}}},
          {"p2p", {{"bandwidth_bytes_per_s", 1e30}, {"latency_s", 0}}},
          {"all_reduce", {{"bus_bandwidth_bytes_per_s", 1e9}, {"latency_s", 1e-4}}},
          {"layer_times",
           {{"seq", 16},
            {"points",
             {{{"micro_batch", 1},
               {"forward_s", 1e-3},
               {"backward_s", 2e-3},
               {"backward_input_s", 1e-3},
               {"backward_weight_s", 1e-3},
               {"embedding_forward_s", 0},
               {"embedding_backward_s", 0},
               {"head_forward_s", 0},
               {"head_backward_s", 0}}}}}}};
}

}  // namespace tessel::planner::testing
