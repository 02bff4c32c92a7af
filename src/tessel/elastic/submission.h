// `tessel train CONFIG --cluster URL`: a job handed to a cluster of `tessel agent`s (cluster.h)
// instead of run by this process. The submitter checks the config and the cluster, writes the
// job's submission, then follows it -- the plans, the hosts and the progress as they change --
// until the job ends. It runs nothing itself: killing it leaves the job running (the agents
// have it); SIGTERM/SIGINT asks the job to save and stop, as with a job on one host.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "tessel/comm/control_store.h"
#include "tessel/config/train_config.h"
#include "tessel/elastic/cluster.h"

namespace tessel::elastic {

// A cluster address as users write it: "http://host:port" (the cluster "default") or
// "http://host:port/<cluster>". Throws ConfigError for anything else.
struct ClusterAddress {
  std::string store;  // etcd's client URL
  std::string cluster = "default";
};
ClusterAddress parse_cluster_address(const std::string& text);

// Writes the job's submission. Throws PeerLostError when etcd does not answer, ConfigError when
// no agent has joined the cluster, when it runs another job (naming it) or when a job of this
// id left keys behind.
void submit_job(comm::ControlStore& store, const std::string& cluster, const JobSubmission& job);

// Follows the job until decisions/done, printing one line per change through `print` (a new
// plan, a host that joined or was lost, progress every `progress_every` steps); asks the job to
// stop (requests/stop) once `interrupted()` returns non-empty, with that reason. Returns the
// job's end and removes its keys and submission. Throws PeerLostError when etcd stays
// unreachable for `patience`.
JobEnd follow_job(comm::ControlStore& store, const std::string& cluster, const std::string& job,
                  const std::function<std::string()>& interrupted,
                  const std::function<void(const std::string&)>& print,
                  std::chrono::milliseconds patience = std::chrono::minutes(2));

// The config of the job the cluster runs (what its workers train with), steps override applied.
// Throws ConfigError when the cluster runs no job.
config::TrainConfig submitted_config(comm::ControlStore& store, const std::string& cluster);

}  // namespace tessel::elastic
