#include "tessel/cli/simulate_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "tessel/config/train_config.h"
#include "tessel/core/check.h"
#include "tessel/layout/plan.h"
#include "tessel/model/model_config.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/cost_model.h"
#include "tessel/planner/step_simulation.h"
#include "tessel/planner/trace.h"
#include "tessel/schedule/named.h"

namespace tessel::cli {

namespace {

using planner::SimulatedStep;
using planner::SimulateRequest;

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
  std::vector<std::string> stage_jitter;
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

// STAGE:VALUE options (repeatable) into one value per pipeline rank, `unset` for the others;
// empty when none is given.
std::vector<double> parse_stage_values(const std::vector<std::string>& specs, int pp, double unset,
                                       const char* option, const char* example) {
  if (specs.empty()) return {};
  std::vector<double> f(static_cast<size_t>(pp), unset);
  for (const auto& s : specs) {
    const auto colon = s.find(':');
    int stage = -1;
    double value = 0;
    try {
      TESSEL_CHECK(colon != std::string::npos, ConfigError, "");
      size_t used = 0;
      stage = std::stoi(s.substr(0, colon), &used);
      TESSEL_CHECK(used == colon, ConfigError, "");
      value = std::stod(s.substr(colon + 1), &used);
      TESSEL_CHECK(used == s.size() - colon - 1, ConfigError, "");
    } catch (const std::exception&) {
      TESSEL_THROW(ConfigError, "{} '{}' is not STAGE:VALUE (e.g. {})", option, s, example);
    }
    TESSEL_CHECK(stage >= 0 && stage < pp && std::isfinite(value), ConfigError,
                 "{} '{}': the stage must be in [0, {}) and the value finite", option, s, pp);
    f[size_t(stage)] = value;
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
  rq.slowdown = parse_stage_values(a.slow, rq.plan.pp, 1.0, "--slow-stage",
                                   "1:1.5 makes pipeline rank 1 1.5x slower");
  rq.stage_jitter = parse_stage_values(a.stage_jitter, rq.plan.pp, a.jitter, "--stage-jitter",
                                       "1:0.5 gives pipeline rank 1's computes 1 +- 50% of their "
                                       "time");
  if (a.dp_overlap >= 0) rq.dp_overlap = a.dp_overlap;
  if (a.bucket_mb >= 0) rq.bucket_bytes = a.bucket_mb * (1 << 20);

  const SimulatedStep r = planner::simulate_step(rq);
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
                  fmt::format("{} or greedy (default: the plan's)",
                              fmt::join(schedule::schedule_names(), ", ")));
  cmd->add_option("--memory-cap", args->memory_cap,
                  "greedy: activations in flight per stage (default: p - s on stage s)");
  cmd->add_option("--jitter", args->jitter, "each compute takes 1 + jitter * U(-1, 1) as long");
  cmd->add_option("--stage-jitter", args->stage_jitter,
                  "STAGE:JITTER (repeatable): --jitter for one pipeline rank (the others keep "
                  "--jitter)");
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
