// A large graph's sharding on one mesh axis, TePDist's way: cut at the critical nodes
// (OpGraph::critical_nodes: a transformer's residual adds) into segments that meet only there,
// solve each segment's programme (sharding_ilp.h) exactly for every pair of strategies of its
// head and tail critical nodes, and join the segments by dynamic programming over the critical
// nodes' strategies. Segments with the same structure and the same head and tail strategies
// (every block of a transformer looks alike) are solved once.
//
// The result is optimal for the whole graph's programme without the memory row: the segments
// meet only in their critical nodes, whose strategies the DP enumerates, so every edge and
// every node is costed exactly once. The memory budget couples all segments, which no segment's
// programme sees: when the unconstrained optimum does not fit, the state is priced (Lagrangian
// relaxation, ShardingCosts::memory_price) and the least price whose DP fits is searched; the
// fastest fitting plan is returned as feasible, with the best dual bound as bound_s. A weight
// shared across segments (a head tied to the embedding) is handled by running the DP once per
// layout of that weight, each node limited to the strategies holding it so, and keeping the best.
#pragma once

#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner {

struct GraphShardingStats {
  int segments = 0;
  int programmes = 0;          // distinct (segment structure, head, tail) programmes solved
  int optimal_programmes = 0;  // of which proven optimal
  int reused = 0;              // segment programmes answered from an identical one
  double seconds = 0;
};

// A graph of at most `whole_up_to` nodes is solved as one programme (segments 1), memory row
// included. Infeasible when no sharding fits the memory budget. Throws what solve_sharding throws.
// The solution's status is optimal when every programme was, feasible when some stopped at their
// time limit, infeasible when no combination is.
constexpr int kShardWholeUpTo = 150;
ShardingSolution shard_graph(const OpGraph& graph, int t, const ShardingCosts& costs,
                             const IlpOptions& options = {}, GraphShardingStats* stats = nullptr,
                             int whole_up_to = kShardWholeUpTo);

}  // namespace tessel::planner
