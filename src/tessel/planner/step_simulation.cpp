#include "tessel/planner/step_simulation.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "tessel/core/check.h"
#include "tessel/planner/memory_model.h"
#include "tessel/planner/search.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/named.h"

namespace tessel::planner {

namespace {

using UnitRange = std::pair<int, int>;  // [begin, end) of a virtual stage's units

bool is_backward(schedule::Op op) {
  return op == schedule::Op::backward || op == schedule::Op::backward_input ||
         op == schedule::Op::backward_weight;
}

// The link of a collective over `ranks` of a world of `world` devices (one host or not).
GroupLink collective_link(const ClusterSpec& c, int world) {
  if (world <= c.devices_per_host)
    return GroupLink{c.intra_host.coll_bandwidth(), c.intra_host.coll_latency(), false,
                     c.intra_host.bus_curve};
  return GroupLink{c.inter_host.coll_bandwidth(), c.inter_host.coll_latency(), true, {}};
}

// Activations in flight per stage of interleaved 1F1B (schedule/generators.h), the greedy
// dispatcher's default caps with chunks > 1.
int interleaved_in_flight(int p, int s, int v, int64_t m) {
  return int(std::min<int64_t>(v * m, 2 * (p - s - 1) + (v - 1) * p + 1));
}

// Measured collectives of a group size, where the request has them, else the cluster's link.
GroupLink measured(const SimulateRequest& rq, int ranks, GroupLink fallback) {
  const auto it = rq.collectives.find(ranks);
  if (it == rq.collectives.end()) return fallback;
  // What was measured on this machine replaces the preset's curve.
  return GroupLink{it->second.bandwidth, it->second.latency, fallback.cross_host, {}};
}

// Checks the request and its plan; returns the cluster resized to the plan's world.
ClusterSpec checked_cluster(const SimulateRequest& rq, const layout::Plan& plan) {
  const model::ModelConfig& model = rq.model;
  model.validate();
  const int world = plan.world();
  TESSEL_CHECK(world >= 1, ConfigError, "simulate: the plan has {} workers", world);
  const ClusterSpec cluster =
      rq.cluster.num_devices() == world ? rq.cluster : rq.cluster.with_devices(world);
  cluster.validate();
  plan.validate(model, plan.global_batch(), world);
  TESSEL_CHECK(rq.seq >= 1 && rq.seq <= model.max_seq_len, ConfigError,
               "simulate: sequence length {} is outside model '{}' (1 to max_seq_len {})", rq.seq,
               model.name, model.max_seq_len);
  TESSEL_CHECK(rq.dp_overlap >= 0 && rq.dp_overlap <= 1, ConfigError,
               "simulate: dp overlap {} must be in [0, 1]", rq.dp_overlap);
  return cluster;
}

// The cost model of the units: the tp all-reduces inside the unit times use the tp group's own
// measurement, where the request has one.
CostModel unit_cost_model(const SimulateRequest& rq, const ClusterSpec& cluster, int tp) {
  CostOptions options;
  options.precision = rq.precision;
  options.dp_overlap = rq.dp_overlap;
  ClusterSpec unit_cluster = cluster;
  if (const auto it = rq.collectives.find(tp);
      it != rq.collectives.end() && tp <= cluster.devices_per_host) {
    unit_cluster.intra_host.collective_bandwidth = it->second.bandwidth;
    unit_cluster.intra_host.collective_latency = it->second.latency;
  }
  return CostModel(rq.model, unit_cluster, options, rq.profile);
}

bool is_block(const model::ModelConfig& model, int u) {
  return u >= 1 && u <= model.n_layer;
}

// One micro-batch's times per unit (embedding, blocks, head) on one tp rank. Tensor-parallel units
// measured with their all-reduces (a profile's tp_layer_times) replace the estimate of scaled
// tp = 1 times plus modelled all-reduces.
std::vector<PassTimes> unit_times(const SimulateRequest& rq, const layout::Plan& plan,
                                  const CostModel& cost) {
  const model::ModelConfig& model = rq.model;
  const int tp = plan.tp, U = model.n_layer + 2, seq = rq.seq;
  const int64_t b = plan.micro_batch;
  const ComputeProfile* tp_measured = nullptr;
  if (const auto it = rq.tp_profiles.find(tp);
      tp > 1 && it != rq.tp_profiles.end() && it->second.seq == seq)
    tp_measured = &it->second;
  const auto tp_point = tp_measured ? tp_measured->at(b) : ProfilePoint{};
  std::vector<PassTimes> unit(static_cast<size_t>(U));
  for (int u = 0; u < U; ++u) {
    unit[size_t(u)] = !tp_measured             ? cost.unit(u, b, seq, tp)
                      : u == 0                 ? tp_point.embedding
                      : u == model.n_layer + 1 ? tp_point.head
                                               : tp_point.block;
  }
  return unit;
}

// The plan's split of the units into virtual stages, or the one balanced by the units' costs.
std::vector<int> units_per_stage(const model::ModelConfig& model, const layout::Plan& plan,
                                 const std::vector<PassTimes>& unit) {
  if (!plan.layers_per_stage.empty()) return plan.layers_per_stage;
  std::vector<double> unit_cost(unit.size());
  for (size_t u = 0; u < unit.size(); ++u)
    unit_cost[u] =
        unit[u].step(plan.recompute == model::Recompute::full && is_block(model, int(u)));
  return balance_stages(unit_cost, plan.num_stages()).units_per_stage;
}

std::vector<UnitRange> stage_units(const layout::Plan& plan) {
  std::vector<UnitRange> units_of(static_cast<size_t>(plan.num_stages()));
  int begin = 0;
  for (int s = 0; s < plan.num_stages(); ++s) {
    units_of[size_t(s)] = {begin, begin + plan.layers_per_stage[size_t(s)]};
    begin += plan.layers_per_stage[size_t(s)];
  }
  return units_of;
}

// Per virtual stage: its units' times (recompute added to the backward) and stored activations,
// and the b*s*h activations it sends on.
std::vector<StageCosts> stage_costs(const SimulateRequest& rq, const layout::Plan& plan,
                                    const std::vector<PassTimes>& unit,
                                    const std::vector<UnitRange>& units_of) {
  const model::ModelConfig& model = rq.model;
  const int64_t b = plan.micro_batch;
  const double boundary_bytes = double(b) * rq.seq * model.n_embd * element_bytes(rq.precision);
  std::vector<StageCosts> costs;
  for (const auto& [begin, end] : units_of) {
    StageCosts c;
    c.forward = c.backward = c.backward_input = c.backward_weight = c.activation_bytes = 0;
    for (int u = begin; u < end; ++u) {
      const PassTimes& t = unit[size_t(u)];
      const bool block = is_block(model, u);
      const double rc = plan.recompute == model::Recompute::full && block ? t.recompute : 0;
      c.forward += t.forward;
      c.backward += t.backward() + rc;
      c.backward_input += t.backward_input + rc;
      c.backward_weight += t.backward_weight;
    }
    c.activation_bytes = stage_activation_bytes(model, begin, end, b, rq.seq, plan.tp, rq.precision,
                                                plan.recompute, plan.split_backward())
                             .per_slot;
    c.output_bytes = boundary_bytes;
    costs.push_back(c);
  }
  return costs;
}

// The simulator's link, slow stages and jitter (costs are set per run).
SimConfig sim_config(const SimulateRequest& rq, const layout::Plan& plan, const CostModel& cost) {
  SimConfig sc;
  const GroupLink pl = cost.pp_link(plan.world());
  sc.link = Link{pl.latency, pl.bandwidth};
  if (!rq.slowdown.empty()) {
    TESSEL_CHECK(int(rq.slowdown.size()) == plan.pp, ConfigError,
                 "simulate: {} slowdown factors for {} pipeline ranks", rq.slowdown.size(),
                 plan.pp);
    sc.slowdown = rq.slowdown;
  }
  sc.jitter = rq.jitter;
  if (!rq.stage_jitter.empty()) {
    TESSEL_CHECK(int(rq.stage_jitter.size()) == plan.pp, ConfigError,
                 "simulate: {} jitter values for {} pipeline ranks", rq.stage_jitter.size(),
                 plan.pp);
    sc.stage_jitter = rq.stage_jitter;
  }
  sc.seed = rq.seed;
  return sc;
}

// What the pipeline runs: a schedule's lists made by name, or the greedy dispatcher.
struct PipelineSchedule {
  bool greedy = false;
  schedule::Schedule lists;    // unless greedy
  GreedyOptions dispatcher;    // if greedy
  double analytic_bubble = 0;  // with equal stages and free links
};

PipelineSchedule pipeline_schedule(const std::string& kind, const SimulateRequest& rq,
                                   const layout::Plan& plan) {
  const int pp = plan.pp, v = plan.virtual_stages, m = int(plan.micro_batches);
  PipelineSchedule ps;
  if (kind != "greedy" && kind != "adaptive") {
    TESSEL_CHECK(schedule::is_schedule_name(kind), ConfigError,
                 "simulate: unknown schedule '{}' (known: {}, adaptive, greedy)", kind,
                 fmt::join(schedule::schedule_names(), ", "));
    ps.lists = schedule::make_schedule(kind, pp, m, v);
    if (plan.jit_recompute) ps.lists = schedule::with_jit_recompute(ps.lists);
    ps.analytic_bubble = schedule::analytic_bubble(kind, pp, m, v);
    return ps;
  }
  // "adaptive" is the runtime's dispatcher (split backward, the plan's caps); "greedy" the same
  // rule with whole backward passes.
  ps.greedy = true;
  ps.dispatcher.stages = pp;
  ps.dispatcher.micro_batches = m;
  ps.dispatcher.chunks = v;
  ps.dispatcher.split_backward = kind == "adaptive";
  if (plan.v_shaped()) ps.dispatcher.placement = schedule::Placement::v_shape;
  if (rq.memory_cap > 0) {
    ps.dispatcher.memory_cap = rq.memory_cap;
  } else if (kind == "adaptive") {
    for (int s = 0; s < pp; ++s) {
      ps.dispatcher.stage_memory_caps.push_back(plan.dispatch_cap(s));
      ps.dispatcher.stage_backward_caps.push_back(plan.dispatch_backward_cap(s));
    }
  } else {
    for (int s = 0; s < pp; ++s)
      ps.dispatcher.stage_memory_caps.push_back(v == 1 ? pp - s
                                                       : interleaved_in_flight(pp, s, v, m));
  }
  ps.analytic_bubble = schedule::bubble_fraction(pp, m, v);
  return ps;
}

// The pipeline with every stage's compute `scale` times as long.
SimResult run_pipeline(const PipelineSchedule& ps, SimConfig sc,
                       const std::vector<StageCosts>& costs, double scale) {
  sc.costs = costs;
  for (auto& c : sc.costs) {
    c.forward *= scale;
    c.backward *= scale;
    c.backward_input *= scale;
    c.backward_weight *= scale;
  }
  return ps.greedy ? simulate_greedy(ps.dispatcher, sc) : simulate(ps.lists, sc);
}

struct CpuShare {
  double scale = 1;     // of the profile's compute times
  double slowdown = 1;  // of full-speed compute
};

// CPU sharing: workers time-slice the cores while more worker threads compute than there are
// cores. The profile's times hold for all workers computing at once; a pipeline keeps only some
// ranks busy, so the slowdown is found as a fixed point of the simulated number of busy ranks
// (pipeline ranks busy x dp x tp processes each). `run(scale)` simulates the pipeline.
template <typename Run>
CpuShare cpu_share(const SimulateRequest::Cpu& cpu, const layout::Plan& plan, Run&& run) {
  if (cpu.cores <= 0) return {};
  const double per_busy = double(plan.dp) * plan.tp * cpu.threads_per_worker / cpu.cores;
  auto slowdown = [&](double busy_ranks) { return std::max(1.0, busy_ranks * per_busy); };
  double f = slowdown(plan.pp);
  for (int it = 0; it < 20; ++it) {
    const SimResult sim = run(f / cpu.profile_oversubscription);
    double busy = 0;
    for (double b : sim.busy) busy += b;
    const double next = slowdown(sim.makespan > 0 ? busy / sim.makespan : 0);
    if (std::abs(next - f) < 1e-4 * f) break;
    f = 0.5 * (f + next);
  }
  return {f / cpu.profile_oversubscription, f};
}

// Parameters of the virtual stage of `units` (one tp shard); with a pipeline the head's stage holds
// its own copy of a tied embedding.
double stage_params(const model::ModelConfig& model, const layout::Plan& plan, UnitRange units) {
  double p = 0;
  for (int u = units.first; u < units.second; ++u) p += double(unit_params(model, u, plan.tp));
  if (model.tie_embeddings && plan.pp > 1 && units.second == model.n_layer + 2)
    p += double(model.padded_vocab()) * model.n_embd / plan.tp;
  return p;
}

std::vector<double> params_per_rank(const model::ModelConfig& model, const layout::Plan& plan,
                                    const std::vector<UnitRange>& units_of) {
  std::vector<double> params(size_t(plan.pp), 0);
  for (int s = 0; s < plan.num_stages(); ++s)
    params[size_t(plan.pp_rank_of_stage(s))] += stage_params(model, plan, units_of[size_t(s)]);
  return params;
}

// When a rank's last backward ends, and the summed durations of each chunk's last backward: the
// runtime starts the chunk's gradient all-reduce (in buckets) while it runs.
struct LastBackwards {
  double end = 0;
  double window = 0;
};

LastBackwards last_backwards(const std::vector<TimelineEntry>& timeline, int chunks) {
  LastBackwards last;
  std::vector<bool> seen(static_cast<size_t>(chunks), false);
  for (auto it = timeline.rbegin(); it != timeline.rend(); ++it) {
    if (!is_backward(it->op)) continue;
    last.end = std::max(last.end, it->end);
    if (it->chunk >= 0 && it->chunk < chunks && !seen[size_t(it->chunk)]) {
      seen[size_t(it->chunk)] = true;
      last.window += it->end - it->start;
    }
  }
  return last;
}

// The dp gradient sync of the step, per pipeline rank, and what it leaves exposed.
struct DpSync {
  const SimulateRequest& rq;
  const layout::Plan& plan;
  const std::vector<UnitRange>& units_of;
  GroupLink link;        // the dp group's
  double bucket = 0;     // elements per bucket; 0: one all-reduce per chunk
  double act_bytes = 0;  // per gradient element

