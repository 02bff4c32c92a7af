// The records through which the coordinator of an elastic job (elastic/coordinator.h) and its
// workers agree on membership, and where they live in the job's control store
// (comm/control_store.h). Who writes what:
//
//  * The coordinator alone decides. For every cause -- a timeline entry, `tessel ctl scale`, a
//    hosts file change, a worker's death, a failure a worker reports -- it picks the plan, the
//    members and their ranks, the processes to start and the generation, and publishes one
//    Reconfiguration under decisions/records/<g>, after moving decisions/generation from g-1 to g
//    with compare-and-set (a second writer is refused, never interleaved). It writes
//    decisions/failure (the failure it is recovering from) so that workers waiting on the store
//    instead of a peer hear of it, and decisions/stop when the job is to save and end.
//  * Workers only report: rank 0 of the world in force writes reports/progress (its generation,
//    the step it finished and, as a switch begins, the generation it enters: the go for the
//    processes started for that switch), and every process that met a failure writes
//    reports/failures/<e>/<process> (FailureReport). Every process keeps reports/alive/<process>
//    alive on a lease (its heartbeat), and one that received SIGTERM writes
//    reports/leaving/<process>. Workers apply a record and never write one.
//
// Order of a reconfiguration g (not a recovery). The coordinator publishes record g (from = the
// plan of g-1, to, members, spawn, at_step) and starts the processes in `spawn`; they build their
// buffers and wait for the go. The members of g-1 agree at a step boundary that every one of them
// has seen record g (one all-gather per step, which they already make) and switch at at_step, or
// -- at_step < 0, a scale request -- at that boundary, or elastic.prepare_steps later with the
// new buffers built meanwhile. Rank 0 writes the go, all processes of both plans join generation
// g's transition world and the state moves (runtime/elastic_worker.h).
//
// Fencing. A process applies only the record one generation above its own (it names its base in
// `from`), so a record of an older generation, one published twice or one edited by hand to an
// old number is ignored; a recovery record supersedes every record it does not descend from.
//
// Processes and ranks. Every worker process has an id (TESSEL_RANK), fixed for its lifetime and
// never reused; the members of a plan are the process ids of its ranks 0..world-1, in order.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessel/layout/plan.h"

namespace tessel::elastic {

// Marks a rank of the old plan whose state is not used (its process died, or its state is not at
// the chosen step); the same value as reshard::TransferPlan::kLost.
inline constexpr int kLostProcess = -1;

struct Reconfiguration {
  int generation = 0;
  layout::Plan from, to;
  std::vector<int> from_members;  // process of each rank of `from` (kLostProcess: not a source)
  std::vector<int> to_members;    // process of each rank of `to`
  // The host of each rank's process (ids the coordinator gives hosts; all 0 on one host): a
  // transfer prefers sources on the receiver's host. Empty: every process on one host.
  std::vector<int> from_hosts, to_hosts;
  std::vector<int> spawn;       // processes the coordinator starts for this switch
  int next_process_id = 0;      // the id the next new process gets
  std::string cause;            // "timeline (workers)", "scale request", "worker 2 died: ..."
  int64_t request = 0;          // the scale request it applies (0: none)
  int64_t applied_request = 0;  // the newest scale request applied once it is done
  int64_t failures = 0;         // failures recovered from so far (this one included)
  // When the switch happens: after step at_step (a timeline entry; 0 for a planned leave: at the
  // first boundary where every member has seen it, never prepared), or -- negative -- at the first
  // step boundary where every member has seen the record (then prepared over
  // elastic.prepare_steps more steps when they fit before the run's end and the next timeline
  // entry). Workers fill `step` with the step they switch at.
  int64_t at_step = -1;
  bool timeline = false;  // carries the timeline entry at at_step
  double decided_at = 0;  // when the coordinator published it (Unix time, seconds)
  // A recovery: the state continues from `step` / `cursor`, moved live from the from_members'
  // buffers, or -- `checkpoint` non-empty -- read from that checkpoint (a step-N directory), in
  // which case `from` and from_members are unused.
  bool recovery = false;
  std::string checkpoint;
  int64_t step = 0, cursor = 0;
  // Extra fields for the job's event line (detection_s, planning_s, steps_lost, lost, dead, ...).
  nlohmann::json record = nlohmann::json::object();

