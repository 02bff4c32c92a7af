#include "tessel/cli/plan_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tessel/cli/count_flag.h"
#include "tessel/config/train_config.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/stop_signal.h"
#include "tessel/model/recompute.h"
#include "tessel/planner/cluster.h"
#include "tessel/planner/graph_plan.h"
#include "tessel/planner/mesh_sharding.h"
#include "tessel/planner/onnx_graph.h"
#include "tessel/planner/plan_service.h"
#include "tessel/planner/search.h"
#include "tessel/planner/trace.h"
#include "tessel/planner/transformer_graph.h"

namespace tessel::cli {

namespace {

struct PlanArgs {
  std::string model;
  std::string config;   // a train config: its model section, seq_len and global batch
  std::string cluster;  // empty: dgx-a100, or this-machine with --profile
  std::string profile;
  std::string precision;
  int gpus = 0;
  int64_t global_batch = 0;
  int seq = 0;
  int top = 10;
  bool json = false;
  std::string out;
  // The graph planner: an ONNX model, values for its symbolic dimensions, the layout.
  std::string onnx;
  std::vector<std::string> dims;  // NAME=VALUE
  int tp = 0;                     // 0: the cluster's devices per host
  int stages = 1;
  double balance = 0.1;
  // The graph planner on the graph of --model (transformer_graph.h) instead of a file.
  bool graph = false;
  int dp = 1;
  int micro_batches = 1;
  int micro_batch = 1;
  std::string schedule = "1f1b";
  std::string trace;  // the simulated step, Perfetto
  std::string mesh;   // "HOSTSxDEVICES": shard on a 2-axis mesh instead (mesh_sharding.h)
  // tessel plan serve
  std::string host = "127.0.0.1";
  int port = 8600;
  std::string token_file;
  double max_model_mb = 256;
  double ilp_time_limit = 10;
};

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  TESSEL_CHECK(in.good(), IoError, "cannot read profile '{}': no such file or not readable", path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    TESSEL_THROW(CorruptDataError, "profile '{}' is not valid JSON: {}", path, e.what());
  }
}

std::string gib(double bytes) {
  return fmt::format("{:.1f}", bytes / (1024.0 * 1024.0 * 1024.0));
}

std::string table(const planner::SearchRequest& req, const planner::SearchResult& res) {
  const auto& c = req.cluster;
  std::string s = fmt::format(
      "tessel plan: {} ({:.3g} params) on {} x {} ({}: {} host{} x {}), global batch {} x seq {}, "
      "{}\n",
      req.model.name, double(req.model.num_params()), c.num_devices(), c.device.name, c.name,
      c.hosts, c.hosts == 1 ? "" : "s", c.devices_per_host, req.global_batch, req.seq,
      planner::precision_name(req.precision));
  s += fmt::format("searched {} layouts ({} over memory) in {:.3f} s\n\n", res.evaluated,
                   res.rejected_memory, res.seconds);
  s += fmt::format(
      "{:>3} {:>5} {:>3} {:>4} {:>2} {:>12} {:<16} {:>4} {:>9} {:>9} {:>11} {:>6} "
      "{:>9}\n",
      "#", "dp", "tp", "pp", "v", "mb x m", "schedule", "zero", "recompute", "step s", "tokens/s",
      "MFU", "GiB/dev");
  int i = 0;
  for (const auto& cand : res.ranked) {
    const auto& p = cand.plan;
    s += fmt::format(
        "{:>3} {:>5} {:>3} {:>4} {:>2} {:>12} {:<16} {:>4} {:>9} {:>9.3f} {:>11.0f} {:>5.1f}% "
        "{:>9}\n",
        ++i, p.dp, p.tp, p.pp, p.virtual_stages,
        fmt::format("{} x {}", p.micro_batch, p.micro_batches), layout::schedule_name(p.schedule),
        p.zero_stage, p.jit_recompute ? "jit" : model::recompute_name(p.recompute), cand.step_s,
        cand.tokens_per_s, 100 * cand.mfu, gib(cand.memory_bytes));
  }
  const auto& b = res.ranked.front();
  s += fmt::format("\nbest: {}\n", b.plan.describe());
  s += fmt::format(
      "  step {:.3f} s = pipeline {:.3f} s ({} x slowest stage {:.4f} s with bubble {:.1f}%) + dp "
      "sync {:.3f} s + optimizer {:.3f} s; {:.1f} of {} GiB per device\n",
      b.step_s, b.pipeline_s, b.plan.virtual_stages * b.plan.micro_batches, b.max_stage_s,
      100 * b.bubble, b.dp_exposed_s, b.optimizer_s, b.memory_bytes / (1024.0 * 1024 * 1024),
      gib(b.capacity_bytes));
  return s;
}

planner::OnnxOptions onnx_options(const std::vector<std::string>& dims) {
  planner::OnnxOptions o;
  for (const auto& d : dims) {
    const auto dim = planner::parse_dim(d, '=');
    TESSEL_CHECK(dim.has_value(), ConfigError,
                 "--dim '{}': write NAME=VALUE with a positive VALUE, e.g. --dim batch=8", d);
    o.dims[dim->first] = dim->second;
  }
  return o;
}

// `--mesh 2x4`: every operator's sharding on a mesh of an outer axis (across hosts, on the
// cluster's inter-host link, once the mesh outgrows a host) and an inner one within a host, its
// pair of strategies chosen jointly (planner/mesh_sharding.h); `--mesh 4`, one axis (--tp 4).
// Sets the request's outer axis and tp.
void apply_mesh(const std::string& text, const planner::ClusterSpec& cluster,
                planner::GraphPlanRequest& req) {
  std::vector<int> sizes;
  const size_t x = text.find('x');
  for (const auto& part : x == std::string::npos
                              ? std::vector<std::string>{text}
                              : std::vector<std::string>{text.substr(0, x), text.substr(x + 1)}) {
    const auto n = planner::parse_dim("mesh=" + part, '=');
    TESSEL_CHECK(n && n->second >= 1, ConfigError,
                 "--mesh '{}': write HOSTSxDEVICES (e.g. 2x4: 2 hosts of 4 devices) or DEVICES",
                 text);
    sizes.push_back(int(n->second));
  }
  const int inner = sizes.back();
  const int devices = sizes.size() == 2 ? sizes[0] * inner : inner;
  TESSEL_CHECK(inner <= cluster.devices_per_host && devices <= cluster.num_devices(), ConfigError,
               "--mesh {}: {} has {} devices per host and {} in all; the inner axis must fit a "
               "host and the mesh the cluster (--gpus grows it)",
               text, cluster.name, cluster.devices_per_host, cluster.num_devices());
  req.outer = sizes.size() == 2 ? sizes[0] : 1;
  req.tp = inner;
}

// `tessel plan --onnx FILE` or `--graph --model NAME`: the operator-graph planner
// (planner/graph_plan.h) on one layout.
int run_plan_graph(const PlanArgs& a) {
  planner::OnnxGraph imported;
  planner::GraphPlanRequest req;
  std::string source;
  auto cluster = planner::ClusterSpec::resolve(a.cluster.empty() ? "dgx-a100" : a.cluster);
  if (a.gpus > 0) cluster = cluster.with_devices(a.gpus);
  if (a.graph) {
    TESSEL_CHECK(a.onnx.empty() && !a.model.empty() && a.config.empty() && a.profile.empty(),
                 ConfigError,
                 "tessel plan --graph plans a preset's operator graph: give --model NAME (and "
                 "--seq), without --onnx, --config or --profile");
    const auto m = model::ModelConfig::preset(a.model);
    req.model = m;
    req.seq = a.seq > 0 ? a.seq : m.max_seq_len;
    req.micro_batch = a.micro_batch;
    imported.graph = planner::transformer_graph(m, a.micro_batch, req.seq);
    source = fmt::format("{} (seq {}, micro-batch {})", a.model, req.seq, a.micro_batch);
  } else {
    TESSEL_CHECK(a.model.empty() && a.config.empty() && a.profile.empty(), ConfigError,
                 "tessel plan --onnx plans the file's graph: leave out --model, --config and "
                 "--profile");
    imported = planner::read_onnx(a.onnx, onnx_options(a.dims));
    source = a.onnx;
  }
  const auto& g = imported.graph;
  req.tp = a.tp > 0 ? a.tp : cluster.devices_per_host;
  req.stages = a.stages;
  req.balance = a.balance;
  req.dp = a.dp;
  req.micro_batches = a.micro_batches;
  req.schedule = a.schedule;
  req.precision = !a.precision.empty() ? planner::parse_precision(a.precision)
                                       : cluster.device.default_precision();
  if (!a.mesh.empty()) {
    TESSEL_CHECK(a.tp == 0, ConfigError, "--mesh {} sets tp (its inner axis): leave out --tp",
                 a.mesh);
    apply_mesh(a.mesh, cluster, req);
  }
  const auto plan = planner::plan_graph(g, cluster, req);

  nlohmann::json doc = planner::graph_plan_json(g, plan);
  doc["model"] = a.graph ? a.model : a.onnx;
  if (!a.graph) {
    doc["producer"] = imported.producer;
    doc["opset"] = imported.opset;
  }
  doc["cluster"] = cluster.name;
  doc["precision"] = planner::precision_name(req.precision);
  doc["warnings"] = imported.warnings;
  // --out: the runtime's plan file when the plan is one (`tessel train --plan`), as the layer
  // planner writes it; else the whole graph plan.
  if (!a.out.empty())
    write_file_atomically(a.out,
                          (plan.layout ? layout::to_json(*plan.layout) : doc).dump(2) + "\n");
  if (!a.trace.empty()) planner::write_trace(planner::simulation_trace(plan.sim), a.trace);
  if (a.json) {
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "tessel plan: {} ({} operators, {:.3g} parameters, {:.3g} forward FLOPs) on {} ({}), dp {}, "
      "{}, {} stage{}, {} micro-batches, {}\n",
      source, g.size(), double(g.total_parameters()), g.total_flops(), cluster.name,
      planner::precision_name(req.precision), req.dp,
      plan.mesh ? fmt::format("on a mesh of {}x{}", plan.outer, plan.tp)
                : fmt::format("tp {}", plan.tp),
      plan.stages, plan.stages == 1 ? "" : "s", req.micro_batches, req.schedule);
  for (const auto& w : imported.warnings) std::cout << "warning: " << w << "\n";
  std::cout << fmt::format(
      "sharding: {} ({} segments, {} programmes of which {} proven optimal, {} reused, {} pairs "
      "pruned, {:.2f} s); {:.4g} s per pass on the {}\n",
      planner::ilp_status_name(plan.sharding_status()), plan.stats.segments, plan.stats.programmes,
      plan.stats.optimal_programmes, plan.stats.reused, plan.stats.pruned, plan.stats.seconds,
      plan.sharding_time_s(), plan.mesh ? "mesh" : "tp axis");
  // The operators with weights, the ones whose choice matters, then a count of the rest.
  std::map<std::string, int> others;
  for (int id = 0; id < g.size(); ++id) {
    const auto& n = g.node(id);
    if (!n.weights.empty())
      std::cout << fmt::format("  {:<40} {:<10} {}\n", n.name, n.op_type, plan.strategy(id));
    else
      ++others[fmt::format("{} {}", planner::op_kind_name(n.kind), plan.strategy(id))];
  }
  for (const auto& [what, count] : others) std::cout << fmt::format("  {:>5} x {}\n", count, what);
  if (plan.cut) {
    std::string flops;
    for (double f : plan.cut->stage_flops) flops += fmt::format(" {:.3g}", f);
    std::cout << fmt::format(
        "pipeline cut: {}, {:.4g} bytes cross the stage boundaries, stage FLOPs{} ({:.2f} s)\n",
        planner::ilp_status_name(plan.cut->status), plan.cut->crossing_bytes, flops,
        plan.cut->solve_s);
  }
  std::cout << fmt::format(
      "step: {:.4g} s = pipeline {:.4g} s (bubble {:.1f}%) + the sharding's weight sync {:.4g} s + "
      "dp sync {:.4g} s + optimizer {:.4g} s{}\n",
      plan.step_s, plan.pipeline_s, 100 * plan.sim.bubble_fraction(), plan.tp_sync_s, plan.dp_s,
      plan.optimizer_s, plan.layout ? "" : " (the generic step: the dp all-reduce not overlapped)");
  if (plan.layout) std::cout << "runtime layout: " << plan.layout->describe() << "\n";
  if (!plan.not_runnable.empty()) std::cout << "not runnable: " << plan.not_runnable << "\n";
  if (!a.trace.empty())
    std::cout << fmt::format("wrote the simulated step's trace to {} (Perfetto)\n", a.trace);
  if (!a.out.empty())
    std::cout << fmt::format("wrote the {} to {}\n",
                             plan.layout ? "runtime plan (tessel train --plan)" : "plan", a.out);
  return 0;
}

// `tessel plan serve`: the graph planner over HTTP (planner/plan_service.h) until Ctrl-C.
int run_plan_serve(const PlanArgs& a) {
  planner::PlanServiceOptions o;
  o.server.host = a.host;
  o.server.port = a.port;
  o.server.token_file = a.token_file;
  o.max_model_bytes = size_t(a.max_model_mb * 1024 * 1024);
  o.ilp.time_limit_s = a.ilp_time_limit;
  planner::PlanService service(o);
  StopSignals stop;
  const int port = service.start();
  fmt::print(
      "planning service on http://{}:{}: POST an ONNX model to /v1/plan?tp=4&stages=2&dim=batch:8"
      "{}; Ctrl-C stops\n",
      a.host, port,
      service.requires_token() ? " (requests need \"Authorization: Bearer <token>\")" : "");
  std::fflush(stdout);
  while (stop_requested() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  service.stop();
  fmt::print("stopped (signal {})\n", stop_requested());
  std::fflush(stdout);
  return 0;
}

int run_plan(const PlanArgs& a) {
  if (!a.onnx.empty() || a.graph) return run_plan_graph(a);
  planner::SearchRequest req;
  TESSEL_CHECK(
      a.model.empty() != a.config.empty(), ConfigError,
      "tessel plan: give either --model PRESET or --config TRAIN.yaml (whose model section "
      "may describe any model), not {}",
      a.model.empty() ? "neither" : "both");
  int64_t config_batch = 0;
  int config_seq = 0;
  if (!a.config.empty()) {
    const auto cfg = config::TrainConfig::load(a.config);
    req.model = cfg.model;
    config_batch = cfg.training.global_batch;
    config_seq = int(cfg.data.seq_len);
  } else {
    req.model = model::ModelConfig::preset(a.model);
  }
  const std::string cluster = !a.cluster.empty()  ? a.cluster
                              : a.profile.empty() ? "dgx-a100"
                                                  : "this-machine";
  if (!a.profile.empty()) {
    TESSEL_CHECK(cluster == "this-machine", ConfigError,
                 "--profile describes this machine; use it with --cluster this-machine, not '{}'",
                 cluster);
    const nlohmann::json doc = read_json_file(a.profile);
    req.cluster = planner::from_profile_json(doc);
    if (doc.contains("layer_times"))
      req.profile = planner::compute_profile_from_json(doc, req.model);
  } else {
    TESSEL_CHECK(cluster != "this-machine", ConfigError,
                 "--cluster this-machine needs --profile FILE (written by `tessel profile`)");
    req.cluster = planner::ClusterSpec::resolve(cluster);
  }
  if (a.gpus > 0) req.cluster = req.cluster.with_devices(a.gpus);
  if (!a.precision.empty()) {
    req.precision = planner::parse_precision(a.precision);
  } else {
    req.precision = req.cluster.device.default_precision();
  }
  req.global_batch = a.global_batch > 0 ? a.global_batch : config_batch;
  TESSEL_CHECK(req.global_batch > 0, ConfigError,
               "tessel plan: --global-batch is required with --model (a --config gives its "
               "training.global_batch)");
  req.seq = a.seq > 0 ? a.seq : config_seq > 0 ? config_seq : req.model.max_seq_len;
  TESSEL_CHECK(a.top >= 1, ConfigError, "--top is {}; it must be at least 1", a.top);
  req.options.top_k = a.top;

  const planner::SearchResult res = planner::search(req);
  const planner::Candidate& best = res.best();  // throws the infeasible answer

  if (!a.out.empty()) write_file_atomically(a.out, layout::to_json(best.plan).dump(2) + "\n");
  if (a.json) {
    nlohmann::json doc;
    doc["model"] = req.model.name;
    doc["cluster"] = req.cluster.name;
    doc["devices"] = req.cluster.num_devices();
    doc["global_batch"] = req.global_batch;
    doc["seq"] = req.seq;
    doc["precision"] = planner::precision_name(req.precision);
    doc["plan"] = layout::to_json(best.plan);
    nlohmann::json predicted = planner::to_json(best);
    predicted.erase("plan");
    doc["predicted"] = predicted;
    doc["alternatives"] = nlohmann::json::array();
    for (const auto& c : res.ranked) doc["alternatives"].push_back(planner::to_json(c));
    doc["search"] = {{"seconds", res.seconds},
                     {"evaluated", res.evaluated},
                     {"rejected_memory", res.rejected_memory}};
    std::cout << doc.dump(2) << "\n";
  } else {
    std::cout << table(req, res);
    if (!a.out.empty()) std::cout << fmt::format("wrote the best plan to {}\n", a.out);
  }
  std::cout.flush();
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand(
      "plan", "search the fastest dp x tp x pp layout of a model that fits a cluster");
  cmd->add_option("--model", args->model, "model preset (see `tessel presets`)");
  cmd->add_option("--config", args->config,
                  "train config YAML: its model section (any model), data.seq_len and "
                  "training.global_batch (flags override them)");
  cmd->add_option("--cluster", args->cluster,
                  "dgx-a100 (the default), dgx-h100, a cluster YAML file, or this-machine (the "
                  "default with --profile)");
  cmd->add_option("--profile", args->profile,
                  "profile JSON from `tessel profile`: plans for this machine with measured times");
  cmd->add_option("--gpus", args->gpus, "total devices (default: the cluster's)")
      ->check(kDeviceCount);
  cmd->add_option("--global-batch", args->global_batch,
                  "samples per optimizer step (required with --model)")
      ->check(kCount);
  cmd->add_option("--seq", args->seq, "tokens per sample (default: the model's max_seq_len)")
      ->check(kCount);
  cmd->add_option("--precision", args->precision,
                  "fp32, bf16 or fp16 (default: bf16 where the device has it, else fp32)");
  cmd->add_option("--top", args->top, "alternatives to list")->capture_default_str();
  cmd->add_flag("--json", args->json, "print JSON instead of a table");
  cmd->add_option("--out", args->out, "write the best plan's JSON to this file");
  cmd->add_option("--onnx", args->onnx,
                  "plan an ONNX model's operator graph instead: each operator's sharding over tp "
                  "devices (ILP per segment, joined by dynamic programming) and, with --stages, "
                  "its pipeline cut");
  cmd->add_option("--dim", args->dims,
                  "with --onnx: NAME=VALUE for a symbolic dimension of the model's inputs "
                  "(repeatable), e.g. --dim batch=8 --dim seq=1024");
  cmd->add_option(
         "--tp", args->tp,
         "with --onnx or --graph: devices to shard across (default: the cluster's devices per "
         "host)")
      ->check(kCount);
  cmd->add_option("--stages", args->stages,
                  "with --onnx or --graph: pipeline stages to cut the graph into")
      ->check(kCount)
      ->capture_default_str();
  cmd->add_option("--balance", args->balance,
                  "with --onnx or --graph and --stages: each stage's FLOPs at most (1 + this) x an "
                  "equal share")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  cmd->add_flag("--graph", args->graph,
                "plan --model's operator graph (as --onnx does a file's): per-operator sharding, "
                "a cut between whole layers, and a runtime plan (--out) for `tessel train --plan`");
  cmd->add_option("--dp", args->dp, "with --onnx or --graph: data-parallel replicas")
      ->check(kCount)
      ->capture_default_str();
  cmd->add_option("--micro-batches", args->micro_batches,
                  "with --onnx or --graph: micro-batches per step and replica (the graph is one)")
      ->check(kCount)
      ->capture_default_str();
  cmd->add_option("--micro-batch", args->micro_batch, "with --graph: samples per micro-batch")
      ->check(kCount)
      ->capture_default_str();
  cmd->add_option("--schedule", args->schedule,
                  "with --onnx or --graph: the pipeline schedule (gpipe, 1f1b, zb-h1, ...; zb-v "
                  "and interleaved-1f1b cut two chunks per stage)")
      ->capture_default_str();
  cmd->add_option("--mesh", args->mesh,
                  "with --onnx or --graph: shard on a 2-axis mesh, HOSTSxDEVICES (e.g. 2x4), each "
                  "operator's strategy per axis chosen together, per pipeline stage (in place of "
                  "--tp; the graph is one micro-batch of the whole mesh)");
  cmd->add_option("--trace", args->trace,
                  "with --onnx or --graph: write the simulated step as a Perfetto trace");
  auto* serve = cmd->add_subcommand(
      "serve", "serve the graph planner over HTTP: POST an ONNX model to /v1/plan, get the plan");
  serve->add_option("--host", args->host,
                    "address to bind (default 127.0.0.1: this machine only; any other address "
                    "needs --token-file)");
  serve->add_option("--port", args->port, "port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_option("--token-file", args->token_file,
                    "file holding a shared secret (mode 600); every request must then send "
                    "\"Authorization: Bearer <secret>\"");
  serve->add_option("--max-model-mb", args->max_model_mb, "largest ONNX model accepted, in MiB")
      ->check(CLI::Range(0.001, 65536.0))
      ->capture_default_str();
  serve
      ->add_option("--ilp-time-limit", args->ilp_time_limit,
                   "seconds each integer programme may take")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  // The parent's callback runs after the subcommand's: it decides.
  cmd->callback([args, serve, &action] {
    if (serve->parsed())
      action = [args] { return run_plan_serve(*args); };
    else
      action = [args] { return run_plan(*args); };
  });
}

}  // namespace tessel::cli
