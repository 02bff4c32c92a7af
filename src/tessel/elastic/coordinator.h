// The coordinator of an elastic job: it runs inside `tessel train` (the launcher process; nothing
// to start by hand) and is the job's one decider (decider.h) on its control store
// (reconfiguration.h says who writes what there).
//
//  * The control store. Embedded by default: an in-memory store this process serves over HTTP
//    (comm/store_server.h) on a free loopback port, which the workers reach through
//    TESSEL_CONTROL_STORE; or etcd (elastic.control_store: http://host:port). The job's keys live
//    under /tessel/<job>/; the coordinator claims them at start (a second job of the same id is
//    refused) and, on etcd, removes them at the end.
//  * Users -> coordinator. A local control socket, <ctl dir>/<job>.sock (ctl dir:
//    $TESSEL_CTL_DIR, else /tmp/tessel-ctl), takes one command per connection (`tessel ctl`):
//      scale N   the planner picks the plan for N workers (keeping the global batch); a count
//                no plan fits is refused with the planner's reason, and training goes on.
//                Otherwise the decider publishes the switch (now, or once a pending one is
//                applied: the newest request wins, none is lost).
//      status    the job, its workers and the requests so far.
//      stop      the workers save a checkpoint at their next step boundary and exit; the job
//                resumes from it when started again.
//    Each reply is one line starting with "ok:" or "refused:".
//  * A watched hosts file (elastic.hosts_file, like Varuna's machine list): one line per worker
//    slot; when the number of slots changes, the coordinator makes the same request as
//    `scale N` (and logs a refusal the same way).
//  * Failures. A worker killed by a signal (SIGKILL, the OOM killer, a preempted machine's
//    SIGTERM) does not end the job: the launcher hands its exit to on_exit(), and the decider
//    recovers once the survivors have reported. A worker that exits with an error code is a bug
//    or a bad input, not a lost machine: that still ends the job, with its message. A worker
//    that stops answering (its heartbeat expires, or it does not report a failure its peers met)
//    is killed (fenced) and recovered from the same way.
// Nothing here polls: the launcher runs tick() when a worker exits, a control connection or a
// hosts file change arrives (wake_fds()), or a worker reports to the store (a watch on the
// store's reports wakes it). Not thread-safe: the launcher calls tick() from its loop.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/config/train_config.h"
#include "tessel/elastic/decider.h"
#include "tessel/process/launcher.h"

namespace tessel::comm {
class StoreServer;
}

namespace tessel::elastic {

// $TESSEL_CTL_DIR, else /tmp/tessel-ctl.
std::string control_dir();

class Coordinator {
 public:
  // Opens the control store (serving the embedded one, or reaching etcd: PeerLostError naming the
  // endpoint when it does not answer), claims the job there (ConfigError when another job holds
  // it) and listens on <control_dir()>/<job_id>.sock (IoError when it cannot). The job's first
  // `initial_workers` processes run the plan in force at `start_step`.
  Coordinator(config::TrainConfig cfg, std::string job_id, int initial_workers,
              int64_t start_step = 0);
  ~Coordinator();  // removes the socket (and, on etcd, the job's keys)
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  // What workers are given as TESSEL_CONTROL_STORE: the store's HTTP endpoint.
  const std::string& endpoint() const { return endpoint_; }
  comm::ControlStore& store() { return *store_; }
  // Readable when tick() has something to do (for LaunchOptions::wake_fds).
  std::vector<int> wake_fds() const;

  // One round: answers pending control connections, reads the hosts file when it changed, makes
  // the decisions due and starts the processes they add.
  void tick(const process::LaunchOptions::Workers& workers);

  // Ends the job: the workers save a checkpoint at their next step boundary and exit (the
  // launcher's SIGTERM/SIGINT, or `tessel ctl stop`). Why it stops: empty while it does not.
  void stop(const std::string& reason);
  const std::string& stop_reason() const { return decider_->stop_reason(); }

  // A worker ended (the launcher's on_exit). Returns true when the job goes on without it.
  bool on_exit(const process::WorkerExit& e);

  // The reply to one command line (exposed for tests); a scale request is published by the next
  // tick().
  std::string handle(const std::string& line);

 private:
  void watch_hosts_file();
  void watch_reports();

  config::TrainConfig cfg_;
  std::string job_id_;
  std::shared_ptr<comm::ControlStore> store_;
  std::unique_ptr<comm::StoreServer> server_;  // the embedded store's, when there is no etcd
  std::string endpoint_;
  std::unique_ptr<Decider> decider_;
  std::string socket_path_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;   // eventfd: a worker reported to the store
  int hosts_fd_ = -1;  // inotify on the hosts file's directory
  bool hosts_read_ = false;
  int64_t hosts_mtime_ = -1;  // of the hosts file when last read
  int hosts_slots_ = -1;      // worker slots it listed then
  std::atomic<bool> stop_{false};
  std::thread reports_watcher_;
};

// Sends one command to the job's control socket and returns the reply line. `job_id` empty: the
// only job with a socket in control_dir(). Throws IoError naming the socket when there is no such
// job, several jobs (listing them), or it does not answer within `timeout_ms`.
std::string send_control_command(const std::string& job_id, const std::string& command,
                                 int timeout_ms = 10000);

}  // namespace tessel::elastic
