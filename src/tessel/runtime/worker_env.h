// What the launcher tells a worker process (process/launcher.h), from its environment.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "tessel/comm/communicator.h"
#include "tessel/comm/control_store.h"
#include "tessel/comm/store.h"
#include "tessel/config/train_config.h"
#include "tessel/core/error.h"
#include "tessel/elastic/cluster_checkpoints.h"
#include "tessel/runtime/generation_signals.h"

namespace tessel::runtime {

// The launcher of a job whose control store it serves itself (`tessel train` with the embedded
// store) is gone, and with it the job's coordinator: this process leaves, saving first what it
// can (docs/architecture.md, "Failures"). Thrown where the process cannot save -- it was waiting
// on the store, started for a switch, or its world broke -- with what it saved (nothing) and how
// to resume in the message; a process boundary reports it as the process's last line.
class CoordinatorLostError : public PeerLostError {
 public:
  using PeerLostError::PeerLostError;
  const char* kind() const noexcept override { return "coordinator lost"; }
};

// The death of the launcher serving the job's control store, as the process boundary observed it
// (process/parent_watch.h): the training thread reads it at step boundaries and in its waits on
// the store. Thread-safe.
class LauncherLoss {
 public:
  explicit LauncherLoss(int64_t pid) : pid_(pid) {}
  int64_t pid() const { return pid_; }
  // The launcher is gone. Called once, from the watch's thread; runs the callback of on_notice()
  // before noticed() turns true.
  void notice() noexcept;
  bool noticed() const noexcept { return gone_.load(); }
  // `f` runs once when notice() comes (at once when it came already), under a lock that also
  // guards replacing it: a snapshot of what this process knew at the launcher's death (whether
  // its heartbeat had been lost before). Replaces an earlier callback; an empty one removes it
  // (waiting for one that is running). `f` must not throw.
  void on_notice(std::function<void()> f);

 private:
  const int64_t pid_;
  std::atomic<bool> gone_{false};
  std::mutex mu_;
  std::function<void()> callback_;
};

struct WorkerEnv {
  int rank = 0;  // this process's id in the job (elastic/reconfiguration.h), fixed for its lifetime
  int world_size = 1;     // workers the job started with
  std::string store_dir;  // the rendezvous directory of a fixed launch (`tessel launch`)
  // The job's control store (elastic/reconfiguration.h), an HTTP endpoint; when set, every
  // rendezvous goes through it too and store_dir is unused.
  std::string control_store;
  std::string job_id;
  int64_t generation = 0;       // the store generation the job's first world uses
  int64_t join_generation = 0;  // > 0: started for the switch to this generation
  bool elastic = false;  // the launcher takes scale requests and recovers from failed workers
  // The checkpoint the launcher chose to resume from ("" for a fresh start; unset when no
  // launcher chose: the worker looks for it itself, checkpoint::find_resume_point).
  std::optional<std::string> resume_from;
  // TESSEL_PIPELINE_DELAY: delays injected after pipeline computes (runtime/pipeline_executor.h,
  // DelayInjection), for tests and benchmarks of the schedules under jitter; empty: none.
  std::string pipeline_delay;
  // Started by a `tessel agent` (elastic/agent.h): the cluster whose job this is, and the address
  // other hosts reach this host's processes at (Gloo binds to it). Empty: one host, loopback.
  std::string cluster;
  std::string host_address;
  // The cluster's secret ($TESSEL_CLUSTER_TOKEN_FILE's token; elastic/cluster.h), with which
  // this process signs what it writes to etcd and proves itself to its Gloo peers. Empty
  // outside a cluster.
  std::string secret;
  // In a cluster: the agent's host id, and the job's checkpoint directory on this host
  // ($TESSEL_HOST_ID, $TESSEL_CHECKPOINT_DIR); the job's checkpoints there, set by the worker.
  int host_id = -1;
  std::string checkpoint_root;
  std::shared_ptr<elastic::ClusterSaves> cluster_saves;
  // A client of the job's control store: signed in a cluster.
  std::shared_ptr<comm::ControlStore> open_control_store(std::chrono::milliseconds timeout) const;
  // `tessel train` serves this job's control store (the embedded one): its pid
  // (TESSEL_LAUNCHER_PID), whose death the process boundary reports here; null otherwise (etcd
  // outlives the launcher; a fixed launch has no store).
  std::shared_ptr<LauncherLoss> launcher;
  // The launcher's console, inherited (TESSEL_CONSOLE_FD): where this process's last lines go
  // once the launcher, which read its output, is gone. -1: none.
  int console_fd = -1;
  // The abort signals of this process's generations (elastic processes; none for a fixed launch):
  // store() gives each generation's rendezvous its signal.
  std::shared_ptr<GenerationSignals> signals;

  // Reads TESSEL_CLUSTER, TESSEL_HOST_ADDRESS (both may be unset), TESSEL_RANK, TESSEL_WORLD_SIZE,
  // TESSEL_JOB_ID (required), TESSEL_STORE_DIR or TESSEL_CONTROL_STORE (one of them),
  // TESSEL_GENERATION, TESSEL_JOIN_GENERATION and TESSEL_ELASTIC (0 when unset) and
  // TESSEL_RESUME_FROM, TESSEL_LAUNCHER_PID and TESSEL_CONSOLE_FD (may be unset). Throws
  // ConfigError naming the missing or malformed variable.
  static WorkerEnv from_environment();

  // The rendezvous of the world under store generation `store_generation` (env.generation + the
  // job's switches so far), every wait bounded by `timeout_s` (training.comm_timeout_s).
  comm::StoreOptions store(int64_t store_generation, double timeout_s) const;

  // Where this process's connections listen: host_address, else loopback.
  comm::TransportOptions transport() const;

  // The config of the job the cluster runs (elastic/submission.h). Throws ConfigError when this
  // process was not started by an agent, PeerLostError when the store does not answer.
  config::TrainConfig cluster_config() const;
};

}  // namespace tessel::runtime