  // ZeRO-0: buckets are cut from the end of each chunk's gradient buffer (the parameters in
  // forward order) and all-reduced one after another as the last backward completes them; the
  // bucket holding the chunk's first unit (and the remainder) is complete only when it ends.
  double bucketed_exposed(int rank, double window) const {
    const model::ModelConfig& model = rq.model;
    const int dp = plan.dp, tp = plan.tp, pp = plan.pp;
    double total = 0, hideable = 0;
    for (int s = rank; s < plan.num_stages(); s += pp) {
      const double n = stage_params(model, plan, units_of[size_t(s)]);
      const double first = double(unit_params(model, units_of[size_t(s)].first, tp));
      const double calls = bucket > 0 ? std::ceil(n / bucket) : 1;
      const double early = bucket > 0 ? std::floor(std::max(0.0, n - first) / bucket) : 1;
      const double early_n = bucket > 0 ? early * bucket : std::max(0.0, n - first);
      total +=
          calls * link.latency + CostModel::all_reduce_time(n * act_bytes, dp, link) - link.latency;
      if (early_n > 0)
        hideable += early * link.latency +
                    CostModel::all_reduce_time(early_n * act_bytes, dp, link) - link.latency;
    }
    return total - std::min(rq.dp_overlap * hideable, window);
  }
};

// The step past the pipeline's compute: the critical rank's end, its exposed dp sync, the fullest
// rank's optimizer step and ZeRO-1's all-gather.
struct StepEnd {
  double critical = 0;
  double exposed_at_critical = 0;
  double optimizer = 0;
  double gather = 0;
};

StepEnd step_end(const DpSync& dp_sync, const SimResult& sim, const std::vector<double>& params,
                 const CostModel& cost, double tied, double opt_scale) {
  const layout::Plan& plan = dp_sync.plan;
  const int dp = plan.dp, pp = plan.pp;
  const double act_bytes = dp_sync.act_bytes;
  StepEnd out;
  for (int r = 0; r < pp; ++r) {
    const LastBackwards last = last_backwards(sim.timeline[size_t(r)], plan.virtual_stages);
    const double rank_params = params[size_t(r)];
    double exposed = 0;
    if (dp > 1 && plan.zero_stage == 0) {
      exposed = dp_sync.bucketed_exposed(r, last.window);
    } else if (dp > 1) {
      exposed = CostModel::reduce_scatter_time(rank_params * act_bytes, dp, dp_sync.link);
      out.gather = std::max(out.gather,
                            CostModel::all_gather_time(rank_params * act_bytes, dp, dp_sync.link));
    }
    const double done = last.end + exposed + ((r == 0 || r == pp - 1) ? tied : 0);
    if (done > out.critical) {
      out.critical = done;
      out.exposed_at_critical = exposed;
    }
    out.optimizer =
        std::max(out.optimizer,
                 opt_scale * cost.optimizer_step(rank_params / (plan.zero_stage >= 1 ? dp : 1)));
  }
  out.critical = std::max(out.critical, sim.makespan);
  return out;
}

// The tied embedding's sum `tied`, then the gradient norm's all-reduces over tp and pp (and dp
// with ZeRO-1), the loss all-reduce over the world and the valid-token count's over dp.
double step_collectives(const SimulateRequest& rq, const layout::Plan& plan,
                        const ClusterSpec& cluster, const CostModel& cost, const GroupLink& dpl,
                        double tied) {
  const int tp = plan.tp, pp = plan.pp, dp = plan.dp, world = plan.world();
  const GroupLink world_link = collective_link(cluster, world);
  double coll = tied;
  coll += CostModel::all_reduce_time(8, tp, measured(rq, tp, cost.tp_link(tp)));   // norm, tp
  coll += CostModel::all_reduce_time(8, pp, measured(rq, pp, world_link));         // norm, pp
  if (plan.zero_stage >= 1) coll += CostModel::all_reduce_time(8, dp, dpl);        // norm, dp
  coll += CostModel::all_reduce_time(24, world, measured(rq, world, world_link));  // loss
  coll += CostModel::all_reduce_time(8, dp, dpl);                                  // tokens
  return coll;
}

// The optimizer step runs on every worker at once.
double optimizer_scale(const SimulateRequest::Cpu& cpu, int world) {
  return cpu.cores > 0 ? std::max(1.0, double(world) * cpu.threads_per_worker / cpu.cores) /
                             cpu.profile_oversubscription
                       : 1.0;
}

}  // namespace

SimulatedStep simulate_step(const SimulateRequest& rq) {
  layout::Plan plan = rq.plan;
  const ClusterSpec cluster = checked_cluster(rq, plan);
  const CostModel cost = unit_cost_model(rq, cluster, plan.tp);
  const std::vector<PassTimes> unit = unit_times(rq, plan, cost);
  plan.layers_per_stage = units_per_stage(rq.model, plan, unit);
  const std::vector<UnitRange> units_of = stage_units(plan);

  SimulatedStep out;
  out.schedule =
      rq.schedule.empty() ? std::string(layout::schedule_name(plan.schedule)) : rq.schedule;
  if (rq.stage_costs.empty()) {
    out.costs = stage_costs(rq, plan, unit, units_of);
  } else {
    TESSEL_CHECK(
        !rq.plan.layers_per_stage.empty() && rq.stage_costs.size() == size_t(plan.num_stages()),
        ConfigError,
        "simulate: {} given stage costs for a plan of {} virtual stages{}; give one per "
        "virtual stage and the plan's layers_per_stage",
        rq.stage_costs.size(), plan.num_stages(),
        rq.plan.layers_per_stage.empty() ? " without layers_per_stage" : "");
    out.costs = rq.stage_costs;
  }
  const SimConfig sc = sim_config(rq, plan, cost);
  const PipelineSchedule ps = pipeline_schedule(out.schedule, rq, plan);
  out.analytic_bubble = ps.analytic_bubble;
  const CpuShare cpu =
      cpu_share(rq.cpu, plan, [&](double scale) { return run_pipeline(ps, sc, out.costs, scale); });
  out.cpu_slowdown = cpu.slowdown;
  out.sim = run_pipeline(ps, sc, out.costs, cpu.scale);
  out.pipeline_s = out.sim.makespan;

  out.rank_params = params_per_rank(rq.model, plan, units_of);
  const double tied = cost.tied_embedding_sync(plan.tp, plan.pp, plan.world());
  const double act_bytes = element_bytes(rq.precision);
  const DpSync dp_sync{
      rq,
      plan,
      units_of,
      measured(rq, plan.dp, cost.dp_link(plan.dp, plan.tp)),
      rq.bucket_bytes > 0 ? std::max(1.0, std::floor(rq.bucket_bytes / act_bytes)) : 0,
      act_bytes};
  const StepEnd end = step_end(dp_sync, out.sim, out.rank_params, cost, tied,
                               optimizer_scale(rq.cpu, plan.world()));
  const double coll = step_collectives(rq, plan, cluster, cost, dp_sync.link, tied);
  out.dp_exposed_s = end.exposed_at_critical + end.gather;
  out.collectives_s = coll;
  out.optimizer_s = end.optimizer;
  out.step_s = end.critical + (coll - tied) + end.optimizer + end.gather;
  out.plan = plan;
  return out;
}

}  // namespace tessel::planner
