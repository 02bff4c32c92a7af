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
  // The strategies the programmes' indices refer to (the space's, enumerated again per node).
  struct Strategies {
    const OpGraph& g;
    int t;
    std::vector<OpStrategy> of(int v) const { return op_strategies(g, v, t); }
  };
  return solution_of<ShardingSolution>(r, Strategies{g, t}, g.size());
}

}  // namespace tessel::planner
