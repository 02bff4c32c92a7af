// The sharding programme (sharding_ilp.h's model) over any space of per-operator strategies: one
// mesh axis (solve_sharding) or a mesh of two (mesh_sharding.h). The space prices each choice;
// the programme is the same:
//   x[v][s] binary, sum_s x[v][s] = 1 for every active node;
//   minimise sum node_cost x + the layout changes on the edges: a variable per pair of the two
//     nodes' strategies, with the two choices as its marginals (below), costing the edge's
//     forward change (and backward, for a producer with one reader); a producer read by
//     several sums their gradients first: has[u][G] >= x[v][b] for each reader strategy leaving
//     gradient G, y >= x[u][a] + has[u][G] - 1 with the cost of changing G into what a needs;
//   the weights' state within memory_bytes; a tied reader's weights in its owner's layout.
// Objective terms are microseconds (seconds near CBC's absolute tolerances proved worse
// solutions optimal).
#pragma once

#include <string>
#include <vector>

#include "tessel/planner/ilp.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner {

class StrategySpace {
 public:
  virtual ~StrategySpace() = default;
  virtual int count(int v) const = 0;
  virtual std::string name(int v, int s) const = 0;
  // Seconds per step of its own: compute, its collectives, weight-gradient sync (memory price).
  virtual double node_cost(int v, int s) const = 0;
  virtual double state_bytes(int v, int s) const = 0;  // its weights' training state per device
  virtual EdgeCosts edge(int u, int a, int v, size_t k, int b) const = 0;
  // The gradient strategy b of v leaves for its input k, as a key (equal layouts, equal keys),
  // and the cost of changing that gradient into what strategy a of its producer u needs.
  virtual std::string gradient_key(int v, int b, size_t k) const = 0;
  virtual double gradient_change(int u, int a, int v, int b, size_t k) const = 0;
  // Whether a tied reader's strategy b holds its owner's weights as the owner's strategy a does.
  virtual bool same_weights(int owner, int a, int reader, int b) const = 0;
  // The parts of node_cost the step prediction puts on passes (graph_costs.h): one run of the
  // strategy's own collectives (it runs them forward and backward), and its weight-gradient
  // all-reduces, once per step.
  virtual double inside(int v, int s) const = 0;
  virtual double step_sync(int v, int s) const = 0;
};

// A chosen plan's communication per node (index: per node its strategy): its own collectives
// (one run), its weight-gradient sync per step, the forward layout changes into its inputs, and
// the backward layout changes into its output's gradient (its readers' gradients summed where
// they share a layout, each distinct layout changed once). An input node may have none (-1): it
// is loaded as its readers read it. Throws InvalidArgumentError when any other node has none.
struct NodeComm {
  double inside = 0, step_sync = 0, forward_edges = 0, backward_edges = 0;
};
std::vector<NodeComm> node_comm(const OpGraph& graph, const StrategySpace& space,
                                const std::vector<int>& index);

struct Programme {
  IlpStatus status = IlpStatus::no_solution;
  std::vector<int> index;  // per node: the chosen strategy, -1 when inactive (empty: none)
  double time_s = 0, bound_s = 0;
  int variables = 0, constraints = 0;
  double solve_s = 0;
};

// `tight` (the default): each edge's pairs as variables whose marginals are the two nodes'
// choices (sum over b of e[a][b] = x[u][a], and over a = x[v][b]) instead of
// y >= x[u][a] + x[v][b] - 1 for the pairs that cost anything: more variables, but a relaxation
// near the integer optimum where the weak linking's is far below it. Measured: a 2-axis mesh's
// block, weak: bound at half the optimum after 60 s, tight: optimal in 1 s; one axis, GPT-2 124M
// 0.88 -> 0.12 s, GPT-3 175B 0.76 -> 0.15 s, an exported 2-block LLaMA 2.3 -> 0.13 s, the same
// optima.
// Throws InvalidArgumentError when the problem's sizes do not match the graph or a node allows a
// strategy the space does not have.
Programme solve_programme(const OpGraph& graph, const StrategySpace& space, double memory_bytes,
                          const IlpOptions& options, const ShardingProblem& problem,
                          bool tight = true);

// A programme's result as a solution of the space's strategies (ShardingSolution, MeshSolution:
// status, statistics, time, and per node its index and strategy, `space.of(v)` listing them).
template <class Solution, class Space>
Solution solution_of(const Programme& r, const Space& space, int nodes) {
  Solution out;
  out.status = r.status;
  out.variables = r.variables;
  out.constraints = r.constraints;
  out.solve_s = r.solve_s;
  out.bound_s = r.bound_s;
  if (r.index.empty()) return out;
  out.time_s = r.time_s;
  out.index = r.index;
  out.chosen.resize(size_t(nodes));
  for (int v = 0; v < nodes; ++v)
    if (r.index[size_t(v)] >= 0) out.chosen[size_t(v)] = space.of(v)[size_t(r.index[size_t(v)])];
  return out;
}

}  // namespace tessel::planner
