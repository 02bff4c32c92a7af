#include "tessel/planner/graph_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "tessel/core/check.h"
#include "tessel/core/error.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/step_simulation.h"
#include "tessel/schedule/named.h"

namespace tessel::planner {

namespace {
constexpr int kCoarsenAbove = 2000;  // nodes
constexpr double kGiB = 1024.0 * 1024 * 1024;
}  // namespace

namespace {

// The units of a transformer graph (0 the embedding, 1 + l block l, n_layer + 1 the head) per
// stage, or why the stages do not hold whole units in order.
std::optional<std::vector<int>> units_per_stage(const OpGraph& g, const std::vector<int>& stage,
                                                int stages, int n_layer, std::string* why) {
  std::vector<int> unit_stage(size_t(n_layer + 2), -1);
  bool in_blocks = false;
  for (int v : g.validate()) {
    const OpNode& n = g.node(v);
    if (n.kind == OpKind::input) continue;
    in_blocks = in_blocks || n.layer >= 0;
    const int unit = n.layer >= 0 ? n.layer + 1 : in_blocks ? n_layer + 1 : 0;
    const int s = stage.empty() ? 0 : stage[size_t(v)];
    if (unit_stage[size_t(unit)] >= 0 && unit_stage[size_t(unit)] != s) {
      *why = fmt::format("the cut puts unit {} ({}) on stages {} and {}", unit, n.name,
                         unit_stage[size_t(unit)], s);
      return std::nullopt;
    }
    unit_stage[size_t(unit)] = s;
  }
  std::vector<int> per_stage(size_t(stages), 0);
  for (size_t u = 0; u < unit_stage.size(); ++u) {
    if (unit_stage[u] < 0 || (u > 0 && unit_stage[u] < unit_stage[u - 1])) {
      *why = fmt::format("unit {} is {}", u, unit_stage[u] < 0 ? "missing" : "out of order");
      return std::nullopt;
    }
    ++per_stage[size_t(unit_stage[u])];
  }
  return per_stage;
}

// The split the runtime's tensor parallelism runs (Megatron-LM's), or why the sharding differs.
std::string differs_from_runtime(const OpGraph& g, const ShardingSolution& s, int tp) {
  if (tp == 1) return "";
  for (int v = 0; v < g.size(); ++v) {
    const OpNode& n = g.node(v);
    if (n.layer < 0 || n.kind != OpKind::matmul || n.weights.empty()) continue;
    const bool row =
        n.name.ends_with("c_proj") || n.name.ends_with("o_proj") || n.name.ends_with("down_proj");
    const std::string& chosen = s.chosen[size_t(v)].name;
    if (chosen != (row ? "row" : "column"))
      return fmt::format(
          "the sharding splits {} as {}, the runtime's tensor parallelism as {} (Megatron-LM's)",
          n.name, chosen, row ? "row" : "column");
  }
  return "";
}

}  // namespace

GraphPlan plan_graph(const OpGraph& graph, const ClusterSpec& cluster,
                     const GraphPlanRequest& request) {
  TESSEL_CHECK(request.tp >= 1 && request.tp <= cluster.devices_per_host, InvalidArgumentError,
               "tp {} does not fit {}'s hosts of {} devices; choose tp between 1 and {}",
               request.tp, cluster.name, cluster.devices_per_host, cluster.devices_per_host);
  TESSEL_CHECK(
      request.stages >= 1 && request.dp >= 1 && request.micro_batches >= 1 && request.outer >= 1,
      InvalidArgumentError,
      "stages ({}), dp ({}), micro-batches ({}) and the mesh's outer axis ({}) must each "
      "be at least 1",
      request.stages, request.dp, request.micro_batches, request.outer);
  GraphPlan plan;
  plan.tp = request.tp;
  plan.outer = request.outer;
  plan.stages = request.stages;
  plan.schedule = request.schedule;
  // Model chunks per rank: the interleaved and V schedules run two.
  const bool chunked = request.schedule == "zb-v" || request.schedule == "interleaved-1f1b";
  plan.virtual_stages = request.virtual_stages > 0 ? request.virtual_stages : chunked ? 2 : 1;
  const int n_vs = request.stages * plan.virtual_stages;
  // The sharding comes before the cut: its budget is the whole pipeline's (each rank holds its
  // stage's share); the cut's ranks are checked against one device below.
  ShardingCosts rates = sharding_costs(cluster, request.precision);
  const double device_bytes = rates.memory_bytes;
  rates.memory_bytes = device_bytes * request.stages;
  const int mesh_devices = request.outer * request.tp;
  std::optional<MeshCosts> mesh_costs;
  if (request.outer > 1) {
    ShardingCosts across = rates;
    if (mesh_devices > cluster.devices_per_host) {
      across.bandwidth = cluster.inter_host.coll_bandwidth();
      across.latency_s = cluster.inter_host.coll_latency();
      across.bus_curve.clear();
      // The outer axis's members on a host: as many as the host holds tp groups.
      const GroupLink outer = GroupLink::across(cluster.inter_host, across.bandwidth, request.outer,
                                                std::max(1, cluster.devices_per_host / request.tp));
      across.nccl = outer.nccl;
      across.ranks = request.outer;
      across.hosts = outer.hosts;
    }
    // The programme prices one micro-batch's passes, and the weight-gradient sync runs once a
    // step: on a mesh, whose outer axis is data parallelism when the programme chooses so, each
    // micro-batch carries 1/m of it. (The tp axis alone keeps the whole sync per micro-batch:
    // there data parallelism is dp's, outside the programme, and a batch split on the tp axis --
    // which 1/m makes the cheaper choice for models as small as GPT-2 124M -- is not what the
    // runtime's tensor parallelism runs.)
    across.sync_share = rates.sync_share = 1.0 / request.micro_batches;
    mesh_costs = MeshCosts{Mesh{{request.outer, request.tp}}, {across, rates}};
    plan.mesh = shard_mesh_graph(graph, *mesh_costs, request.ilp, &plan.stats);
  } else {
    plan.sharding = shard_graph(graph, request.tp, rates, request.ilp, &plan.stats);
  }
  TESSEL_CHECK(plan.mesh ? !plan.mesh->chosen.empty() : !plan.sharding.chosen.empty(),
               InvalidArgumentError,
               "no sharding over {} device{} fits the graph's {:.1f} GiB of parameters' training "
               "state ({} bytes each) in {} x {:.1f} GiB ({} stage{} of {}); raise --tp or "
               "--stages (or use a larger mesh)",
               mesh_devices, mesh_devices == 1 ? "" : "s",
               double(graph.total_parameters()) * rates.state_bytes_per_weight / kGiB,
               rates.state_bytes_per_weight, request.stages, device_bytes / kGiB, request.stages,
               request.stages == 1 ? "" : "s", cluster.device.name);
  auto weight_elements = [&](int v) {
    return plan.mesh ? plan.mesh->chosen[size_t(v)].weight_elements
                     : plan.sharding.chosen[size_t(v)].weight_elements;
  };
  if (n_vs > 1) {
    PipelineCutOptions o;
    o.bytes_per_element = element_bytes(request.precision);
    o.balance_tolerance = request.balance;
    // The whole DAG while its programme stays small; past that, the graph coarsened at its
    // critical nodes (exact for transformers, whose best cuts are there). A transformer the
    // runtime is to train is cut between its units only.
    o.coarsen = graph.size() > kCoarsenAbove || request.model.has_value();
    o.whole_layers = request.model.has_value();
    o.ilp = request.ilp;
    plan.cut = cut_pipeline(graph, n_vs, o);
    TESSEL_CHECK(!plan.cut->stage.empty(), InvalidArgumentError,
                 "no cut of the graph into {} stages keeps every stage within {:.0f}% of an equal "
                 "share of the FLOPs{} (the programme: {}); allow more imbalance (--balance) or "
                 "choose fewer stages",
                 n_vs, 100 * request.balance, o.whole_layers ? " with whole layers per stage" : "",
                 ilp_status_name(plan.cut->status));
  }
  const std::vector<int> stage_of = plan.cut ? plan.cut->stage : std::vector<int>{};
  // Each pipeline rank's weights on one device (zb-v places its chunks as a V); the fullest must
  // fit a device with their training state.
  const auto placement =
      request.schedule == "zb-v" ? schedule::Placement::v_shape : schedule::Placement::interleaved;
  std::vector<double> rank_weights(size_t(request.stages), 0);
  for (int v = 0; v < graph.size(); ++v) {
    if (graph.node(v).weights_of >= 0) continue;  // a tied reader's weights are its owner's
    const int vs = stage_of.empty() ? 0 : stage_of[size_t(v)];
    rank_weights[size_t(schedule::stage_of(request.stages, vs, placement))] += weight_elements(v);
  }
  const auto fullest = std::max_element(rank_weights.begin(), rank_weights.end());
  const double fullest_state = *fullest * rates.state_bytes_per_weight;
  TESSEL_CHECK(fullest_state <= device_bytes, InvalidArgumentError,
               "pipeline rank {} would hold {:.1f} GiB of training state, more than a {}'s "
               "{:.1f} GiB; raise --tp or --stages",
               fullest - rank_weights.begin(), fullest_state / kGiB, cluster.device.name,
               device_bytes / kGiB);
  std::vector<double> sync;
  const auto times =
      plan.mesh
          ? operator_times(graph, *plan.mesh, *mesh_costs, cluster, request.precision, &sync)
          : operator_times(graph, plan.sharding, request.tp, cluster, request.precision, &sync);
  plan.stage_costs = graph_stage_costs(graph,
                                       plan.mesh ? node_work(graph, *plan.mesh, mesh_costs->mesh)
                                                 : node_work(graph, plan.sharding, request.tp),
                                       times, stage_of, n_vs, request.precision);
  // The sharding's own weight-gradient all-reduces (a batch split on the tp axis, or on either
  // axis of a mesh), once per step on each pipeline rank, after its backward: the slowest
  // rank's.
  std::vector<double> rank_sync(size_t(request.stages), 0);
  for (int v = 0; v < graph.size(); ++v) {
    const int vs = stage_of.empty() ? 0 : stage_of[size_t(v)];
    rank_sync[size_t(schedule::stage_of(request.stages, vs, placement))] += sync[size_t(v)];
  }
  plan.tp_sync_s = *std::max_element(rank_sync.begin(), rank_sync.end());

  const int world = request.dp * mesh_devices * request.stages;
  std::string why;
  if (plan.mesh) {
    why =
        "the runtime trains tensor parallelism within hosts and data parallelism across them "
        "(--tp and --dp write that plan); a plan on a 2-axis mesh is a prediction";
  } else if (request.model) {
    const model::ModelConfig& m = *request.model;
    if (auto units = units_per_stage(graph, stage_of, n_vs, m.n_layer, &why)) {
      layout::Plan l;
      l.dp = request.dp;
      l.tp = request.tp;
      l.pp = request.stages;
      l.virtual_stages = plan.virtual_stages;
      l.micro_batch = request.micro_batch;
      l.micro_batches = request.micro_batches;
      l.schedule = layout::parse_schedule(request.schedule);
      l.layers_per_stage = *units;
      try {
        l.validate(m, l.global_batch(), l.world());
        why = differs_from_runtime(graph, plan.sharding, request.tp);
      } catch (const ConfigError& e) {
        why = e.what();
      }
      if (why.empty()) {
        SimulateRequest rq;
        rq.model = m;
        rq.cluster = cluster;
        rq.precision = request.precision;
        rq.plan = l;
        rq.seq = request.seq;
        rq.schedule = request.schedule;
        rq.stage_costs = plan.stage_costs;
        const SimulatedStep step = simulate_step(rq);
        plan.sim = step.sim;
        plan.pipeline_s = step.pipeline_s;
        plan.dp_s = step.dp_exposed_s;
        plan.optimizer_s = step.optimizer_s;
        plan.step_s = step.step_s + plan.tp_sync_s;
        plan.layout = l;
        return plan;
      }
    }
  } else {
    why =
        "the runtime trains the GPT-2 and LLaMA families from their model configs (`tessel plan "
        "--model` or --config); it does not execute an arbitrary operator graph";
  }
  plan.not_runnable = why;
  // Any graph: the pipeline, then the fullest stage's gradient all-reduce and Adam step.
  SimConfig sc;
  sc.costs = plan.stage_costs;
  const LinkSpec& link =
      world <= cluster.devices_per_host ? cluster.intra_host : cluster.inter_host;
  sc.link = Link{link.latency, link.bandwidth};
  plan.sim = simulate(schedule::make_schedule(request.schedule, request.stages,
                                              request.micro_batches, plan.virtual_stages),
                      sc);
  plan.pipeline_s = plan.sim.makespan;
  const int bytes = element_bytes(request.precision);
  if (request.dp > 1) {
    const bool cross = request.dp * mesh_devices > cluster.devices_per_host;
    const LinkSpec& in = cluster.intra_host;
    // Replicas side by side on a host where they fit in one; each group on one rail.
    const GroupLink link =
        cross ? GroupLink::across(cluster.inter_host, cluster.inter_host.coll_bandwidth(),
                                  request.dp, std::max(1, cluster.devices_per_host / mesh_devices))
              : GroupLink{in.coll_bandwidth(), in.coll_latency(), false, in.bus_curve};
    plan.dp_s = CostModel::all_reduce_time(*fullest * bytes, request.dp, link);
  }
  plan.optimizer_s = CostModel::adam_step_time(*fullest, bytes, cluster.device.memory_bandwidth);
  plan.step_s = plan.pipeline_s + plan.tp_sync_s + plan.dp_s + plan.optimizer_s;
  return plan;
}

const std::string& GraphPlan::strategy(int v) const {
  static const std::string none;
  if (v < 0) return none;
  if (mesh) return size_t(v) < mesh->chosen.size() ? mesh->chosen[size_t(v)].name : none;
  return size_t(v) < sharding.chosen.size() ? sharding.chosen[size_t(v)].name : none;
}

nlohmann::json graph_plan_json(const OpGraph& graph, const GraphPlan& plan) {
  nlohmann::json j;
  j["tp"] = plan.tp;
  if (plan.mesh) j["mesh"] = {plan.outer, plan.tp};
  j["stages"] = plan.stages;
  j["status"] = ilp_status_name(plan.sharding_status());
  j["time_s"] = plan.sharding_time_s();
  j["bound_s"] = plan.sharding_bound_s();
  j["segments"] = plan.stats.segments;
  j["programmes"] = plan.stats.programmes;
  j["optimal_programmes"] = plan.stats.optimal_programmes;
  j["reused"] = plan.stats.reused;
  j["pruned"] = plan.stats.pruned;
  j["solve_s"] = plan.stats.seconds;
  auto& ops = j["operators"] = nlohmann::json::array();
  for (int id = 0; id < graph.size(); ++id) {
    const OpNode& n = graph.node(id);
    nlohmann::json o = {{"name", n.name},
                        {"op", n.op_type},
                        {"kind", std::string(op_kind_name(n.kind))},
                        {"shape", n.shape}};
    const size_t planned = plan.mesh ? plan.mesh->chosen.size() : plan.sharding.chosen.size();
    if (size_t(id) < planned) o["strategy"] = plan.strategy(id);
    if (plan.cut && size_t(id) < plan.cut->stage.size()) o["stage"] = plan.cut->stage[size_t(id)];
    ops.push_back(std::move(o));
  }
  j["schedule"] = plan.schedule;
  j["virtual_stages"] = plan.virtual_stages;
  j["step"] = {{"step_s", plan.step_s},           {"pipeline_s", plan.pipeline_s},
               {"tp_sync_s", plan.tp_sync_s},     {"dp_s", plan.dp_s},
               {"optimizer_s", plan.optimizer_s}, {"bubble", plan.sim.bubble_fraction()}};
  auto& stages = j["step"]["stages"] = nlohmann::json::array();
  for (const StageCosts& c : plan.stage_costs)
    stages.push_back({{"forward_s", c.forward},
                      {"backward_input_s", c.backward_input},
                      {"backward_weight_s", c.backward_weight},
                      {"output_bytes", c.output_bytes}});
  if (plan.layout) j["layout"] = layout::to_json(*plan.layout);
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
