// The graph planner for one layout of an operator graph on a cluster (issue 20): every operator's
// sharding across the tp devices of a host (graph_sharding.h, TePDist's decomposition), the graph
// cut into pipeline stages on its DAG (pipeline_ilp.h), and the training step this predicts: the
// operators' times (graph_costs.h) summed per stage and run through the pipeline simulator under
// a named schedule, with data parallelism and the optimizer step on top. What `tessel plan
// --onnx` prints.
//
// The step:
//   with the transformer config the graph was built from (GraphPlanRequest::model), the stages
//     end only between its units, the plan is a runtime layout (layers_per_stage from the cut:
//     `tessel train --plan`), and the step is the layer planner's simulate_step
//     (step_simulation.h) run on the graph's stage costs -- the same dp sync, optimizer and
//     collectives, so the two planners differ only in what the stages cost;
//   otherwise (any ONNX graph) the simulated pipeline, then the weight-gradient all-reduces of the
//     operators whose sharding splits the batch on the tp axis (once per step: graph_costs.h),
//     then the fullest stage's gradient all-reduce over dp, none of it hidden behind the backward
//     (an upper bound), then its Adam step, memory-bound like CostModel::optimizer_step.
// Memory: the sharding programme holds the parameters' training state within the whole
// pipeline's memory (a device's usable bytes x stages); the cut's fullest pipeline rank must then
// fit one device, else one error names it and the fix (more tp or stages). Activations are not
// counted here (the layer planner's memory model does that for the runtime's layouts).
// On a 2-axis mesh (GraphPlanRequest::outer) the sharding is the mesh's and the step the generic
// one: the outer axis's weight-gradient all-reduces (its batch splits: data parallelism) once per
// step, not overlapped. The runtime does not take such a plan (it trains tp within hosts and dp
// across them: --tp and --dp write that plan).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/graph_costs.h"
#include "tessel/planner/graph_sharding.h"
#include "tessel/planner/mesh_sharding.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/pipeline_ilp.h"
#include "tessel/planner/simulator.h"

namespace tessel::planner {

struct GraphPlanRequest {
  int tp = 1;            // devices of one host the operators are sharded across
  int stages = 1;        // pipeline stages (1: no cut)
  double balance = 0.1;  // each stage's FLOPs <= (1 + balance) x an equal share
  Precision precision = Precision::bf16;
  IlpOptions ilp = {};
  // A 2-axis mesh's outer axis: every operator's sharding over outer x tp devices per stage
  // (mesh_sharding.h: one strategy per axis, chosen jointly; the outer axis on the inter-host
  // link once the mesh outgrows a host). The graph is then one micro-batch of the whole mesh.
  // 1: the tp axis alone.
  int outer = 1;
  int dp = 1;                     // replicas of the whole pipeline
  int micro_batches = 1;          // per step and replica (the graph is one micro-batch's)
  std::string schedule = "1f1b";  // schedule/named.h
  // Model chunks per pipeline rank; 0: as the schedule needs (2 for zb-v and interleaved-1f1b),
  // the graph then cut into stages x virtual_stages pieces.
  int virtual_stages = 0;
  // The transformer the graph was built from (transformer_graph.h) with micro-batches of
  // `micro_batch` samples of `seq` tokens: see above.
  std::optional<model::ModelConfig> model;
  int seq = 0;
  int64_t micro_batch = 1;
};

struct GraphPlan {
  int tp = 1, stages = 1, virtual_stages = 1, outer = 1;
  ShardingSolution sharding;         // on the tp axis (empty on a mesh)
  std::optional<MeshSolution> mesh;  // on the outer x tp mesh (GraphPlanRequest::outer > 1)
  GraphShardingStats stats;
  std::optional<PipelineCut> cut;       // with stages x virtual_stages > 1
  std::vector<StageCosts> stage_costs;  // per virtual stage, in the model's order
  SimResult sim;  // the pipeline phase, with its timeline (trace.h: simulation_trace)
  // step_s: the pipeline, the tp axis's weight-gradient all-reduces (a batch split there: once
  // per step, not overlapped), dp and the optimizer.
  double pipeline_s = 0, tp_sync_s = 0, dp_s = 0, optimizer_s = 0, step_s = 0;
  std::string schedule;
  // The runtime's layout (with a model): `tessel train --plan` trains with its to_json.
  std::optional<layout::Plan> layout;
  // Why the runtime cannot train with this plan (empty when it can).
  std::string not_runnable;

  // The sharding's result, whichever kind it is (the mesh's or the tp axis's): its status, its
  // objective and bound, and node v's strategy ("" for none).
  IlpStatus sharding_status() const { return mesh ? mesh->status : sharding.status; }
  double sharding_time_s() const { return mesh ? mesh->time_s : sharding.time_s; }
  double sharding_bound_s() const { return mesh ? mesh->bound_s : sharding.bound_s; }
  const std::string& strategy(int v) const;
};

// Throws InvalidArgumentError for tp above the cluster's devices per host or below 1, stages,
// dp or micro-batches below 1, ConfigError for an unknown schedule or a layout the model does not
// take, and what shard_graph, cut_pipeline and the simulator throw.
GraphPlan plan_graph(const OpGraph& graph, const ClusterSpec& cluster,
                     const GraphPlanRequest& request);

// The plan as JSON: the layout, the objective and ILP statistics, the predicted step (pipeline,
// dp, optimizer, step seconds, bubble, per-stage costs), the runtime layout when there is one,
// one entry per operator (name, op, kind, shape, strategy, stage), the stages' FLOPs and crossing
// bytes.
nlohmann::json graph_plan_json(const OpGraph& graph, const GraphPlan& plan);

}  // namespace tessel::planner
