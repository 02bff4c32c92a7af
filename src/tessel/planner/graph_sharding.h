// A large graph's sharding on one mesh axis, TePDist's way (segment_sharding.h): cut at the
// critical nodes into segments, each segment's programme (sharding_ilp.h) solved exactly for
// every pair of strategies of its head and tail, the segments joined by dynamic programming over
// the critical nodes' strategies, the memory budget priced across them.
#pragma once

#include "tessel/planner/segment_sharding.h"
#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner {

// A graph of at most `whole_up_to` nodes is solved as one programme (segments 1), memory row
// included. Infeasible when no sharding fits the memory budget. Throws what solve_sharding throws.
// The solution's status is optimal when every programme was, feasible when some stopped at their
// time limit (or the memory was priced), infeasible when no combination is.
ShardingSolution shard_graph(const OpGraph& graph, int t, const ShardingCosts& costs,
                             const IlpOptions& options = {}, GraphShardingStats* stats = nullptr,
                             int whole_up_to = kShardWholeUpTo);

}  // namespace tessel::planner
