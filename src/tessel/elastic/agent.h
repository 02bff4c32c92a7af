// `tessel agent`: one per host of a cluster (cluster.h). It
//  * registers its host in etcd under a lease (a new host id each time: a host that was cut off
//    and comes back is a new host) and renews it; a host whose lease expires is lost;
//  * runs the cluster's job: starts the worker processes the job's coordinator places on this
//    host, kills the ones it fences, and reports every exit;
//  * stands for the job's coordinator election: the first agent to create the job's coordinator
//    key on its lease runs the ClusterCoordinator (cluster_coordinator.h); when that agent's host
//    dies the key expires with its lease and another agent takes over, from the decisions in the
//    store;
//  * fences itself: when it finds its own lease expired (the host was cut off long enough for the
//    others to count it lost) it kills its workers before anything else -- they belong to
//    generations the job has replaced -- and registers anew.
// SIGTERM or SIGINT: the agent's workers get SIGTERM (a planned leave: each saves nothing, hands
// its state over and exits), and the agent deregisters once they are gone, or at
// elastic.stop_grace_s.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace tessel::elastic {

struct AgentOptions {
  std::string store;                // etcd's client URL, http://host:port
  std::string cluster = "default";  // agents and jobs of one cluster share it
  std::string name;                 // for messages; empty: the machine's hostname
  // Where this host's workers are reached by others: the address Gloo binds to. Empty: the
  // first IPv4 address of `iface`, else 127.0.0.1 (a cluster on one machine).
  std::string address;
  std::string iface;
  int slots = 1;                              // worker processes this host runs
  std::string work_dir = "tessel-agent";      // worker logs (<job>/process<N>.log)
  std::chrono::milliseconds lease_ttl{2000};  // a host silent this long is lost
  // The worker command, without its arguments; empty: this executable.
  std::string tessel_binary;
  std::string log_level = "info";
  // The cluster's token file (cluster.h: "Only members take part"); required.
  std::string token_file;
  // Where this host keeps its share of a job's checkpoints (cluster_checkpoints.h); empty: the
  // job's checkpoint.dir, on this host.
  std::string checkpoint_dir;
};

// The IPv4 address of a network interface; ConfigError naming it when it has none.
std::string interface_address(const std::string& iface);

// Runs the agent until SIGTERM/SIGINT; returns the process's exit code. Throws PeerLostError
// when etcd cannot be reached at start, ConfigError for bad options.
int run_agent(const AgentOptions& options);

}  // namespace tessel::elastic
