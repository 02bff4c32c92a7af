#include "tessel/cli/profile_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/planner/profiler.h"

namespace tessel::cli {

namespace {

struct ProfileArgs {
  std::string model;
  std::string config;
  int seq = 0;
  int workers = 0;
  int threads = 0;
  int64_t max_micro_batch = 8;
  std::vector<int64_t> micro_batches;
  int repeats = 5;
  int warmup = 1;
  bool no_comm = false;
  std::vector<int64_t> message_bytes;
  int compute_communicators = planner::ProfileOptions{}.compute_communicators;
  double timeout_s = 300;
  std::string out;
};

std::string ms(double s) {
  return fmt::format("{:.3f}", s * 1e3);
}

std::string summary(const nlohmann::json& p) {
  const auto& lt = p.at("layer_times");
  std::string s = fmt::format(
      "tessel profile: {} at seq {}, {} worker(s) x {} thread(s) ({} usable cores), median of {} "
      "repeats, {:.1f} s\n",
      p.at("model").at("name").get<std::string>(), p.at("seq").get<int>(),
      p.at("workers").get<int>(), p.at("threads_per_worker").get<int>(), p.at("cores").get<int>(),
      p.at("repeats").get<int>(), p.at("seconds").get<double>());
  s += fmt::format(
      "  GEMM {:.1f} GFLOP/s per worker (small-call overhead {:.1f} us); optimizer "
      "{:.2f} ns per parameter (gradient norm + AdamW)\n",
      p.at("flops").at("fp32").get<double>() / 1e9, p.at("gemm_half_time_s").get<double>() * 1e6,
      p.at("optimizer").at("seconds_per_param").get<double>() * 1e9);
  s += fmt::format("\n{:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "micro", "block F",
                   "block B", "emb F", "emb B", "head F", "head B", "block act");
  s += fmt::format("{:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "batch", "ms", "ms",
                   "ms", "ms", "ms", "ms", "MiB");
  for (const auto& pt : lt.at("points")) {
    s += fmt::format(
        "{:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12.2f}\n",
        pt.at("micro_batch").get<int64_t>(), ms(pt.at("forward_s").get<double>()),
        ms(pt.at("backward_s").get<double>()), ms(pt.at("embedding_forward_s").get<double>()),
        ms(pt.at("embedding_backward_s").get<double>()), ms(pt.at("head_forward_s").get<double>()),
        ms(pt.at("head_backward_s").get<double>()),
        pt.at("block_activation_bytes").get<double>() / (1 << 20));
  }
  if (p.contains("p2p")) {
    s += fmt::format("\npoint-to-point: {:.2f} GB/s, latency {:.1f} us\n",
                     p.at("p2p").at("bandwidth_bytes_per_s").get<double>() / 1e9,
                     p.at("p2p").at("latency_s").get<double>() * 1e6);
    const auto& ar = p.at("all_reduce");
    s += fmt::format("all-reduce: bus {:.2f} GB/s, latency {:.1f} us (fit over all group sizes)\n",
                     ar.at("bus_bandwidth_bytes_per_s").get<double>() / 1e9,
                     ar.at("latency_s").get<double>() * 1e6);
    for (const auto& g : ar.at("by_group")) {
      s += fmt::format("  {} ranks: bus {:.2f} GB/s, latency {:.1f} us\n", g.at("ranks").get<int>(),
                       g.at("bus_bandwidth_bytes_per_s").get<double>() / 1e9,
                       g.at("latency_s").get<double>() * 1e6);
    }
  }
  return s;
}

int run_profile(const ProfileArgs& a) {
  TESSEL_CHECK(a.model.empty() != a.config.empty(), ConfigError,
               "tessel profile: give either --model PRESET or --config TRAIN.yaml");
  planner::ProfileOptions o;
  int workers = a.workers;
  if (!a.config.empty()) {
    const auto cfg = config::TrainConfig::load(a.config);
    o.model = cfg.model;
    o.seq = cfg.data.seq_len;
    if (workers == 0) workers = cfg.max_workers();
  } else {
    o.model = model::ModelConfig::preset(a.model);
  }
  if (a.seq > 0) o.seq = a.seq;
  o.workers = workers > 0 ? workers : 1;
  TESSEL_CHECK(a.threads >= 0, ConfigError, "--threads is {}; it must be >= 0", a.threads);
  o.threads = a.threads;
  TESSEL_CHECK(a.max_micro_batch >= 1, ConfigError, "--max-micro-batch must be >= 1");
  o.max_micro_batch = a.max_micro_batch;
  o.micro_batches = a.micro_batches;
  o.repeats = a.repeats;
  o.warmup = a.warmup;
  o.measure_comm = !a.no_comm;
  o.message_bytes = a.message_bytes;
  TESSEL_CHECK(a.compute_communicators >= 0, ConfigError, "--compute-communicators must be >= 0");
  o.compute_communicators = a.compute_communicators;
  TESSEL_CHECK(a.timeout_s > 0, ConfigError, "--timeout must be positive");
  o.timeout = std::chrono::milliseconds(int64_t(a.timeout_s * 1000));
  const bool to_stdout = a.out.empty();
  o.progress = [to_stdout](const std::string& line) {
    (to_stdout ? std::cerr : std::cout) << "  " << line << "\n" << std::flush;
  };
  const nlohmann::json doc = planner::profile(o);
  if (to_stdout) {
    std::cout << doc.dump(2) << "\n";
  } else {
    write_file_atomically(a.out, doc.dump(2) + "\n");
    std::cout << summary(doc) << fmt::format("wrote {}\n", a.out);
  }
  std::cout.flush();
  return 0;
}

}  // namespace

void add_profile_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<ProfileArgs>();
  auto* cmd = app.add_subcommand(
      "profile", "measure per-layer times, GEMM rate and communication on this machine");
  cmd->add_option("--model", args->model, "model preset (see `tessel presets`)");
  cmd->add_option("--config", args->config,
                  "train config YAML: its model and seq_len (and its worker count)");
  cmd->add_option("--seq", args->seq, "tokens per sample (default: the model's max_seq_len)");
  cmd->add_option("--workers", args->workers,
                  "worker processes a run here will have (default 1, or the config's)");
  cmd->add_option("--threads", args->threads,
                  "OpenMP threads per worker (default: max(1, cores / workers))");
  cmd->add_option("--max-micro-batch", args->max_micro_batch,
                  "time micro-batch sizes 1, 2, 4, ... up to this")
      ->capture_default_str();
  cmd->add_option("--micro-batches", args->micro_batches,
                  "exact micro-batch sizes to time (instead of --max-micro-batch)")
      ->delimiter(',');
  cmd->add_option("--repeats", args->repeats, "timed repeats per measurement (median)")
      ->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "untimed runs before them")->capture_default_str();
  cmd->add_flag("--no-comm", args->no_comm,
                "skip the communication measurement (the profile then cannot describe a cluster)");
  cmd->add_option("--message-bytes", args->message_bytes,
                  "message sizes for p2p and all-reduce (default 4 KiB to 16 MiB)")
      ->delimiter(',');
  cmd->add_option("--compute-communicators", args->compute_communicators,
                  "communicators the compute workers hold while measured, as training workers do")
      ->capture_default_str();
  cmd->add_option("--timeout", args->timeout_s, "seconds allowed per group of processes")
      ->capture_default_str();
  cmd->add_option("--out", args->out, "write the profile JSON here (default: stdout)");
  cmd->callback([args, &action] { action = [args] { return run_profile(*args); }; });
}

}  // namespace tessel::cli
