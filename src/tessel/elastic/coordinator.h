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
//                Otherwise the coordinator writes <store>/<job>.request-<r>.json; at the next
//                step boundary the workers agree on the newest request in a collective and
//                announce the switch (prepare-<g>): the processes it adds start and everyone
//                builds the new buffers while elastic.prepare_steps more steps run, then they
//                switch (at once with prepare_steps 0, or when a timeline entry comes first).
//                Requests made while a switch is prepared or runs are applied after it -- the
//                newest wins, none is lost.
//      status    the job, its workers and the requests so far.
//    Each reply is one line starting with "ok:" or "refused:".
//  * Failures. A worker killed by a signal (SIGKILL, the OOM killer, a preempted machine's
//    SIGTERM) does not end the job: the launcher hands its exit to on_exit(). Its peers notice
//    (PeerLostError / TimeoutError), break their communicators so everyone notices, and write a
//    failure report (elastic/switch_marker.h). Once every surviving process has reported, the
//    coordinator decides (recovery.h: live from survivors when every piece has a surviving copy,
//    else from the newest checkpoint), writes <store>/<job>.recovery-<e>.json and the switch
//    marker, and starts the processes it adds. A failure report that no death explains (a
//    collective timed out) starts the same recovery with every process surviving. A worker that
//    exits with an error code is a bug
//    or a bad input, not a lost machine: that still ends the job, with its message.
//  * A watched hosts file (elastic.hosts_file, like Varuna's machine list): one line per worker
//    slot; when the number of slots changes, the coordinator makes the same request as
//    `scale N` (and logs a refusal the same way).
// Not thread-safe: the launcher calls tick() from its loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/process/launcher.h"

namespace tessel::elastic {

// $TESSEL_CTL_DIR, else /tmp/tessel-ctl.
std::string control_dir();

class Coordinator {
 public:
  // Listens on <control_dir()>/<job_id>.sock. Throws IoError when the socket cannot be created.
  Coordinator(config::TrainConfig cfg, std::string job_id, int initial_workers);
  ~Coordinator();  // removes the socket
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const std::string& socket_path() const { return socket_path_; }

  // One round: answers pending control connections and starts the ranks of announced switches.
  // `job` holds the store directory and job id the workers see.
  void tick(const process::LaunchOptions::Spawn& spawn, const process::LaunchResult& job);

  // A worker ended (the launcher's on_exit). Returns true when the job goes on without it.
  bool on_exit(const process::WorkerExit& e);

  // The reply to one command line (exposed for tests).
  std::string handle(const std::string& line, const std::string& store_dir);

 private:
  void start_joiners(const process::LaunchOptions::Spawn& spawn, const std::string& store_dir);
  // Opens failure number failures_ + 1: every running process is to report.
  void start_recovery(const std::string& cause);
  // The running processes a failure recovery waits for: all but those still preparing.
  std::set<int> state_holders() const;
  // Starts a recovery when a worker reported a failure that no death explains.
  void notice_reported_failures(const std::string& store_dir);
  // Decides a pending recovery once every survivor has reported; throws when it cannot.
  void recover(const std::string& store_dir);

  // elastic.hosts_file: scales the job when the number of worker slots listed changes.
  void watch_hosts_file(const std::string& store_dir);

  config::TrainConfig cfg_;
  int64_t hosts_mtime_ = -1;  // of the hosts file when last read
  int hosts_slots_ = -1;      // worker slots it listed then
  std::string job_id_;
  std::string socket_path_;
  int listen_fd_ = -1;
  int workers_ = 0;          // of the newest announced plan
  int next_generation_ = 1;  // the switch marker awaited next
  int64_t requests_ = 0;     // scale requests written so far
  std::set<int> running_;    // worker processes started and not ended
  // Processes started early for the switch to generation prepared_generation_ (prepare-<g>),
  // until it happens: they hold no state, so a failure in the meantime does not wait for their
  // reports (they leave once its recovery is decided).
  std::set<int> preparing_;
  int prepared_generation_ = 0;
  int next_process_id_ = 0;  // the id the next new process gets
  int64_t failures_ = 0;     // failures so far
  // A failure being recovered from: the survivors still to report, the dead, when it was seen.
  struct Pending {
    std::set<int> expected, dead;
    std::string cause;
    bool someone_finished = false;  // a worker exited 0 meanwhile (the job may be over)
    std::chrono::steady_clock::time_point detected, deadline;
  };
  std::optional<Pending> pending_;
};

// Sends one command to the job's control socket and returns the reply line. `job_id` empty: the
// only job with a socket in control_dir(). Throws IoError naming the socket when there is no such
// job, several jobs (listing them), or it does not answer within `timeout_ms`.
std::string send_control_command(const std::string& job_id, const std::string& command,
                                 int timeout_ms = 10000);

}  // namespace tessel::elastic
