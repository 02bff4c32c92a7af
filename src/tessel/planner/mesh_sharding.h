// The sharding of a (sub)graph on a device mesh of two axes as one integer programme
// (sharding_programme.h over mesh_strategies.h): every operator picks a strategy per axis, e.g.
// data parallelism across hosts and Megatron's tensor parallelism within one, the pair chosen
// jointly. Costs, per step, with each axis's own link (ShardingCosts per axis; the device's rate,
// element size, state and memory from axis 0's):
//   compute      3 x the per-device FLOPs (mesh_strategies.h) / flops_per_s;
//   inside       per axis, 2 x the strategy's own collectives on what each device holds (the
//                tokens the other axis's split leaves);
//   weight sync  per axis, a batch split keeping a weight whole on that axis all-reduces its
//                gradient among the axis's groups (its bytes after the other axis's split);
//   edges        forward and backward layout changes axis by axis (mesh_reshard), a producer
//                with several readers summing their gradients first, as on one axis;
//   memory       the weights' training state per device within memory_bytes.
// solve_mesh_sharding is one programme for a whole (sub)graph; shard_mesh_graph decomposes a large
// graph at its critical nodes as on one axis (segment_sharding.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tessel/planner/ilp.h"
#include "tessel/planner/mesh_strategies.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/segment_sharding.h"
#include "tessel/planner/sharding_ilp.h"

namespace tessel::planner {

struct MeshCosts {
  Mesh mesh;
  std::vector<ShardingCosts> axes;  // per axis: its link; rates, state and memory from axes[0]
};

struct MeshSolution {
  IlpStatus status = IlpStatus::no_solution;
  std::vector<MeshStrategy> chosen;  // per node (empty without a solution)
  std::vector<int> index;
  double time_s = 0, bound_s = 0;
  int variables = 0, constraints = 0;
  double solve_s = 0;
  // Throws InvalidArgumentError when no node has that name.
  const MeshStrategy& of(const OpGraph& graph, const std::string& name) const;
};

// Throws InvalidArgumentError for a mesh mesh_strategies refuses, costs not one per axis or with
// non-positive rates, and what the programme throws.
// `problem` limits nodes to some strategies (indices into mesh_strategies), as on one axis.
MeshSolution solve_mesh_sharding(const OpGraph& graph, const MeshCosts& costs,
                                 const IlpOptions& options = {},
                                 const ShardingProblem& problem = {});

// The programme's view of the mesh's strategies and costs (sharding_programme.h), for the step
// prediction (graph_costs.h). Throws as solve_mesh_sharding does for bad costs.
std::unique_ptr<StrategySpace> mesh_space(const OpGraph& graph, const MeshCosts& costs);

// The whole graph: one programme up to `whole_up_to` nodes, else segments joined by dynamic
// programming with the memory priced across them (segment_sharding.h). Throws as
// solve_mesh_sharding does.
MeshSolution shard_mesh_graph(const OpGraph& graph, const MeshCosts& costs,
                              const IlpOptions& options = {}, GraphShardingStats* stats = nullptr,
                              int whole_up_to = kShardWholeUpTo);

}  // namespace tessel::planner
