// The coordinator's decision after workers died: which state to continue from, with which
// processes, in which plan.
//
// Input: the failure reports of every surviving process (elastic/reconfiguration.h: the state each
// holds -- plan, rank, step, and whether it is consistent) and the processes that died.
// Decision:
//  1. State. Valid reports are grouped by (step, generation) -- after a failure inside a step's
//     last reductions some ranks have committed the step and others not, and after one inside a
//     switch some hold the old plan and some the new. Newest step first, the first group whose
//     ranks together hold every element of the state (reshard::lost_state is empty) is the
//     source: the state moves live from those processes, the others' old ranks count as lost.
//     When no group covers the state (a ZeRO-1 optimizer shard or a tensor-parallel shard had
//     its only copy on a dead process), the whole job rolls back to `checkpoint` (the newest
//     published one): each new rank reads only its own share, and the record names what was lost
//     and how many steps were.
//  2. Processes. Every survivor stays (sources first, in old rank order, so most of them keep
//     their buffers where the new plan lays state out alike), plus, with replace_failed, one new
//     process per dead one. The plan is the planner's for that many workers (keeping the global
//     batch), at most max_workers (the slots of the hosts left); when no plan fits that count,
//     the largest count below it that has one, and the survivors beyond it leave.
#pragma once

#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

struct RecoveryInput {
  std::vector<FailureReport> reports;  // of the surviving processes
  std::vector<int> dead;               // processes that died
  std::string cause;                   // "worker 2 was killed by signal 9 (SIGKILL)"
  int64_t failures = 0;                // this failure's number (1, 2, ...)
  int generation = 0;                  // the generation to create
  int next_process_id = 0;             // the first id free for new processes
  bool replace_failed = false;
  int max_workers = std::numeric_limits<int>::max();  // what the hosts' slots hold
  std::optional<std::string> checkpoint;  // the newest published checkpoint (a step-N directory)
  // When `checkpoint` is unset: finds it, called only when the survivors do not hold the whole
  // state (verifying a checkpoint reads all of it; a recovery from replicas must not wait on that,
  // nor set aside checkpoints while the survivors may be publishing one).
  std::function<std::optional<std::string>()> find_checkpoint;
};

// The recovery's switch description (Reconfiguration with recovery set; `record` carries lost,
// steps_lost, dead and survivors). Throws Error naming the lost state and the fix (set
// checkpoint.every) when state was lost and there is no checkpoint, and ConfigError when no
// worker count from the survivors' down to 1 has a plan.
Reconfiguration decide_recovery(const config::TrainConfig& cfg, const RecoveryInput& in);

}  // namespace tessel::elastic
