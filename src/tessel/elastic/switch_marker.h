// The files through which the workers of an elastic job and its coordinator (elastic/, inside
// `tessel train`) agree on membership. They live in the job's rendezvous directory; each is
// written whole (AtomicFileWriter) and never changed afterwards, so a reader sees it complete or
// not at all.
//
//  * <job>.switch-<g>.json (SwitchMarker): how the job enters generation g. Written by the
//    current rank 0 before a switch it decided (timeline, scale request), or by the coordinator
//    for a recovery from a failure. The coordinator starts the processes listed in `spawn`; they
//    read their part from it (TESSEL_JOIN_GENERATION=g).
//  * <job>.prepare-<g>.json (SwitchMarker): the same switch, announced ahead (elastic.
//    prepare_steps before a timeline entry): the coordinator starts the `spawn` processes at
//    once, they build their buffers while the job still trains, then wait for switch-<g> (go) or
//    for recovery-<failures + 1> (the switch is void: they leave).
//  * <job>.report-<e>-<p>.json (FailureReport): process p's account of itself after it met
//    failure number e (a peer it talks to died): what state it holds and at which step.
//  * <job>.recovery-<e>.json (a SwitchMarker with recovery set): the coordinator's decision for
//    failure e, once every surviving process reported; the survivors wait for it.
//  * <job>.request-<r>.json: scale request r (`tessel ctl scale N`), written by the coordinator.
//
// Processes and ranks. Every worker process has an id (TESSEL_RANK), fixed for its lifetime and
// never reused; the members of a plan are the process ids of its ranks 0..world-1, in order.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessel/core/json_file.h"
#include "tessel/layout/plan.h"

namespace tessel::elastic {

// Marks a rank of the old plan whose state is not used (its process died, or its state is not at
// the chosen step); the same value as reshard::TransferPlan::kLost.
inline constexpr int kLostProcess = -1;

struct SwitchMarker {
  int generation = 0;
  layout::Plan from, to;
  std::vector<int> from_members;  // process of each rank of `from` (kLostProcess: not a source)
  std::vector<int> to_members;    // process of each rank of `to`
  std::vector<int> spawn;         // processes the coordinator starts for this switch
  int next_process_id = 0;        // the id the next new process gets
  std::string cause;              // "timeline (workers)", "scale request", "worker 2 died: ..."
  int64_t request = 0;            // the scale request it applies (0: none)
  int64_t applied_request = 0;    // the newest scale request applied once it is done
  int64_t failures = 0;           // failures recovered from so far (this one included)
  // A recovery (written by the coordinator): the state continues from `step` / `cursor`, moved
  // live from the from_members' buffers, or -- `checkpoint` non-empty -- read from that
  // checkpoint (a step-N directory), in which case `from` and from_members are unused.
  bool recovery = false;
  std::string checkpoint;
  int64_t step = 0, cursor = 0;
  // Extra fields for the job's event line (detection_s, planning_s, steps_lost, lost, dead, ...).
  nlohmann::json record = nlohmann::json::object();

  nlohmann::json to_json() const;
  // Throws CorruptDataError naming `what` for a malformed document.
  static SwitchMarker from_json(const nlohmann::json& doc, const std::string& what);
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

  nlohmann::json to_json() const;
  static FailureReport from_json(const nlohmann::json& doc, const std::string& what);
};

// How long a recovery may take from the failure to the decision: survivors notice within the
// communication timeout and may first wait for a background save (bounded by the same), plus
// slack for starting and planning. Both sides use it: the coordinator for the reports, the
// survivors for the decision.
std::chrono::milliseconds recovery_deadline(double comm_timeout_s);

std::string switch_marker_path(const std::string& store_dir, const std::string& job, int g);
std::string prepare_marker_path(const std::string& store_dir, const std::string& job, int g);
std::string failure_report_path(const std::string& store_dir, const std::string& job,
                                int64_t failure, int process);
std::string recovery_path(const std::string& store_dir, const std::string& job, int64_t failure);
// <job>.request-<r>.json: scale request r, written by the coordinator (`tessel ctl scale N`):
// {"request", "workers", "plan"}; the workers apply the newest one at a step boundary.
std::string scale_request_path(const std::string& store_dir, const std::string& job, int64_t r);

}  // namespace tessel::elastic
