// This process across the generations of an elastic job: the plan in force and its members,
// the RankTrainer of its rank in it (rank_trainer.h, none while the plan has no place for it), and
// the member side of the plan switches. The coordinator decides every switch -- a timeline entry,
// a scale request, a failure recovery -- and publishes it as a record (elastic/reconfiguration.h);
// this process only follows the records (elastic/record_feed.h), agrees with its world on the step
// boundary where one applies, reports its progress and failures, and carries the switch out. A
// switch known ahead is prepared while training goes on (prepared_chunks.h); a switch moves the
// training state between the two plans' layouts directly between processes (reshard/).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessel/comm/control_store.h"
#include "tessel/config/train_config.h"
#include "tessel/elastic/heartbeat.h"
#include "tessel/elastic/reconfiguration.h"
#include "tessel/elastic/record_feed.h"
#include "tessel/elastic/reporter.h"
#include "tessel/layout/plan.h"
#include "tessel/layout/state_layout.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/runtime/metrics.h"
#include "tessel/runtime/prepared_chunks.h"
#include "tessel/runtime/rank_trainer.h"
#include "tessel/runtime/worker_env.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {

// A switch's two layouts and the transfer of the state between them.
struct PlannedSwitch {
  std::shared_ptr<const layout::StateLayout> from, to;
  std::vector<int> from_members, to_members;  // the process of each old and new rank
  reshard::TransferPlan transfer;

  // The chunks a process that is old rank `old_rank` and new rank `new_rank` keeps in place (its
  // parameters stay where they are): marked per old chunk and per new chunk.
  struct Kept {
    std::vector<bool> old_chunks, new_chunks;
  };
  Kept kept_chunks(int old_rank, int new_rank) const;

  // Whether this plan is for `sw` (the same layouts and processes on both sides).
  bool is_for(const elastic::Reconfiguration& sw) const;
};

struct ElasticWorker {
  config::TrainConfig cfg;
  WorkerEnv env;  // env.rank: this process's id (reconfiguration.h), fixed for its lifetime
  // Switches so far: the current world lives under store generation env.generation + generation.
  int generation = 0;
  layout::Plan plan;            // in force now (also known while this process has no rank)
  std::vector<int> members;     // the process of each rank of `plan`
  int64_t failures = 0;         // failures of the job recovered from (or being recovered from)
  size_t next_static = 0;       // the next timeline entry
  int64_t applied_request = 0;  // the newest scale request applied
  std::unique_ptr<RankTrainer> world;  // null while this process has no rank in the plan
  std::optional<elastic::Reconfiguration>
      joining;  // started to join this switch (TESSEL_JOIN_GENERATION)
  // The job's control store (an elastic job only): the records, and this process's reports.
  std::shared_ptr<comm::ControlStore> control;
  std::unique_ptr<elastic::RecordFeed> feed;
  std::unique_ptr<elastic::Reporter> progress;    // reports/progress, written while rank 0
  std::unique_ptr<elastic::Heartbeat> heartbeat;  // reports/alive/<process>
  // This process received SIGTERM/SIGINT (core/stop_signal.h) and asked to leave the job.
  bool leave_requested = false;
  // The world agreed at this step boundary to stop (decisions/stop, or in a fixed launch a stop
  // signal any rank received): it saves a checkpoint and ends.
  bool stopping = false;
  // A switch known ahead (elastic.prepare_steps): made after `at_step` steps; until then this
  // process builds its buffers in the new plan in the background.
  struct Preparation {
    elastic::Reconfiguration sw;
    int64_t at_step = 0;
    std::future<PreparedChunks> chunks;  // invalid: this process prepares nothing
    // The transfer, planned at the announcement (null: to be planned at the switch).
    std::shared_ptr<const PlannedSwitch> planned;
    int waited = 0;  // boundaries past at_step a scale-up waited for the builds
  };
  std::optional<Preparation> preparing;
  // When the newest step ended (Unix time): a switch's control-plane share of its pause runs
  // from the later of this and the record's decision to the switch's start.
  double boundary_at = 0;
  // The same moment on this process's steady clock: the control plane's share of a pause is
  // measured on two hosts' wall clocks, which may be skewed or jump (NTP, a restored VM), so it is
  // bounded by what this process's own clock saw.
  std::chrono::steady_clock::time_point boundary_steady{};
  // The current world was just entered (started, resumed or made by a switch): the loop asks for
  // switches due at this boundary before the next step.
  bool entered = false;
  std::optional<MetricsWriter> events;  // output.events, opened by the first rank 0 writing
  bool fatal = false;  // a failure recovery cannot help (the coordinator gave no answer)
  // The world agreed at this step boundary to stop because the launcher that served the job's
  // control store is gone (env.launcher): it saves what it holds and leaves, nobody being left to
  // decide anything else (ParallelTrainer::run).
  bool orphaned = false;
  // The heartbeat had already been lost when the launcher's death was noticed: the lease expired
  // at a live store, so this process was fenced and must not save. One lost after that only
  // says that the store died with the launcher.
  std::atomic<bool> fenced_before_launcher_loss{false};
  // `generation`, for the watch's thread (on_launcher_loss): the world in force.
  std::atomic<int> generation_in_force{0};

