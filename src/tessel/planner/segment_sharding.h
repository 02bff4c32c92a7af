// A large graph's sharding over any strategy space (one mesh axis, sharding_ilp.h, or a mesh of
// two, mesh_sharding.h), TePDist's way: cut at the critical nodes (OpGraph::critical_nodes: a
// transformer's residual adds) into segments that meet only there, solve each segment's
// programme (sharding_programme.h) exactly for every pair of strategies of its head and tail
// critical nodes, and join the segments by dynamic programming over the critical nodes'
// strategies. Segments with the same structure and the same head and tail strategies (every block
// of a transformer looks alike) are solved once.
//
// The result is optimal for the whole graph's programme without the memory row: the segments
// meet only in their critical nodes, whose strategies the DP enumerates, so every edge and every
// node is costed exactly once.
//
// Pairs the DP cannot use are not solved. A segment's cost for head a and tail b is at least its
// programme's with the head free (bound_b) and with the tail free (bound_a) -- each programme's
// proven dual bound, so a time-limited one still bounds. A pair whose best path to its head plus
// max(bound_a, bound_b) cannot beat the tail's best so far is skipped, heads tried cheapest
// first. Exact, and it pays where the boundary nodes have many strategies (a 2-axis mesh's
// residual stream: tens, so hundreds of pairs per segment): the bounds cost |heads| + |tails|
// programmes, so they are used only when the pairs are several times that.
//
// The memory budget couples all segments, which no segment's programme sees: when the
// unconstrained optimum does not fit, the state is priced (Lagrangian relaxation: the space's
// cost at a memory price, ShardingCosts::memory_price) and the least price whose DP fits is
// searched; the fastest fitting plan is returned as feasible, with the best dual bound as
// bound_s. A weight shared across segments (a head tied to the embedding) is handled by running
// the DP once per layout of that weight (StrategySpace::same_weights), each node limited to the
// strategies holding it so, keeping the best.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "tessel/planner/sharding_programme.h"

namespace tessel::planner {

struct GraphShardingStats {
  int segments = 0;
  int programmes = 0;          // distinct programmes solved (pairs and bounds)
  int optimal_programmes = 0;  // of which proven optimal
  int reused = 0;              // segment programmes answered from an identical one
  int pruned = 0;              // (head, tail) pairs the bounds showed the DP cannot use
  double seconds = 0;
};

// A graph of at most this many nodes is solved as one programme, memory row included.
constexpr int kShardWholeUpTo = 150;

// The space at a memory price (seconds per byte of training state, added to every strategy's
// cost; 0: none). Its strategies must not depend on the price.
using SpaceAtPrice = std::function<std::unique_ptr<StrategySpace>(double memory_price)>;

// `space_key` names what the space's costs depend on besides the graph (its mesh, its rates):
// segments are reused only between programmes of equal keys. The result's status is optimal when
// every programme was, feasible when some stopped at their time limit or the memory was priced,
// infeasible when no combination fits `memory_bytes`. Throws what solve_programme throws.
Programme shard_by_segments(const OpGraph& graph, const SpaceAtPrice& space,
                            const std::string& space_key, double memory_bytes,
                            const IlpOptions& options, GraphShardingStats& stats,
                            int whole_up_to = kShardWholeUpTo);

}  // namespace tessel::planner
