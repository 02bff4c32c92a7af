#include "tessel/planner/graph_sharding.h"

#include <fmt/format.h>

namespace tessel::planner {

ShardingSolution shard_graph(const OpGraph& g, int t, const ShardingCosts& costs,
                             const IlpOptions& options, GraphShardingStats* stats,
                             int whole_up_to) {
  GraphShardingStats local;
  auto space_at = [&](double price) {
    ShardingCosts c = costs;
    c.memory_price = price;
    return one_axis_space(g, t, c);
  };
  const Programme r = shard_by_segments(g, space_at, fmt::format("t{}", t), costs.memory_bytes,
                                        options, stats != nullptr ? *stats : local, whole_up_to);
  ShardingSolution out;
  out.status = r.status;
  out.variables = r.variables;
  out.constraints = r.constraints;
  out.solve_s = r.solve_s;
  out.bound_s = r.bound_s;
  if (r.index.empty()) return out;
  out.time_s = r.time_s;
  out.index = r.index;
  out.chosen.resize(size_t(g.size()));
  for (int v = 0; v < g.size(); ++v)
    if (r.index[size_t(v)] >= 0)
      out.chosen[size_t(v)] = op_strategies(g, v, t)[size_t(r.index[size_t(v)])];
  return out;
}

}  // namespace tessel::planner
