// Pipeline stages cut on the operator DAG by an integer programme (issue 20, TePDist's pipeline
// ILP): every operator gets a stage, every edge goes forward (a consumer's stage is at least its
// producer's), every stage's FLOPs stay within (1 + balance_tolerance) of an equal share, and the
// bytes crossing stage boundaries are as few as possible -- without first putting the graph in a
// line. The backward of an operator runs on its forward's stage, so balancing forward FLOPs
// balances the step.
//
// Variables: z[v][s] binary (operator v on stage s, sum_s z[v][s] = 1); w[u][b] binary for an
// operator u whose output may cross boundary b (between stages b and b + 1):
//   w[u][b] >= sum_{s <= b} z[u][s] + sum_{s > b} z[v][s] - 1   for every consumer v of u,
// so a tensor read two stages later is counted at both boundaries it crosses, as the pipeline
// passes it on (data entering the graph, OpKind::input, is loaded where it is read: never).
// Objective: sum over u, b of bytes(u) w[u][b].
// Order: sum_s s z[u][s] <= sum_s s z[v][s] for every edge u -> v.
// Balance: sum_v flops(v) z[v][s] <= (1 + tolerance) total / stages, and each stage non-empty.
//
// Windows keep the programme small on large graphs: with window k >= 0 an operator may only go to
// the stages within k of where an even split of a topological order's FLOP prefix would put it
// (the DAG constraints still decide within the window); window < 0 allows every stage.
#pragma once

#include <vector>

#include "tessel/planner/ilp.h"
#include "tessel/planner/op_graph.h"

namespace tessel::planner {

struct PipelineCutOptions {
  double balance_tolerance = 0.1;  // each stage's FLOPs <= (1 + this) x an equal share
  int window = 1;                  // stages either side of the FLOP-prefix position; < 0: all
  double bytes_per_element = 4;
  // Cut only between critical nodes (OpGraph::critical_nodes): the programme then runs on the
  // graph coarsened to one node per segment (its FLOPs summed, its critical tail's output the
  // only tensor that can cross after it), which is small at any depth. Exact whenever the best
  // cuts lie on critical nodes -- a transformer's do: anything else crosses more than the
  // residual stream. A graph without critical nodes is cut whole.
  bool coarsen = false;
  // With coarsen: a stage may end only where OpNode::layer changes (a transformer's units:
  // embedding, blocks, head), so that the stages map onto the runtime's layers_per_stage.
  bool whole_layers = false;
  IlpOptions ilp = {};
};

struct PipelineCut {
  IlpStatus status = IlpStatus::no_solution;
  std::vector<int> stage;           // per node (empty without a solution)
  std::vector<double> stage_flops;  // per stage
  double crossing_bytes = 0;        // the objective
  int variables = 0, constraints = 0;
  double solve_s = 0;
};

// Throws InvalidArgumentError for stages < 1 or more stages than nodes with FLOPs, a negative
// tolerance, and what OpGraph::validate() throws.
PipelineCut cut_pipeline(const OpGraph& graph, int stages, const PipelineCutOptions& options = {});

}  // namespace tessel::planner
