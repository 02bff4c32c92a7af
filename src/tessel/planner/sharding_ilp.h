// The sharding of a whole operator graph on one mesh axis of t devices as one integer programme
// (issue 20): one strategy per operator (op_sharding.h) minimising the training step's time on
// the axis, solved with CBC (ilp.h). The graph planner will split large graphs at critical
// nodes and combine per-subgraph programmes by dynamic programming; this is the programme for
// one (sub)graph.
//
// Model, per training step (forward, backward and the weight-gradient sync):
//   compute       3 x the strategy's per-device FLOPs / flops_per_s (backward = 2 forwards);
//   inside        2 x the strategy's own collectives (the loss's all-reduces), forward and
//                 backward;
//   edges         forward, the layout change from the producer's output to what the consumer
//                 reads (op_sharding.h reshard(): all-gather, reduce-scatter, all-reduce,
//                 all-to-all); backward, from the layout of the gradient the consumer's backward
//                 leaves for that input (partial where every device read the input whole but
//                 computed a part: a column-parallel matmul's input) to the layout the
//                 producer's backward needs (its output's; whole for a partial output); each
//                 collective latency + bytes / bandwidth. A producer read by several consumers
//                 sums their gradients first: one change per distinct layout they leave
//                 (backward_gradient_cost);
//   weight sync   a strategy that splits the batch (batch(d)) and keeps a weight replicated
//                 leaves each device part of its gradient: all-reduced, 2 (t - 1) / t of its
//                 bytes;
//   memory        the weights' training state per device (state_bytes_per_weight per element:
//                 fp32 weight, gradient and Adam's two moments by default) within memory_bytes.
//   tied weights  a node reading another's weights (a tied head) holds them in the layout that
//                 node chose.
// Variables (sharding_programme.h): x[v][s] binary, one per node v and strategy s,
// sum_s x[v][s] = 1; for every edge a variable per pair of strategies, the pairs summing to each
// node's choice; for a producer with several readers,
// has[u][G] >= x[v][s'] for each reader strategy leaving gradient layout G, and
// y >= x[u][s] + has[u][G] - 1 for each G that u's strategy s must change.
#pragma once

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tessel/planner/cluster.h"
#include "tessel/planner/ilp.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/op_sharding.h"

namespace tessel::planner {

struct ShardingCosts {
  double flops_per_s = 1e12;     // achieved per device
  double bandwidth = 1e10;       // bytes per second each device sends in a collective
  double latency_s = 1e-5;       // per collective
  double bytes_per_element = 4;  // activations and weights
  double state_bytes_per_weight = 16;
  double memory_bytes = std::numeric_limits<double>::infinity();  // per device, for the state
  // Seconds per byte of training state, added to every strategy's cost: a Lagrangian price for
  // the budget, which graph_sharding.h uses where its per-segment programmes cannot hold it.
  double memory_price = 0;
  // The share of a step's weight-gradient sync each programme's objective (one micro-batch's
  // passes) carries: 1 / the micro-batches per step, whose passes share one sync.
  double sync_share = 1;
  // The link's collectives by message size where measured (cluster.h's BusCurve); empty:
  // latency + bytes / bandwidth.
  BusCurve bus_curve = {};
  // An axis across hosts: its `ranks` over `hosts`, priced by NCCL's model on `bandwidth`
  // (collective_model.h) where defined.
  NcclModel nccl = {};
  int ranks = 1, hosts = 1;
};

struct ShardingSolution {
  IlpStatus status = IlpStatus::no_solution;
  std::vector<OpStrategy> chosen;  // per node (empty without a solution)
  std::vector<int> index;          // per node: the index of its strategy in op_strategies, or -1
  double time_s = 0;               // the objective: the step's time on the axis
  double bound_s = 0;
  int variables = 0, constraints = 0;
  double solve_s = 0;
  // The chosen strategy of the node named `name` (throws InvalidArgumentError if none).
  const OpStrategy& of(const OpGraph& graph, const std::string& name) const;
};

// Throws what op_strategies and validate() throw, and InvalidArgumentError for t < 1 or
// non-positive rates.
ShardingSolution solve_sharding(const OpGraph& graph, int t, const ShardingCosts& costs,
                                const IlpOptions& options = {});

// Part of a graph as one programme (the graph planner's segments): only `active` nodes take part
// (edges from other nodes are left out: data entering the graph, replicated, moves for free),
// each limited to its `allowed` strategy indices (empty: all), and an `uncosted` node's own
// cost is left out (a segment's head: the segment before counts it). Sizes: none, or one per
// node. Inactive nodes get index -1 and a default strategy in the solution.
struct ShardingProblem {
  std::vector<char> active;
  std::vector<std::vector<int>> allowed;
  std::vector<char> uncosted;
};
ShardingSolution solve_sharding(const OpGraph& graph, int t, const ShardingCosts& costs,
                                const IlpOptions& options, const ShardingProblem& problem);

// The programme's view of these strategies and costs (sharding_programme.h), for callers that
// build programmes of their own (segment_sharding.h). Throws as solve_sharding does for bad
// rates.
class StrategySpace;
std::unique_ptr<StrategySpace> one_axis_space(const OpGraph& graph, int t,
                                              const ShardingCosts& costs);

// The same costs for a node's strategies and an edge's layout changes, for callers that combine
// programmes (graph_sharding.h).
double strategy_cost(const OpGraph& graph, int node, const OpStrategy& s, int t,
                     const ShardingCosts& costs);
double edge_cost(const OpGraph& graph, int producer, const OpStrategy& from, int consumer,
                 size_t input, const OpStrategy& to, int t, const ShardingCosts& costs);
// The parts of those costs, for the step prediction that puts each on its pass (graph_costs.h):
// an edge's forward and backward layout changes; one run of a strategy's own collectives (it runs
// them forward and backward); the all-reduce of the gradients of the weights a batch split keeps
// replicated.
struct EdgeCosts {
  double forward = 0, backward = 0;
};
EdgeCosts edge_costs(const OpGraph& graph, int producer, const OpStrategy& from, int consumer,
                     size_t input, const OpStrategy& to, int t, const ShardingCosts& costs);
double inside_cost(const OpStrategy& s, const ShardingCosts& costs);
// The layout of the gradient strategy s's backward leaves for its input k, and the layout a
// producer's backward needs its output's gradient in (strategy s). One collective's time:
// latency + bytes sent per device / bandwidth.
Shard input_gradient(const OpStrategy& s, size_t input, const OpNode& node);
Shard output_gradient(const OpStrategy& s);
// With a bus curve, the time is the bytes sent per device over the curve's bus bandwidth at the
// message's size (nccl-tests' busbw is exactly that ratio).
double collective(const ShardingCosts& costs, double bytes_per_device, double message_bytes);
// The backward layout changes into node u's output gradient under the chosen strategies (one per
// node): the gradients its readers leave, summed locally where they share a layout, each distinct
// layout changed once to what u's backward needs -- so the q, k and v projections of one norm's
// output, column-parallel, cost one all-reduce, not three (Megatron-LM's).
// `readers`: the node's, as OpGraph::readers() lists them.
double backward_gradient_cost(const OpGraph& graph, int node,
                              const std::vector<OpGraph::Read>& readers,
                              const std::vector<OpStrategy>& chosen, int t,
                              const ShardingCosts& costs);
double weight_sync_cost(const OpGraph& graph, int node, const OpStrategy& s, int t,
                        const ShardingCosts& costs);

}  // namespace tessel::planner