  // Joins the job: as a receiver of the switch it was started for (env.join_generation, read from
  // its record), or from the newest checkpoint (checkpoint.resume), or as rank env.rank of the
  // config's plan.
  ElasticWorker(config::TrainConfig c, const WorkerEnv& e);
  // Stops taking the launcher's death into account (the callback reads the heartbeat).
  ~ElasticWorker();
  ElasticWorker(const ElasticWorker&) = delete;
  ElasticWorker& operator=(const ElasticWorker&) = delete;
  // The constructor's second half, once the control plane is reached: the switch this process
  // was started for, a resume, or the plan's first world. A process started for a switch whose
  // launcher dies before the switch began leaves it with no world (run() then ends at once).
  void join_job();

  // The launcher serving the job's control store died (on the watch's thread, once): takes note
  // of whether this process had been fenced, and aborts the rendezvous of the generations past
  // the world in force (a switch or recovery in progress cannot finish without the store).
  void on_launcher_loss() noexcept;
  // The launcher serving the job's control store is known to be gone (never for etcd).
  bool launcher_gone() const { return env.launcher != nullptr && env.launcher->noticed(); }
  // "the coordinator (tessel train, pid N) is gone".
  std::string launcher_gone_message() const;
  // Leaves without saving because the launcher is gone and `why` (what stopped this process
  // from saving): throws CoordinatorLostError naming what the process held and the newest
  // checkpoint a restart resumes from.
  [[noreturn]] void leave_without_saving(const std::string& why) const;

  // Whether the launcher takes scale requests for this job (`tessel ctl scale`) and recovers
  // from failed workers; read once, not at every step boundary.
  bool elastic() const { return env.elastic; }

  // The process reporting progress, metrics and events: rank 0 of the current world.
  bool lead() const { return world != nullptr && world->rank == 0; }

  void skip_timeline_through(int64_t step);

  // Continues from the newest checkpoint in checkpoint.dir, saved under any plan: this process
  // joins the plan the config has in force at the saved step and reads its share. Returns false
  // when there is none (or resume is off).
  bool resume();
  // A checkpoint to read from: in a cluster, this host's copy of its step directory and the
  // fetcher of what other hosts hold.
  struct OpenedCheckpoint {
    std::unique_ptr<store::CheckpointReader> reader;
    store::PieceFetcher fetch;
    std::vector<std::string> remote_files;
  };
  OpenedCheckpoint open_checkpoint(const std::string& path) const;

  // After a step: rank 0 reports it, and the switch to make now, if any. Collective over the
  // world: the ranks agree (one all-gather) on the newest record any of them has seen and on
  // whether to stop (then `stopping` is set and nothing is returned), so every rank does the same
  // at the same boundary. A process that received a stop signal asks the coordinator to switch
  // it out (a planned leave); in a fixed launch, the world stops instead. A record due at a
  // timeline entry's step is waited for there. Throws PeerLostError when the coordinator is
  // recovering from a failure this process has not met (it reports then, like its peers). The
  // all-gather also carries whether the process noticed that the launcher serving the control
  // store is gone: then every rank sets `orphaned` and `stopping`, and the world saves and leaves.
  std::optional<elastic::Reconfiguration> next_switch();

