// The graph planner for one layout of an operator graph on a cluster (issue 20): every operator's
// sharding across the tp devices of a host (graph_sharding.h, TePDist's decomposition) and,
// optionally, the graph cut into pipeline stages on its DAG (pipeline_ilp.h), with the rates of
// the cluster the layer planner uses (sharding_costs). What `tessel plan --onnx` prints.
//
// Not yet here: a step time with the pipeline schedule and data parallelism on top (the layer
// planner's), a 2-D mesh, and a plan file the runtime can train with; `runnable` says so.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessel/planner/cluster.h"
#include "tessel/planner/graph_sharding.h"
#include "tessel/planner/op_graph.h"
#include "tessel/planner/pipeline_ilp.h"

namespace tessel::planner {

// The tensor-parallel axis's rates: the device's peak in `precision` at its large-GEMM efficiency
// (ClusterSpec's gemm.max_efficiency, the saturated rate of the cost model's curve), the
// intra-host link's collective bandwidth and latency, elements of the precision's size, Adam
// state per weight (16 bytes in fp32, 18 with a master copy), the device's usable memory.
// Throws ConfigError when the device has no rate for the precision.
ShardingCosts sharding_costs(const ClusterSpec& cluster, Precision precision);

struct GraphPlanRequest {
  int tp = 1;            // devices of one host the operators are sharded across
  int stages = 1;        // pipeline stages (1: no cut)
  double balance = 0.1;  // each stage's FLOPs <= (1 + balance) x an equal share
  Precision precision = Precision::bf16;
  IlpOptions ilp = {};
};

struct GraphPlan {
  int tp = 1, stages = 1;
  ShardingSolution sharding;
  GraphShardingStats stats;
  std::optional<PipelineCut> cut;  // with stages > 1
  // Why the runtime cannot train with this plan (empty when it can).
  std::string not_runnable;
};

// Throws InvalidArgumentError for tp above the cluster's devices per host or below 1, stages
// below 1, and what shard_graph and cut_pipeline throw.
GraphPlan plan_graph(const OpGraph& graph, const ClusterSpec& cluster,
                     const GraphPlanRequest& request);

// The plan as JSON: the layout, the objective and ILP statistics, one entry per operator (name,
// op, kind, shape, strategy, stage), the stages' FLOPs and crossing bytes.
nlohmann::json graph_plan_json(const OpGraph& graph, const GraphPlan& plan);

}  // namespace tessel::planner
