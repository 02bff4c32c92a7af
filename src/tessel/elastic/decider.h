// The coordinator's decisions (reconfiguration.h): the one place where an elastic job's plan,
// members, ranks and generations are chosen, for every cause. It holds no sockets and starts no
// processes: it reads the workers' reports from the control store, publishes records there and
// says which processes to start, so the whole protocol can be driven and checked against a
// MemoryStore without processes (decider_test.cpp). The Coordinator (coordinator.h) feeds it
// commands and process exits and carries out its starts.
//
// Causes and when each becomes a record:
//  * a timeline entry at step s: once rank 0 reports a step within elastic.prepare_steps + 1 of s
//    and no other record is pending; at_step = s (the members wait for it prepare_steps before s,
//    where they start preparing it);
//  * a scale request (`tessel ctl scale`, the hosts file): at once when no record is pending,
//    else when the pending one has been applied (the newest request wins; none is lost, and one
//    whose record a failure voided is made again);
//  * a failure (a worker killed, or a failure a worker reports that no death explains): once every
//    surviving state holder has reported (recovery.h decides what to continue from), with a
//    generation above every one published, which voids a pending record;
//  * a planned leave (a worker received SIGTERM and wrote reports/leaving/<p>): like a scale
//    request to the plan for the others, with those processes as members, switched at once
//    (at_step 0: nothing to prepare); when no plan fits the others, the job stops instead.
// A record is pending from its publication until rank 0 reports its generation.
//
// Fencing. A process that stops answering is fenced -- the coordinator kills it, and its death is
// recovered from like any other -- when its heartbeat (heartbeat.h) expires, or when it has not
// reported a failure its peers met within parallel.timeout_s (+ 5 s) of the first report (stuck
// where no timeout reaches it). A killed process can send nothing more; a multi-host agent will
// also supersede its generation.
//
// Stopping. stop() (the launcher received SIGTERM or SIGINT), or a leave no plan survives, writes
// decisions/stop: no more switches are decided (recoveries still are), and every world saves at
// its next step boundary and ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/config/train_config.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

// A machine that runs workers: its id (unique for the job's life; a machine that comes back is a
// new host), how many workers it takes (0: any number, the one host of `tessel train`) and its
// name for messages.
struct Host {
  int id = 0;
  int slots = 0;
  std::string name = "local";
};

// A restore that fails every time -- its checkpoint unreadable on every host that holds it,
// say -- would make each recovery choose that checkpoint again, for ever. After this many
// recoveries in a row from one checkpoint that no worker got past, the job stops, saying so.
inline constexpr int kMaxRepeatedRestores = 3;

class Decider {
 public:
  using Clock = std::chrono::steady_clock;

  // Where a recovery that no survivor can serve finds the newest checkpoint: by default the
  // newest intact one in checkpoint.dir; a cluster's from its hosts (cluster_checkpoints.h).
  void set_checkpoint_finder(std::function<std::optional<std::string>()> find) {
    find_checkpoint_ = std::move(find);
  }

  // A process to start on `host`, for the switch to `generation` (TESSEL_JOIN_GENERATION; 0: the
  // job's first world).
  struct Start {
    int process = 0;
    int generation = 0;
    int host = 0;
  };

  // The job's processes 0..initial_workers-1 run the plan in force at `start_step` (0, or the
  // step of the checkpoint the job resumes from) as generation 0, placed on `hosts` in order
  // (initial_starts() says where). Claims the job's decisions in the store: throws ConfigError
  // when the job already has some (another coordinator of the same job, or a store not cleaned
  // after an earlier job of that name), or when the hosts' slots cannot hold initial_workers.
  Decider(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store, std::string job,
          int initial_workers, int64_t start_step, std::vector<Host> hosts = {Host{}});

  // What a coordinator that takes over a running job (cluster_coordinator.h) knows besides the
  // job's decisions and reports: its first world, where every process was placed and which
  // ended.
  struct History {
    int64_t start_step = 0;
    std::vector<int> first_members;
    std::map<int, int> host_of;             // every process started so far, and its host
    std::map<int, std::string> host_names;  // of those hosts, for messages
  };
  // Takes over the job's decisions from a coordinator that is gone: the plan, members, pending
  // record, failure being recovered from, scale requests applied and stop from the store, the
  // processes from `history`. A process on a host not in `hosts` is lost with it (recovered
  // from like any death); a generation claimed but whose record was never written is given
  // back. Throws CorruptDataError when the job's decisions do not parse.
  Decider(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store, std::string job,
          const History& history, std::vector<Host> hosts);

  // The first world's processes and their hosts.
  std::vector<Start> initial_starts() const;

  // The hosts that can run workers now. A host no longer listed is lost: each of its processes
  // is a death (one recovery for them all). With `grow`, new slots are a scale request to the
  // largest worker count they can hold that the planner lays out, applied at a step boundary.
  void set_hosts(const std::vector<Host>& hosts, bool grow);
  // Workers the hosts can hold (INT_MAX when one takes any number).
  int capacity() const;
  // The host of a process started by this decider (-1 when unknown), and its name.
  int host_of(int process) const;
  std::string host_name(int host) const;

