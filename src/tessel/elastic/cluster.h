// A cluster of hosts on etcd: what `tessel agent` (agent.h) writes about its host, how a job is
// submitted to the cluster, and the keys through which the job's coordinator -- whichever agent
// holds the election -- has processes started, fenced and reported on hosts it does not run on.
//
// Keys of the cluster, under /tessel/clusters/<cluster>/:
//   next-host      a counter (compare-and-set): every registration of an agent takes the next host
//                  id, so a machine that comes back after being cut off is a new host, and
//                  nothing addressed to its old incarnation reaches it
//   hosts/<id>     HostRecord, on the agent's lease: gone when the agent stops renewing it (the
//                  machine died, or the network cut it off)
//   job            JobSubmission: the job the cluster runs (one at a time); created only when
//                  absent, so a second job is refused while one runs
//   members        written (signed) by the first agent: whoever reads it with another secret is
//                  told at once that its token file is not the cluster's
//
// Only members take part. Every agent, submitter and worker of a cluster holds the cluster's
// secret (a token file, `--token-file` or $TESSEL_CLUSTER_TOKEN_FILE; net/bearer_token.h), and
// every value they write to etcd is signed with it (comm/signed_store.h) and every Gloo pair
// between their processes proves it (comm/pair_handshake.h). A host record, a placement or a
// rendezvous entry that does not verify is ignored with a warning naming its key; a process with
// another secret is refused with one message saying so.
// Keys of the job, beside its control-plane keys (reconfiguration.h), under /tessel/<job>/:
//   coordinator            the agent elected coordinator (its host id), on that agent's lease:
//                          when its host dies the key expires and another agent takes over
//   placement/<process>    Placement: the host that runs the process and the generation it was
//                          started for; that host's agent starts it
//   fence/<process>        the coordinator asks the process's agent to kill it (it stopped
//                          answering)
//   reports/exits/<process> ExitReport, written by the agent that ran the process
//   decisions/start        StartRecord: the first world (plan, members, hosts, step)
//   decisions/done         JobEnd: the job is over (every agent stops its workers; the submitter
//                          reports it)
//   requests/stop          the submitter was interrupted (its reason as the value): the job saves
//                          at its next step boundary and stops
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessel/comm/control_store.h"
#include "tessel/core/check.h"
#include "tessel/layout/plan.h"

namespace tessel::elastic {

// What an agent says about its host.
struct HostRecord {
  int id = 0;
  std::string name;     // for messages: the agent's --name, else the machine's hostname
  std::string address;  // where the host's workers are reached (Gloo binds to it)
  int slots = 1;        // worker processes it runs
  std::string iface;    // the network interface named for it ("" when only the address is)
  int64_t agent_pid = 0;
  double started = 0;  // when the agent registered (Unix time)

  nlohmann::json to_json() const;
  static HostRecord from_json(const nlohmann::json& doc, const std::string& what);
};

// A job as `tessel train --cluster` submits it: the config's text (every host reads the same),
// its overrides and the job's id.
struct JobSubmission {
  std::string job;
  std::string config_yaml;
  std::string config_path;  // where it was read from, for messages
  int64_t steps = 0;        // --steps (0: the config's)
  double submitted = 0;

  nlohmann::json to_json() const;
  static JobSubmission from_json(const nlohmann::json& doc, const std::string& what);
};

struct Placement {
  int process = 0;
  int host = 0;
  int generation = 0;     // started for the switch to this generation (0: the first world)
  std::string host_name;  // for messages, also once the host is gone

  nlohmann::json to_json() const;
  static Placement from_json(const nlohmann::json& doc, const std::string& what);
};

struct ExitReport {
  int process = 0;
  int host = 0;
  bool ok = false;
  bool signaled = false;
  std::string how;       // "exited with code 3", "was killed by signal 9 (SIGKILL)"
  bool crashed = false;  // WorkerExit::crashed()

  nlohmann::json to_json() const;
  static ExitReport from_json(const nlohmann::json& doc, const std::string& what);
};

// The first world of the job.
struct StartRecord {
  layout::Plan plan;
  std::vector<int> members, hosts;
  int64_t step = 0;
  std::string resume_from;  // the checkpoint it resumes from ("" for a fresh start)

  nlohmann::json to_json() const;
  static StartRecord from_json(const nlohmann::json& doc, const std::string& what);
};

struct JobEnd {
  int exit_code = 0;
  std::string reason;  // empty on success

  nlohmann::json to_json() const;
  static JobEnd from_json(const nlohmann::json& doc, const std::string& what);
};

// Reads a record whose every field is required: `read` does nlohmann's accesses, and their
// errors become one CorruptDataError naming the record (`what`, its key) and its `kind`.
template <typename F>
auto parse_record(const std::string& what, const char* kind, F&& read) {
  try {
    return read();
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not a valid {}: {}", what, kind, e.what());
  }
}

// Cluster names and job ids become key segments: letters, digits, '-', '_' and '.', 1-64
// characters. Throws ConfigError naming `what` otherwise.
void check_key_segment(const std::string& name, const std::string& what);

std::string cluster_prefix(const std::string& cluster);  // "/tessel/clusters/<cluster>/"
std::string next_host_key(const std::string& cluster);
std::string hosts_prefix(const std::string& cluster);
std::string host_key(const std::string& cluster, int host);
std::string submission_key(const std::string& cluster);
std::string members_key(const std::string& cluster);
std::string coordinator_key(const std::string& job);
std::string placement_prefix(const std::string& job);
std::string placement_key(const std::string& job, int process);
std::string fence_prefix(const std::string& job);
std::string fence_key(const std::string& job, int process);
std::string exits_prefix(const std::string& job);
std::string exit_key(const std::string& job, int process);
std::string start_key(const std::string& job);
std::string done_key(const std::string& job);
std::string stop_request_key(const std::string& job);

// The hosts registered now, by id (records that do not parse are skipped with a warning).
std::vector<HostRecord> list_hosts(comm::ControlStore& store, const std::string& cluster);

// Takes the next host id of the cluster (compare-and-set on next-host; retried on contention).
int take_host_id(comm::ControlStore& store, const std::string& cluster);

// The environment variable naming the cluster's token file, for every process of a cluster: the
// agent passes it on to its workers.
inline constexpr const char* kClusterTokenEnv = "TESSEL_CLUSTER_TOKEN_FILE";

// The cluster's secret: the token in `token_file` (net::read_token_file's rules: only its owner
// may read it, 16 characters at least). `who` names the command for the message when there is
// none: every process of a cluster must hold it.
std::string read_cluster_secret(const std::string& token_file, const std::string& who);

// A client of the cluster's etcd at `endpoint` whose calls end within `timeout`, signing and
// verifying with `secret` (comm::SignedStore).
std::shared_ptr<comm::ControlStore> open_cluster_store(const std::string& endpoint,
                                                       std::chrono::milliseconds timeout,
                                                       const std::string& secret,
                                                       const std::string& cluster);
std::shared_ptr<comm::ControlStore> open_cluster_store(const std::string& endpoint,
                                                       const std::string& secret,
                                                       const std::string& cluster);

// Proves that this process's secret is the cluster's before it does anything else: reads
// `members` (written by the first agent, which passes `create`). Throws MembershipError, naming
// the cluster and the fix, when the key was signed with another secret.
void check_cluster_secret(comm::ControlStore& store, const std::string& cluster, bool create);

}  // namespace tessel::elastic
