#include "tessel/cli/simulate_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "tessel/config/train_config.h"
#include "tessel/core/check.h"
#include "tessel/planner/memory_model.h"
#include "tessel/planner/search.h"
#include "tessel/planner/trace.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/zero_bubble.h"

namespace tessel::cli {

namespace {

using planner::CostModel;
using planner::GroupLink;
using planner::PassTimes;

bool is_backward(schedule::Op op) {
  return op == schedule::Op::backward || op == schedule::Op::backward_input ||
         op == schedule::Op::backward_weight;
}

// The link of a collective over `ranks` of a world of `world` devices (one host or not).
GroupLink collective_link(const planner::ClusterSpec& c, int world) {
  if (world <= c.devices_per_host)
    return GroupLink{c.intra_host.coll_bandwidth(), c.intra_host.coll_latency(), false};
  return GroupLink{c.inter_host.coll_bandwidth(), c.inter_host.coll_latency(), true};
}

// Activations in flight per stage of interleaved 1F1B (schedule/generators.h), the greedy
// dispatcher's default caps with chunks > 1.
int interleaved_in_flight(int p, int s, int v, int64_t m) {
  return int(std::min<int64_t>(v * m, 2 * (p - s - 1) + (v - 1) * p + 1));
}

}  // namespace

SimulatedStep simulate_step(const SimulateRequest& rq) {
  const model::ModelConfig& model = rq.model;
  model.validate();
  layout::Plan plan = rq.plan;
  const int world = plan.world();
  TESSEL_CHECK(world >= 1, ConfigError, "simulate: the plan has {} workers", world);
  const planner::ClusterSpec cluster =
      rq.cluster.num_devices() == world ? rq.cluster : rq.cluster.with_devices(world);
  cluster.validate();
  plan.validate(model, plan.global_batch(), world);
  TESSEL_CHECK(rq.seq >= 1 && rq.seq <= model.max_seq_len, ConfigError,
               "simulate: sequence length {} is outside model '{}' (1 to max_seq_len {})", rq.seq,
               model.name, model.max_seq_len);
  planner::CostOptions options;
  options.precision = rq.precision;
  options.dp_overlap = rq.dp_overlap;
  TESSEL_CHECK(rq.dp_overlap >= 0 && rq.dp_overlap <= 1, ConfigError,
               "simulate: dp overlap {} must be in [0, 1]", rq.dp_overlap);
  // Measured collectives of a group size, where the request has them, else the cluster's link.
  auto measured = [&](int ranks, GroupLink fallback) {
    const auto it = rq.collectives.find(ranks);
    if (it == rq.collectives.end()) return fallback;
    return GroupLink{it->second.bandwidth, it->second.latency, fallback.cross_host};
  };
  // The tp all-reduces inside the unit times use the tp group's own measurement.
  planner::ClusterSpec unit_cluster = cluster;
  if (const auto it = rq.collectives.find(plan.tp);
      it != rq.collectives.end() && plan.tp <= cluster.devices_per_host) {
    unit_cluster.intra_host.collective_bandwidth = it->second.bandwidth;
    unit_cluster.intra_host.collective_latency = it->second.latency;
  }
  const CostModel cost(model, unit_cluster, options, rq.profile);

  const int tp = plan.tp, pp = plan.pp, dp = plan.dp, v = plan.virtual_stages;
  const int S = plan.num_stages(), U = model.n_layer + 2, seq = rq.seq;
  const int64_t b = plan.micro_batch, m = plan.micro_batches;
  std::vector<PassTimes> unit(static_cast<size_t>(U));
  std::vector<double> unit_cost(static_cast<size_t>(U));
  // Tensor-parallel units measured with their all-reduces (a profile's tp_layer_times) replace
  // the estimate of scaled tp = 1 times plus modelled all-reduces.
  const planner::ComputeProfile* tp_measured = nullptr;
  if (const auto it = rq.tp_profiles.find(tp);
      tp > 1 && it != rq.tp_profiles.end() && it->second.seq == seq)
    tp_measured = &it->second;
  const auto tp_point = tp_measured ? tp_measured->at(b) : planner::ProfilePoint{};
  for (int u = 0; u < U; ++u) {
    unit[size_t(u)] = !tp_measured             ? cost.unit(u, b, seq, tp)
                      : u == 0                 ? tp_point.embedding
                      : u == model.n_layer + 1 ? tp_point.head
                                               : tp_point.block;
    const bool block = u >= 1 && u <= model.n_layer;
    unit_cost[size_t(u)] = unit[size_t(u)].step(plan.recompute && block);
  }
  if (plan.layers_per_stage.empty())
    plan.layers_per_stage = planner::balance_stages(unit_cost, S).units_per_stage;

  SimulatedStep out;
  const std::string kind =
      rq.schedule.empty() ? std::string(layout::schedule_name(plan.schedule)) : rq.schedule;
  out.schedule = kind;
  const int act_bytes = planner::element_bytes(rq.precision);
  const double boundary_bytes = double(b) * seq * model.n_embd * act_bytes;

  // Per virtual stage: its units' times and stored activations.
  std::vector<std::pair<int, int>> units_of(static_cast<size_t>(S));  // [begin, end)
  {
    int begin = 0;
    for (int s = 0; s < S; ++s) {
      units_of[size_t(s)] = {begin, begin + plan.layers_per_stage[size_t(s)]};
      begin += plan.layers_per_stage[size_t(s)];
    }
  }
  for (int s = 0; s < S; ++s) {
    planner::StageCosts c;
    c.forward = c.backward = c.backward_input = c.backward_weight = c.activation_bytes = 0;
    for (int u = units_of[size_t(s)].first; u < units_of[size_t(s)].second; ++u) {
      const PassTimes& t = unit[size_t(u)];
      const bool block = u >= 1 && u <= model.n_layer;
      const double rc = plan.recompute && block ? t.recompute : 0;
      c.forward += t.forward;
      c.backward += t.backward() + rc;
      c.backward_input += t.backward_input + rc;
      c.backward_weight += t.backward_weight;
      c.activation_bytes += planner::unit_activation_bytes(model, u, b, seq, tp, rq.precision,
                                                           plan.recompute && block);
    }
    c.output_bytes = boundary_bytes;
    out.costs.push_back(c);
  }

  planner::SimConfig sc;
  const GroupLink pl = cost.pp_link(world);
  sc.link = planner::Link{pl.latency, pl.bandwidth};
  if (!rq.slowdown.empty()) {
    TESSEL_CHECK(int(rq.slowdown.size()) == pp, ConfigError,
                 "simulate: {} slowdown factors for {} pipeline ranks", rq.slowdown.size(), pp);
    sc.slowdown = rq.slowdown;
  }
  sc.jitter = rq.jitter;
  sc.seed = rq.seed;

  schedule::Schedule sched;
  planner::GreedyOptions greedy;
  if (kind == "greedy") {
    greedy.stages = pp;
    greedy.micro_batches = int(m);
    greedy.chunks = v;
    if (rq.memory_cap > 0) {
      greedy.memory_cap = rq.memory_cap;
    } else {
      for (int s = 0; s < pp; ++s)
        greedy.stage_memory_caps.push_back(v == 1 ? pp - s : interleaved_in_flight(pp, s, v, m));
    }
    out.analytic_bubble = schedule::bubble_fraction(pp, int(m), v);
  } else if (kind == "interleaved-1f1b") {
    sched = schedule::interleaved_one_f_one_b(pp, int(m), v);
    out.analytic_bubble = schedule::bubble_fraction(pp, int(m), v);
  } else {
    TESSEL_CHECK(v == 1, ConfigError,
                 "simulate: schedule {} runs one model chunk per rank, but the plan has "
                 "virtual_stages {}; use --schedule interleaved-1f1b or greedy",
                 kind, v);
    if (kind == "gpipe") {
      sched = schedule::gpipe(pp, int(m));
      out.analytic_bubble = schedule::bubble_fraction(pp, int(m));
    } else if (kind == "1f1b") {
      sched = schedule::one_f_one_b(pp, int(m));
      out.analytic_bubble = schedule::bubble_fraction(pp, int(m));
    } else if (kind == "zb-h1") {
      sched = schedule::zb_h1(pp, int(m));
      out.analytic_bubble = schedule::zb_h1_bubble_fraction(pp, int(m));
    } else {
      TESSEL_THROW(ConfigError,
                   "simulate: unknown schedule '{}' (known: gpipe, 1f1b, interleaved-1f1b, "
                   "zb-h1, greedy)",
                   kind);
    }
  }
  // The pipeline with every stage's compute `scale` times as long.
  auto run_pipeline = [&](double scale) {
    sc.costs = out.costs;
    for (auto& c : sc.costs) {
      c.forward *= scale;
      c.backward *= scale;
      c.backward_input *= scale;
      c.backward_weight *= scale;
    }
    return kind == "greedy" ? planner::simulate_greedy(greedy, sc) : planner::simulate(sched, sc);
  };

  // CPU sharing: workers time-slice the cores while more worker threads compute than there are
  // cores. The profile's times hold for all workers computing at once; a pipeline keeps only
  // some ranks busy, so the slowdown is found as a fixed point of the simulated number of busy
  // ranks (pipeline ranks busy x dp x tp processes each).
  const auto& cpu = rq.cpu;
  double scale = 1;
  if (cpu.cores > 0) {
    const double per_busy = double(dp) * tp * cpu.threads_per_worker / cpu.cores;
    auto slowdown = [&](double busy_ranks) { return std::max(1.0, busy_ranks * per_busy); };
    double f = slowdown(pp);
    for (int it = 0; it < 20; ++it) {
      out.sim = run_pipeline(f / cpu.profile_oversubscription);
      double busy = 0;
      for (double b : out.sim.busy) busy += b;
      const double next = slowdown(out.sim.makespan > 0 ? busy / out.sim.makespan : 0);
      if (std::abs(next - f) < 1e-4 * f) break;
      f = 0.5 * (f + next);
    }
    scale = f / cpu.profile_oversubscription;
    out.cpu_slowdown = f;
  }
  out.sim = run_pipeline(scale);
  out.pipeline_s = out.sim.makespan;

  // Parameters per pipeline rank (one tp shard), and when its gradients are complete.
  out.rank_params.assign(size_t(pp), 0);
  for (int s = 0; s < S; ++s) {
    double p = 0;
    for (int u = units_of[size_t(s)].first; u < units_of[size_t(s)].second; ++u)
      p += double(planner::unit_params(model, u, tp));
    // With a pipeline the head's stage holds its own copy of a tied embedding.
    if (model.tie_embeddings && pp > 1 && units_of[size_t(s)].second == U)
      p += double(model.padded_vocab()) * model.n_embd / tp;
    out.rank_params[size_t(plan.pp_rank_of_stage(s))] += p;
  }
  const double tied = cost.tied_embedding_sync(tp, pp, world);
  // The optimizer step runs on every worker at once.
  const double opt_scale = cpu.cores > 0
                               ? std::max(1.0, double(world) * cpu.threads_per_worker / cpu.cores) /
                                     cpu.profile_oversubscription
                               : 1.0;
  const GroupLink dpl = measured(dp, cost.dp_link(dp, tp));
  const double bucket =
      rq.bucket_bytes > 0 ? std::max(1.0, std::floor(rq.bucket_bytes / act_bytes)) : 0;
  double critical = 0, exposed_at_critical = 0, opt = 0, gather = 0;
  for (int r = 0; r < pp; ++r) {
    const auto& tl = out.sim.timeline[size_t(r)];
    double end = 0, window = 0;
    std::vector<bool> seen(static_cast<size_t>(v), false);
    // The last backward of each chunk: the runtime starts the chunk's gradient all-reduce
    // (in buckets) while it runs.
    for (auto it = tl.rbegin(); it != tl.rend(); ++it) {
      if (!is_backward(it->op)) continue;
      end = std::max(end, it->end);
      if (it->chunk >= 0 && it->chunk < v && !seen[size_t(it->chunk)]) {
        seen[size_t(it->chunk)] = true;
        window += it->end - it->start;
      }
    }
    const double params = out.rank_params[size_t(r)];
    double exposed = 0;
    if (dp > 1 && plan.zero_stage == 0) {
      // Buckets are cut from the end of each chunk's gradient buffer (the parameters in forward
      // order) and all-reduced one after another as the last backward completes them; the bucket
      // holding the chunk's first unit (and the remainder) is complete only when it ends.
      double total = 0, hideable = 0;
      for (int s = r; s < S; s += pp) {
        double n = 0;
        const auto [begin, stop] = units_of[size_t(s)];
        for (int u = begin; u < stop; ++u) n += double(planner::unit_params(model, u, tp));
        if (model.tie_embeddings && pp > 1 && stop == U)
          n += double(model.padded_vocab()) * model.n_embd / tp;
        const double first = double(planner::unit_params(model, begin, tp));
        const double calls = bucket > 0 ? std::ceil(n / bucket) : 1;
        const double early = bucket > 0 ? std::floor(std::max(0.0, n - first) / bucket) : 1;
        const double early_n = bucket > 0 ? early * bucket : std::max(0.0, n - first);
        total +=
            calls * dpl.latency + CostModel::all_reduce_time(n * act_bytes, dp, dpl) - dpl.latency;
        if (early_n > 0)
          hideable += early * dpl.latency +
                      CostModel::all_reduce_time(early_n * act_bytes, dp, dpl) - dpl.latency;
      }
      exposed = total - std::min(rq.dp_overlap * hideable, window);
    } else if (dp > 1) {
      exposed = CostModel::reduce_scatter_time(params * act_bytes, dp, dpl);
      gather = std::max(gather, CostModel::all_gather_time(params * act_bytes, dp, dpl));
    }
    const double done = end + exposed + ((r == 0 || r == pp - 1) ? tied : 0);
    if (done > critical) {
      critical = done;
      exposed_at_critical = exposed;
    }
    opt = std::max(opt, opt_scale * cost.optimizer_step(params / (plan.zero_stage >= 1 ? dp : 1)));
  }
  critical = std::max(critical, out.sim.makespan);
  const GroupLink world_link = collective_link(cluster, world);
  double coll = tied;
  coll += CostModel::all_reduce_time(8, tp, measured(tp, cost.tp_link(tp)));   // norm over tp
  coll += CostModel::all_reduce_time(8, pp, measured(pp, world_link));         // norm over pp
  if (plan.zero_stage >= 1) coll += CostModel::all_reduce_time(8, dp, dpl);    // norm over dp
  coll += CostModel::all_reduce_time(24, world, measured(world, world_link));  // loss
  coll += CostModel::all_reduce_time(8, dp, dpl);                              // token count
  out.dp_exposed_s = exposed_at_critical + gather;
  out.collectives_s = coll;
  out.optimizer_s = opt;
  out.step_s = critical + (coll - tied) + opt + gather;
  out.plan = plan;
  return out;
}

namespace {

struct SimArgs {
  std::string plan;
  std::string config;
  std::string model;
  std::string cluster;
  std::string profile;
  std::string precision;
  int seq = 0;
  std::string schedule;
  int memory_cap = 0;
  double jitter = 0;
  uint64_t seed = 0;
  std::vector<std::string> slow;
  double dp_overlap = -1;
  double bucket_mb = -1;
  std::string trace;
  bool json = false;
};

nlohmann::json read_json(const std::string& path, const char* what) {
  std::ifstream in(path);
  TESSEL_CHECK(in.good(), IoError, "cannot read {} '{}': no such file or not readable", what, path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    TESSEL_THROW(CorruptDataError, "{} '{}' is not valid JSON: {}", what, path, e.what());
  }
}

double positive(const nlohmann::json& doc, const char* key, const char* where) {
  TESSEL_CHECK(doc.contains(key) && doc.at(key).is_number() && doc.at(key).get<double>() > 0,
               CorruptDataError, "profile: {}.{} must be a positive number", where, key);
  return doc.at(key).get<double>();
}

// What a `tessel profile` knows beyond the cluster: the CPU sharing of its workers and the
// all-reduce measured per group size (both optional).
void read_machine(const nlohmann::json& doc, SimulateRequest& rq) {
  if (doc.contains("cores") && doc.contains("threads_per_worker")) {
    rq.cpu.cores = int(positive(doc, "cores", "the profile"));
    rq.cpu.threads_per_worker = int(positive(doc, "threads_per_worker", "the profile"));
    rq.cpu.profile_oversubscription =
        doc.contains("cpu_oversubscription")
            ? std::max(1.0, positive(doc, "cpu_oversubscription", "the profile"))
            : 1.0;
  }
  if (doc.contains("tp_layer_times")) {
    for (const auto& lt : doc["tp_layer_times"]) {
      const planner::ComputeProfile p =
          planner::compute_profile_from_json(nlohmann::json{{"layer_times", lt}}, rq.model);
      rq.tp_profiles[p.tp] = p;
    }
  }
  if (doc.contains("all_reduce") && doc["all_reduce"].contains("by_group")) {
    for (const auto& g : doc["all_reduce"]["by_group"]) {
      const int ranks = int(positive(g, "ranks", "all_reduce.by_group[]"));
      rq.collectives[ranks] = planner::LinkSpec{
          positive(g, "bus_bandwidth_bytes_per_s", "all_reduce.by_group[]"),
          g.contains("latency_s") && g["latency_s"].is_number() ? g["latency_s"].get<double>()
                                                                : 0.0};
    }
  }
}

std::vector<double> parse_slowdowns(const std::vector<std::string>& specs, int pp) {
  if (specs.empty()) return {};
  std::vector<double> f(static_cast<size_t>(pp), 1.0);
  for (const auto& s : specs) {
    const auto colon = s.find(':');
    int stage = -1;
    double factor = 0;
    try {
      TESSEL_CHECK(colon != std::string::npos, ConfigError, "");
      size_t used = 0;
      stage = std::stoi(s.substr(0, colon), &used);
      TESSEL_CHECK(used == colon, ConfigError, "");
      factor = std::stod(s.substr(colon + 1), &used);
      TESSEL_CHECK(used == s.size() - colon - 1, ConfigError, "");
    } catch (const std::exception&) {
      TESSEL_THROW(ConfigError,
                   "--slow-stage '{}' is not STAGE:FACTOR (e.g. 1:1.5 makes pipeline rank 1 "
                   "1.5x slower)",
                   s);
    }
    TESSEL_CHECK(stage >= 0 && stage < pp && factor > 0 && std::isfinite(factor), ConfigError,
                 "--slow-stage '{}': the stage must be in [0, {}) and the factor positive", s, pp);
    f[size_t(stage)] = factor;
  }
  return f;
}

std::string ms(double s) {
  return fmt::format("{:.3f}", s * 1e3);
}

std::string table(const SimulateRequest& rq, const SimulatedStep& r) {
  const auto& p = r.plan;
  std::string s =
      fmt::format("tessel simulate: {} on {} ({} device{}), {}, schedule {}, seq {}, {}\n",
                  rq.model.name, rq.cluster.name, p.world(), p.world() == 1 ? "" : "s",
                  p.describe(), r.schedule, rq.seq, planner::precision_name(rq.precision));
  s += fmt::format("\n{:>5} {:>16} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "stage", "units", "F ms",
                   "B ms", "busy ms", "in flight", "peak act MiB");
  const int pp = p.pp;
  for (int rank = 0; rank < pp; ++rank) {
    std::string units;
    double f = 0, bw = 0;
    int begin = 0;
    for (int st = 0; st < p.num_stages(); ++st) {
      const int n = p.layers_per_stage[size_t(st)];
      if (p.pp_rank_of_stage(st) == rank) {
        units += fmt::format("{}{}-{}", units.empty() ? "" : ",", begin, begin + n - 1);
        f += r.costs[size_t(st)].forward;
        bw += r.costs[size_t(st)].backward;
      }
      begin += n;
    }
    s += fmt::format("{:>5} {:>16} {:>10} {:>10} {:>10} {:>10} {:>12.2f}\n", rank, units, ms(f),
                     ms(bw), ms(r.sim.busy[size_t(rank)]), r.sim.peak_in_flight[size_t(rank)],
                     r.sim.peak_activation_bytes[size_t(rank)] / (1 << 20));
  }
  s += fmt::format(
      "\npipeline  {} ms makespan, bubble {:.1f}% (analytic {:.1f}% with equal stages "
      "and free links)\n",
      ms(r.pipeline_s), 100 * r.sim.bubble_fraction(), 100 * r.analytic_bubble);
  s += fmt::format(
      "step      {} ms = pipeline {} + dp sync exposed {} + collectives {} + optimizer {} ms\n",
      ms(r.step_s), ms(r.pipeline_s), ms(r.dp_exposed_s), ms(r.collectives_s), ms(r.optimizer_s));
  if (r.cpu_slowdown > 1)
    s += fmt::format("          workers share {} cores: compute {:.2f}x its full-speed time\n",
                     rq.cpu.cores, r.cpu_slowdown);
  s += fmt::format("          {:.0f} tokens/s\n",
                   double(p.global_batch()) * rq.seq / std::max(r.step_s, 1e-30));
  return s;
}

nlohmann::json to_json(const SimulateRequest& rq, const SimulatedStep& r) {
  nlohmann::json stages = nlohmann::json::array();
  for (int rank = 0; rank < r.plan.pp; ++rank) {
    stages.push_back({{"stage", rank},
                      {"busy_s", r.sim.busy[size_t(rank)]},
                      {"peak_in_flight", r.sim.peak_in_flight[size_t(rank)]},
                      {"peak_activation_bytes", r.sim.peak_activation_bytes[size_t(rank)]},
                      {"params", r.rank_params[size_t(rank)]}});
  }
  nlohmann::json costs = nlohmann::json::array();
  for (const auto& c : r.costs) {
    costs.push_back({{"forward_s", c.forward},
                     {"backward_s", c.backward},
                     {"backward_input_s", c.backward_input},
                     {"backward_weight_s", c.backward_weight},
                     {"activation_bytes", c.activation_bytes}});
  }
  return {{"model", rq.model.name},
          {"cluster", rq.cluster.name},
          {"devices", r.plan.world()},
          {"seq", rq.seq},
          {"precision", planner::precision_name(rq.precision)},
          {"plan", layout::to_json(r.plan)},
          {"describe", r.plan.describe()},
          {"schedule", r.schedule},
          {"step_s", r.step_s},
          {"pipeline_s", r.pipeline_s},
          {"dp_exposed_s", r.dp_exposed_s},
          {"collectives_s", r.collectives_s},
          {"optimizer_s", r.optimizer_s},
          {"cpu_slowdown", r.cpu_slowdown},
          {"bubble", r.sim.bubble_fraction()},
          {"analytic_bubble", r.analytic_bubble},
          {"tokens_per_s", double(r.plan.global_batch()) * rq.seq / std::max(r.step_s, 1e-30)},
          {"stages", stages},
          {"virtual_stage_costs", costs}};
}

int run_simulate(const SimArgs& a) {
  TESSEL_CHECK(a.plan.empty() != a.config.empty(), ConfigError,
               "tessel simulate: give either --plan PLAN.json (with --model) or --config "
               "TRAIN.yaml");
  SimulateRequest rq;
  bool from_config = false;
  if (!a.config.empty()) {
    const auto cfg = config::TrainConfig::load(a.config);
    TESSEL_CHECK(a.model.empty(), ConfigError,
                 "--model conflicts with --config (the config names its model)");
    rq.model = cfg.model;
    rq.plan = cfg.plan;
    rq.seq = cfg.data.seq_len;
    rq.bucket_bytes = cfg.bucket_mb * (1 << 20);
    from_config = true;
  } else {
    nlohmann::json doc = read_json(a.plan, "plan");
    std::string model = a.model;
    if (doc.is_object() && doc.contains("plan")) {  // a `tessel plan --json` document
      if (model.empty() && doc.contains("model") && doc["model"].is_string())
        model = doc["model"].get<std::string>();
      if (doc.contains("seq") && doc["seq"].is_number_integer()) rq.seq = doc["seq"].get<int>();
      doc = doc.at("plan");
    }
    TESSEL_CHECK(!model.empty(), ConfigError, "--plan needs --model (the plan's model preset)");
    rq.model = model::ModelConfig::preset(model);
    rq.plan = layout::plan_from_json(doc);
    if (rq.seq == 0) rq.seq = rq.model.max_seq_len;
  }
  if (a.seq > 0) rq.seq = a.seq;

  const std::string cluster = !a.cluster.empty()  ? a.cluster
                              : a.profile.empty() ? "dgx-a100"
                                                  : "this-machine";
  if (!a.profile.empty()) {
    TESSEL_CHECK(cluster == "this-machine", ConfigError,
                 "--profile describes this machine; use it with --cluster this-machine, not '{}'",
                 cluster);
    const nlohmann::json doc = read_json(a.profile, "profile");
    rq.cluster = planner::from_profile_json(doc);
    if (doc.contains("layer_times")) rq.profile = planner::compute_profile_from_json(doc, rq.model);
    read_machine(doc, rq);
  } else {
    TESSEL_CHECK(cluster != "this-machine", ConfigError,
                 "--cluster this-machine needs --profile FILE (written by `tessel profile`)");
    rq.cluster = planner::ClusterSpec::resolve(cluster);
  }
  if (!a.precision.empty()) {
    rq.precision = planner::parse_precision(a.precision);
  } else if (from_config || rq.cluster.device.peak(planner::Precision::bf16) <= 0) {
    rq.precision = planner::Precision::fp32;  // the runtime trains in fp32
  } else {
    rq.precision = planner::Precision::bf16;
  }
  rq.schedule = a.schedule;
  TESSEL_CHECK(a.memory_cap >= 0, ConfigError, "--memory-cap must be >= 1");
  rq.memory_cap = a.memory_cap;
  rq.jitter = a.jitter;
  rq.seed = a.seed;
  rq.slowdown = parse_slowdowns(a.slow, rq.plan.pp);
  if (a.dp_overlap >= 0) rq.dp_overlap = a.dp_overlap;
  if (a.bucket_mb >= 0) rq.bucket_bytes = a.bucket_mb * (1 << 20);

  const SimulatedStep r = simulate_step(rq);
  if (!a.trace.empty()) {
    planner::Trace trace = planner::simulation_trace(r.sim);
    trace.other_data["plan"] = r.plan.describe();
    trace.other_data["step_s"] = r.step_s;
    planner::write_trace(trace, a.trace);
  }
  if (a.json) {
    std::cout << to_json(rq, r).dump(2) << "\n";
  } else {
    std::cout << table(rq, r);
    if (!a.trace.empty())
      std::cout << fmt::format("wrote the simulated pipeline to {} (open in ui.perfetto.dev)\n",
                               a.trace);
  }
  std::cout.flush();
  return 0;
}

}  // namespace

void add_simulate_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<SimArgs>();
  auto* cmd = app.add_subcommand(
      "simulate", "simulate one training step of a plan on the cost model (discrete events)");
  cmd->add_option("--plan", args->plan,
                  "plan JSON (`tessel plan --out`), or a whole `tessel plan --json` document");
  cmd->add_option("--config", args->config, "train config YAML: model, seq_len and parallel plan");
  cmd->add_option("--model", args->model, "model preset of --plan");
  cmd->add_option("--cluster", args->cluster,
                  "dgx-a100 (the default), dgx-h100, a cluster YAML file, or this-machine (the "
                  "default with --profile)");
  cmd->add_option("--profile", args->profile, "profile JSON from `tessel profile`");
  cmd->add_option("--precision", args->precision,
                  "fp32, bf16 or fp16 (default: fp32 with --config or without bf16, else bf16)");
  cmd->add_option("--seq", args->seq, "tokens per sample (default: the plan's or config's)");
  cmd->add_option("--schedule", args->schedule,
                  "gpipe, 1f1b, interleaved-1f1b, zb-h1 or greedy (default: the plan's)");
  cmd->add_option("--memory-cap", args->memory_cap,
                  "greedy: activations in flight per stage (default: p - s on stage s)");
  cmd->add_option("--jitter", args->jitter, "each compute takes 1 + jitter * U(-1, 1) as long");
  cmd->add_option("--seed", args->seed, "jitter seed");
  cmd->add_option("--slow-stage", args->slow,
                  "STAGE:FACTOR, e.g. 1:1.5 (repeatable): a pipeline rank's compute slowdown");
  cmd->add_option("--dp-overlap", args->dp_overlap,
                  "share of the dp all-reduce that can hide behind the last backward (default "
                  "0.8)");
  cmd->add_option("--bucket-mb", args->bucket_mb,
                  "dp gradient all-reduce bucket size in MiB (default: the config's "
                  "parallel.bucket_mb, else 25; 0: one all-reduce)");
  cmd->add_option("--trace", args->trace, "write the simulated pipeline as Chrome-trace JSON");
  cmd->add_flag("--json", args->json, "print JSON instead of a table");
  cmd->callback([args, &action] { action = [args] { return run_simulate(*args); }; });
}

}  // namespace tessel::cli