  // `scale N`: the planner's plan for N workers, or the reason there is none ("refused: ...").
  std::string scale(int workers);
  std::string status() const;

  // Ends the job at the workers' next step boundary, after a checkpoint (decisions/stop says
  // `reason`). Idempotent: the first reason stays.
  void stop(const std::string& reason);
  // Why the job is stopping; empty while it is not.
  const std::string& stop_reason() const { return stop_reason_; }

  // The processes to fence now (each once): the coordinator kills them; their deaths come back
  // through on_exit().
  std::vector<int> take_fences();

  // A worker process ended. Returns true when the job goes on without it (it finished, or died of
  // a signal: a lost machine, recovered from); false for an error exit, which ends the job.
  // `crashed`: the signal was of its own making (WorkerExit::crashed()), not sent from outside.
  bool on_exit(int process, bool ok, bool signaled, const std::string& how, bool crashed = false);

  // Reads the workers' reports and makes every decision now due; returns the processes to
  // start. Throws TimeoutError when survivors of a failure did not report in time, and Error
  // (from recovery.h) when no recovery is possible: the job ends.
  std::vector<Start> update();

  int workers() const { return int(members_.size()); }
  // Whether a process this decider started has not ended (as far as it knows).
  bool running(int process) const { return running_.contains(process); }
  // No process runs: the job is over.
  bool idle() const { return running_.empty(); }

 private:
  // Publishes record r (r.generation = generation_ + 1) after moving decisions/generation with
  // compare-and-set; returns the processes it starts.
  std::vector<Start> publish(Reconfiguration r);
  // The switch to `to` whose ranks are the first processes of `pool` (members_ when empty), and
  // new processes for ranks beyond them.
  Reconfiguration switch_to(layout::Plan to, const std::string& cause,
                            const std::vector<int>& pool = {}) const;
  void check_heartbeats();
  void fence(int process, const std::string& why);
  std::vector<Start> leave();
  void start_recovery(const std::string& cause);
  std::set<int> state_holders() const;
  std::vector<Start> recover();
  // " on host <id> (<name>)" for messages; empty on the one local host.
  std::string where(int process) const;
  // A host with a free slot for one more process (ConfigError when none has one).
  int free_host() const;
  // The largest worker count the hosts hold that has a plan (0: none).
  int workers_for_capacity() const;
  void skip_timeline_through(int64_t step);

  config::TrainConfig cfg_;
  std::function<std::optional<std::string>()> find_checkpoint_;
  std::shared_ptr<comm::ControlStore> store_;
  std::string job_;
  int64_t generation_revision_ = 0;  // of decisions/generation as this decider last wrote it

  // The plan in force once every published record is applied.
  int generation_ = 0;
  layout::Plan plan_;
  std::vector<int> members_;
  std::vector<Host> hosts_;
  std::map<int, int> host_of_;  // every process started, and its host
  int grow_target_ = 0;         // the worker count last asked for when slots came
  int next_process_id_ = 0;
  size_t next_timeline_ = 0;
  int64_t step_ = 0;              // the newest step rank 0 reported (or the start step)
  int accept_progress_from_ = 0;  // progress of older generations is from a world a failure ended

  std::optional<int> pending_;   // a published record not yet applied
  int64_t pending_request_ = 0;  // the scale request it carries (0: none)
  std::set<int> preparing_;      // processes started for it: they hold no state yet

  int64_t requests_ = 0;  // scale requests so far
  int64_t applied_request_ = 0;
  std::optional<std::pair<int64_t, layout::Plan>> queued_;  // the newest request not published
  std::optional<std::pair<int64_t, layout::Plan>> last_request_;  // the newest published

  std::set<int> running_;              // worker processes started and not ended
  std::set<int> heartbeats_;           // processes whose heartbeat has been seen
  std::map<int, std::string> fenced_;  // processes fenced, and why
  std::vector<int> to_fence_;          // fenced, not yet taken by the coordinator
  std::set<int> left_;                 // processes whose leave was decided
  std::string stop_reason_;
  int64_t failures_ = 0;
  // Recoveries in a row that restored from one checkpoint and never got past it (see
  // kMaxRepeatedRestores).
  std::string repeated_checkpoint_;
  int repeated_restores_ = 0;
  struct Recovery {
    std::set<int> expected, dead;
    // A process of the job was killed from outside (a signal it did not raise, its host lost):
    // a new failure, which says nothing about whether restoring works.
    bool killed = false;
    std::string cause;
    std::string reported;           // the error of the report that started it ("": a death did)
    bool someone_finished = false;  // a worker exited 0 meanwhile (the job may be over)
    Clock::time_point detected, deadline;
  };
  std::optional<Recovery> recovery_;
};

}  // namespace tessel::elastic
