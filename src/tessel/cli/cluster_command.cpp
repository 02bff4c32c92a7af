#include "tessel/cli/cluster_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>

#include "tessel/cli/count_flag.h"
#include "tessel/comm/etcd_store.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/stop_signal.h"
#include "tessel/elastic/agent.h"
#include "tessel/elastic/cluster.h"
#include "tessel/elastic/submission.h"

namespace tessel::cli {

void add_agent_command(CLI::App& app, const std::string& log_level, std::function<int()>& action) {
  auto* cmd = app.add_subcommand("agent",
                                 "run this host's share of a cluster's training jobs (one agent "
                                 "per host, on etcd)");
  // Parsed values outlive parsing: the action runs after it.
  struct Values {
    elastic::AgentOptions o;
    double lease_ttl_s = 2;
  };
  auto v = std::make_shared<Values>();
  cmd->add_option("--store", v->o.store, "etcd's client URL, http://host:port")->required();
  cmd->add_option("--cluster", v->o.cluster, "the cluster's name (agents and jobs of one cluster)")
      ->capture_default_str();
  cmd->add_option("--slots", v->o.slots, "worker processes this host runs")
      ->check(kCount)
      ->capture_default_str();
  cmd->add_option("--iface", v->o.iface,
                  "the network interface the workers use between hosts (its IPv4 address)");
  cmd->add_option("--address", v->o.address,
                  "the address other hosts reach this host's workers at (default: --iface's, "
                  "else 127.0.0.1)");
  cmd->add_option("--name", v->o.name, "this host's name in messages (default: its hostname)");
  cmd->add_option("--work-dir", v->o.work_dir, "where the workers' logs go")->capture_default_str();
  cmd->add_option("--token-file", v->o.token_file,
                  "the cluster's secret, the same file on every host and for `tessel train "
                  "--cluster` (only its owner may read it)")
      ->envname(elastic::kClusterTokenEnv);
  cmd->add_option("--checkpoint-dir", v->o.checkpoint_dir,
                  "where this host keeps its share of a job's checkpoints (default: the job's "
                  "checkpoint.dir, on this host's disk)");
  cmd->add_option("--lease-ttl", v->lease_ttl_s,
                  "seconds without a renewal after which this host counts as lost")
      ->check(CLI::Range(0.5, 600.0))
      ->capture_default_str();
  cmd->callback([&action, &log_level, v] {
    action = [&log_level, v] {
      v->o.log_level = log_level;
      v->o.lease_ttl = std::chrono::milliseconds(int64_t(v->lease_ttl_s * 1000));
      std::fflush(stdout);  // the supervisor writes workers' lines straight to fd 1
      return elastic::run_agent(v->o);
    };
  });
}

namespace {

std::string random_job_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:04x}", rd(), rd() & 0xffff);
}

}  // namespace

int train_on_cluster(const std::string& config_path, int64_t steps, const std::string& cluster,
                     const std::string& token_file) {
  const auto address = elastic::parse_cluster_address(cluster);
  const std::string secret = elastic::read_cluster_secret(token_file, "tessel train --cluster");
  std::ifstream in(config_path, std::ios::binary);
  TESSEL_CHECK(in.good(), IoError, "cannot read {}", config_path);
  elastic::JobSubmission job;
  job.config_yaml.assign(std::istreambuf_iterator<char>(in), {});
  job.config_path = std::filesystem::absolute(config_path).string();
  job.steps = steps;
  job.job = random_job_id();
  job.submitted = unix_seconds();
  // What every host will read: checked here, before anything is written.
  auto cfg = config::TrainConfig::parse(job.config_yaml, job.config_path);
  cfg.validate();
  const auto shared =
      elastic::open_cluster_store(address.store, std::chrono::seconds(5), secret, address.cluster);
  auto& store = *shared;
  try {
    store.revision();
  } catch (const Error& e) {
    TESSEL_THROW(PeerLostError, "--cluster: no etcd answers at {}: {}", address.store, e.what());
  }
  elastic::check_cluster_secret(store, address.cluster, /*create=*/false);
  elastic::submit_job(store, address.cluster, job);
  fmt::print("job {} submitted to cluster '{}' at {}\n", job.job, address.cluster, address.store);
  std::fflush(stdout);
  StopSignals signals;
  const auto end = elastic::follow_job(
      store, address.cluster, job.job,
      [] {
        const int s = stop_requested();
        return s == 0
                   ? std::string()
                   : fmt::format("`tessel train` received {}", s == SIGINT ? "SIGINT" : "SIGTERM");
      },
      [](const std::string& line) {
        fmt::print("[cluster] {}\n", line);
        std::fflush(stdout);
      });
  if (end.exit_code == 0) {
    fmt::print("job {} finished\n", job.job);
  } else if (end.exit_code == 128 + SIGTERM) {
    fmt::print(stderr, "tessel: training stopped ({}); run the same command to resume{}\n",
               end.reason,
               cfg.checkpoint.dir.empty() ? " -- without checkpoint.dir nothing was saved" : "");
  } else {
    fmt::print(stderr, "tessel: training failed: {}\n", end.reason);
  }
  return end.exit_code;
}

}  // namespace tessel::cli