  nlohmann::json to_json() const;
  // Throws CorruptDataError naming `what` for a malformed document.
  static Reconfiguration from_json(const nlohmann::json& doc, const std::string& what);
};

struct FailureReport {
  int process = 0;
  bool valid = false;  // holds a consistent copy of its rank's state at `step`
  int generation = 0;  // of the world whose state it holds
  layout::Plan plan;   // that world's plan
  std::vector<int> members;
  int rank = -1;  // its rank there (-1: none)
  int64_t step = 0, cursor = 0;
  int64_t applied_request = 0;
  std::string error;  // what it met
  std::string kind;   // its Error::kind() ("timeout", "peer lost", ...; empty in older reports)

  nlohmann::json to_json() const;
  static FailureReport from_json(const nlohmann::json& doc, const std::string& what);
};

// What rank 0 of the world in force reports after every step, and as a switch begins.
struct Progress {
  int generation = 0;
  int64_t step = 0;
  int entering = 0;  // > generation: the switch to this generation has begun (the go)

  nlohmann::json to_json() const;
  static Progress from_json(const nlohmann::json& doc, const std::string& what);
};

// The members of a job's first world of n processes: processes 0..n-1 as ranks 0..n-1.
std::vector<int> first_members(int n);

// How long a recovery may take from the failure to the decision: survivors notice within the
// communication timeout and may first wait for a background save (bounded by the same), plus
// slack for starting and planning. Both sides use it: the coordinator for the reports, the
// survivors for the decision.
std::chrono::milliseconds recovery_deadline(double comm_timeout_s);

// The job's keys in the control store (all under job_prefix).
std::string job_prefix(const std::string& job);         // "/tessel/<job>/"
std::string generation_key(const std::string& job);     // decisions/generation
std::string records_prefix(const std::string& job);     // decisions/records/
std::string record_key(const std::string& job, int g);  // decisions/records/<g, 8 digits>
std::string failure_key(const std::string& job);        // decisions/failure
std::string progress_key(const std::string& job);       // reports/progress
std::string reports_prefix(const std::string& job, int64_t failure);  // reports/failures/<e>/
std::string report_key(const std::string& job, int64_t failure, int process);
// reports/alive/<process>: on the process's heartbeat lease (heartbeat.h); gone when it stalls.
std::string alive_prefix(const std::string& job);
std::string alive_key(const std::string& job, int process);
// reports/leaving/<process>: the process received SIGTERM and asks to be switched out.
std::string leaving_prefix(const std::string& job);
std::string leaving_key(const std::string& job, int process);
// reports/prepared/<g>/<process>: a process started for the switch to generation g has built its
// buffers (a scale-up waits a few boundaries for them rather than pausing for the build).
std::string prepared_prefix(const std::string& job, int generation);
std::string prepared_key(const std::string& job, int generation, int process);
// decisions/stop: the job stops (its reason as the value): every world saves at its next step
// boundary and its processes exit.
std::string stop_key(const std::string& job);
// The number ending `key` under `prefix` (a process id, a generation), or -1 when the key is not
// prefix + up to 9 digits.
int key_number(const std::string& prefix, const std::string& key);
// The record's generation when `key` is a record key of the job, else -1.
int record_generation(const std::string& job, const std::string& key);
// (generation, process) of a prepared report key of the job (prepared_key); nullopt for a key
// elsewhere, and (-1, -1) for a key under reports/prepared/ that is not one (a hand edit).
std::optional<std::pair<int, int>> prepared_report(const std::string& job, const std::string& key);

}  // namespace tessel::elastic