  // Record g from the feed, waited for up to the recovery bound; throws PeerLostError when a
  // failure is announced meanwhile, CoordinatorLostError when the launcher serving the store dies
  // and TimeoutError when it does not come.
  elastic::Reconfiguration wait_for_record(int g, const std::string& why);

  // Rank 0's report of where the world is (the go of a switch when `entering` > 0).
  void report_progress(int entering = 0);

  // Starts building, on a background thread, the chunks this process will hold in switch sw's
  // plan and cannot take over from its current world; the switch is made after `at_step` steps.
  void start_preparation(elastic::Reconfiguration sw, int64_t at_step);

  // Drops a preparation (its switch will not happen: a failure came first), after its
  // background build ended.
  void drop_preparation() noexcept;

  // The buffers prepared for switch `sw`, if it is the prepared one, after their build ended;
  // `record` gets when it was announced and how long the switch waited for the build.
  std::optional<PreparedChunks> take_prepared(const elastic::Reconfiguration& sw,
                                              nlohmann::json& record);

  // The layouts of both plans and the transfer between them. One host: every process is local.
  // The layouts and the transfer of `sw`: the preparation's when it planned this switch.
  std::shared_ptr<const PlannedSwitch> plan_switch(const elastic::Reconfiguration& sw) const;

  // A process started for a switch: builds its chunks while the job still trains, then waits for
  // the go (rank 0's progress report entering the switch's generation) and returns the switch.
  // Returns nothing when a failure recovery overtook the switch (a recovery record for a later
  // failure appeared first), the job stops, or the launcher serving the store died: this process,
  // which holds no state, is not needed. Throws TimeoutError when neither comes within the bound.
  std::optional<elastic::Reconfiguration> await_switch(const elastic::Reconfiguration& announced);

  void write_event(const nlohmann::json& record);

  // The event line of a switch this process measured for `total_s`, with what the switch's
  // author recorded (the coordinator's detection and planning times, steps lost, ...). The pause
  // of a recovery runs from the failure's detection.
  void write_switch_event(nlohmann::json record, const elastic::Reconfiguration& sw,
                          double total_s);

  // Enters generation sw.generation: every process of the old or the new world joins one
  // transition world, the training state moves by the TransferPlan (each piece from the nearest
  // holder; nothing a process keeps moves), the new world's members build their chunks in the
  // new generation and continue with the old world's step, data cursor and learning-rate
  // position. Processes without a rank in the new plan drop their state and leave. A recovery
  // (sw.recovery) takes its sources from sw.from_members only (the others' ranks are lost), or
  // reads the whole state from sw.checkpoint. If the switch fails, this process keeps its old
  // world and state (chunks a successor took over are given back), so it can report them.
  void transition(const elastic::Reconfiguration& sw);

  // Before the successor is built: the gradients and activations of old chunks the successor
  // will not take over are not state, so they are freed. The allocator keeps their pages and
  // builds the successor's new buffers from them (tensor/allocator.h) instead of touching fresh
  // memory, which on a VM whose host backs memory lazily costs seconds per GiB
  // (bench/README.md, elastic).
  void release_unkept_buffers(const PlannedSwitch& ps, int new_rank);

  // A recovery from a checkpoint: the new world's members read their share of it (each only
  // what its rank holds) and continue from its step and data cursor.
  void restore_from_checkpoint(const elastic::Reconfiguration& sw, int new_rank,
                               int64_t store_generation, std::chrono::steady_clock::time_point t0);

  // After a peer failed (`what`): breaks this process's communicators (so every peer notices),
  // reports what state it holds to the coordinator, waits for the coordinator's decision and
  // carries it out (transition). Throws TimeoutError when no decision comes, and
  // CoordinatorLostError when the launcher serving the store is gone (nobody is left to decide).
  void recover(const std::string& what, const std::string& kind);
};

}  // namespace tessel::runtime
