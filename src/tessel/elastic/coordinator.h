// The coordinator of an elastic job: it runs inside `tessel train` (the launcher process; nothing
// to start by hand) and owns the job's membership through two channels.
//
//  * Workers -> coordinator. Before every switch of plans, rank 0 writes
//    <store>/<job>.switch-<g>.json (the generation, step, old and new plan, cause); the
//    coordinator starts the ranks the new plan adds (TESSEL_JOIN_GENERATION=g), which read the
//    switch from that file and join the transition as receivers. Ranks the new plan drops leave
//    by themselves (exit 0).
//  * Users -> coordinator. A local control socket, <ctl dir>/<job>.sock (ctl dir:
//    $TESSEL_CTL_DIR, else /tmp/tessel-ctl), takes one command per connection (`tessel ctl`):
//      scale N   the planner picks the plan for N workers (keeping the global batch); a count
//                no plan fits is refused with the planner's reason, and training goes on.
//                Otherwise the coordinator writes <store>/<job>.request-<r>.json and the workers
//                switch at the next step boundary (they agree on the newest request in a
//                collective, so requests made while a switch runs are applied after it -- the
//                newest wins, none is lost).
//      status    the job, its workers and the requests so far.
//    Each reply is one line starting with "ok:" or "refused:".
//  * A watched hosts file (elastic.hosts_file, like Varuna's machine list): one line per worker
//    slot; when the number of slots changes, the coordinator makes the same request as
//    `scale N` (and logs a refusal the same way).
// Not thread-safe: the launcher calls tick() from its loop.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "tessel/runtime/launcher.h"
#include "tessel/runtime/train_config.h"

namespace tessel::elastic {

// $TESSEL_CTL_DIR, else /tmp/tessel-ctl.
std::string control_dir();

class Coordinator {
 public:
  // Listens on <control_dir()>/<job_id>.sock. Throws IoError when the socket cannot be created.
  Coordinator(runtime::TrainConfig cfg, std::string job_id, int initial_workers);
  ~Coordinator();  // removes the socket
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const std::string& socket_path() const { return socket_path_; }

  // One round: answers pending control connections and starts the ranks of announced switches.
  // `job` holds the store directory and job id the workers see.
  void tick(const runtime::LaunchOptions::Spawn& spawn, const runtime::LaunchResult& job);

  // The reply to one command line (exposed for tests).
  std::string handle(const std::string& line, const std::string& store_dir);

 private:
  void start_joiners(const runtime::LaunchOptions::Spawn& spawn, const std::string& store_dir);

  // elastic.hosts_file: scales the job when the number of worker slots listed changes.
  void watch_hosts_file(const std::string& store_dir);

  runtime::TrainConfig cfg_;
  int64_t hosts_mtime_ = -1;  // of the hosts file when last read
  int hosts_slots_ = -1;      // worker slots it listed then
  std::string job_id_;
  std::string socket_path_;
  int listen_fd_ = -1;
  int workers_ = 0;          // of the newest announced plan
  int next_generation_ = 1;  // the switch marker awaited next
  int64_t requests_ = 0;     // scale requests written so far
};

// Sends one command to the job's control socket and returns the reply line. `job_id` empty: the
// only job with a socket in control_dir(). Throws IoError naming the socket when there is no such
// job, several jobs (listing them), or it does not answer within `timeout_ms`.
std::string send_control_command(const std::string& job_id, const std::string& command,
                                 int timeout_ms = 10000);

}  // namespace tessel::elastic
