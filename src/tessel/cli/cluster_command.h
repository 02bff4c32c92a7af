// Training on a cluster of hosts (elastic/cluster.h):
//
//   tessel agent --store http://etcd:2379 [--cluster NAME] [--slots N] [--iface IF | --address A]
//                [--name NAME] [--work-dir DIR] [--lease-ttl S]
//       one per host: registers it, runs the workers the job's coordinator places on it, and may
//       be elected the coordinator (elastic/agent.h). Runs until SIGTERM/SIGINT.
//   tessel train CONFIG --cluster http://etcd:2379[/NAME] [--steps N]
//       hands the job to the cluster's agents and follows it until it ends (elastic/submission.h);
//       SIGTERM/SIGINT asks the job to save and stop.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace CLI {
class App;
}

namespace tessel::cli {

// Adds the `agent` subcommand to `app`; parsing it sets `action` to run it.
void add_agent_command(CLI::App& app, const std::string& log_level, std::function<int()>& action);

// `tessel train CONFIG --cluster URL`: the job's exit code (0, 128 + SIGTERM when it was stopped
// before its end, 1 when it failed).
int train_on_cluster(const std::string& config_path, int64_t steps, const std::string& cluster,
                     const std::string& token_file);

}  // namespace tessel::cli
