#include "tessel/planner/graph_plan.h"

#include <fmt/format.h>

#include "tessel/core/check.h"
#include "tessel/core/error.h"

namespace tessel::planner {

namespace {
constexpr int kCoarsenAbove = 2000;  // nodes
}  // namespace

ShardingCosts sharding_costs(const ClusterSpec& cluster, Precision precision) {
  const double peak = cluster.device.peak(precision);
  TESSEL_CHECK(peak > 0, ConfigError, "{} has no {} rate; choose another --precision",
               cluster.device.name, precision_name(precision));
  ShardingCosts c;
  c.flops_per_s = peak * cluster.device.gemm.max_efficiency;
  c.bandwidth = cluster.intra_host.coll_bandwidth();
  c.latency_s = cluster.intra_host.coll_latency();
  c.bytes_per_element = element_bytes(precision);
  // Parameter, gradient, Adam m and v (and the fp32 master copy in mixed precision).
  c.state_bytes_per_weight = precision == Precision::fp32 ? 16 : 2 + 2 + 12;
  c.memory_bytes = double(cluster.device.usable_bytes());
  return c;
}

GraphPlan plan_graph(const OpGraph& graph, const ClusterSpec& cluster,
                     const GraphPlanRequest& request) {
  TESSEL_CHECK(request.tp >= 1 && request.tp <= cluster.devices_per_host, InvalidArgumentError,
               "tp {} does not fit {}'s hosts of {} devices; choose tp between 1 and {}",
               request.tp, cluster.name, cluster.devices_per_host, cluster.devices_per_host);
  TESSEL_CHECK(request.stages >= 1, InvalidArgumentError, "stages must be >= 1, got {}",
               request.stages);
  GraphPlan plan;
  plan.tp = request.tp;
  plan.stages = request.stages;
  plan.sharding = shard_graph(graph, request.tp, sharding_costs(cluster, request.precision),
                              request.ilp, &plan.stats);
  if (request.stages > 1) {
    PipelineCutOptions o;
    o.bytes_per_element = element_bytes(request.precision);
    o.balance_tolerance = request.balance;
    // The whole DAG while its programme stays small; past that, the graph coarsened at its
    // critical nodes (exact for transformers, whose best cuts are there).
    o.coarsen = graph.size() > kCoarsenAbove;
    o.ilp = request.ilp;
    plan.cut = cut_pipeline(graph, request.stages, o);
  }
  plan.not_runnable =
      "the runtime trains the GPT-2 and LLaMA families from their model configs (`tessel plan "
      "--model` or --config); it does not execute an operator graph's plan yet";
  return plan;
}

nlohmann::json graph_plan_json(const OpGraph& graph, const GraphPlan& plan) {
  nlohmann::json j;
  j["tp"] = plan.tp;
  j["stages"] = plan.stages;
  j["status"] = ilp_status_name(plan.sharding.status);
  j["time_s"] = plan.sharding.time_s;
  j["bound_s"] = plan.sharding.bound_s;
  j["segments"] = plan.stats.segments;
  j["programmes"] = plan.stats.programmes;
  j["optimal_programmes"] = plan.stats.optimal_programmes;
  j["reused"] = plan.stats.reused;
  j["solve_s"] = plan.stats.seconds;
  auto& ops = j["operators"] = nlohmann::json::array();
  for (int id = 0; id < graph.size(); ++id) {
    const OpNode& n = graph.node(id);
    nlohmann::json o = {{"name", n.name},
                        {"op", n.op_type},
                        {"kind", std::string(op_kind_name(n.kind))},
                        {"shape", n.shape}};
    if (size_t(id) < plan.sharding.chosen.size())
      o["strategy"] = plan.sharding.chosen[size_t(id)].name;
    if (plan.cut && size_t(id) < plan.cut->stage.size()) o["stage"] = plan.cut->stage[size_t(id)];
    ops.push_back(std::move(o));
  }
  if (plan.cut) {
    j["cut"] = {{"status", ilp_status_name(plan.cut->status)},
                {"stage_flops", plan.cut->stage_flops},
                {"crossing_bytes", plan.cut->crossing_bytes},
                {"solve_s", plan.cut->solve_s}};
  }
  j["runnable"] = plan.not_runnable.empty();
  if (!plan.not_runnable.empty()) j["not_runnable"] = plan.not_runnable;
  return j;
}

}  // namespace tessel::planner
