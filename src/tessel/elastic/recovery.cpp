#include "tessel/elastic/recovery.h"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

#include "tessel/core/check.h"
#include "tessel/layout/state_layout.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::elastic {

Reconfiguration decide_recovery(const config::TrainConfig& cfg, const RecoveryInput& in) {
  Reconfiguration m;
  m.recovery = true;
  m.generation = in.generation;
  m.failures = in.failures;
  m.cause = in.cause;
  m.next_process_id = in.next_process_id;
  for (const auto& r : in.reports)
    m.applied_request = std::max(m.applied_request, r.applied_request);

  // 1. The state: the newest (step, generation) whose valid ranks hold all of it.
  std::map<std::pair<int64_t, int>, std::vector<const FailureReport*>, std::greater<>> groups;
  int64_t newest_step = 0;
  for (const auto& r : in.reports) {
    if (!r.valid || r.rank < 0) continue;
    groups[{r.step, r.generation}].push_back(&r);
    newest_step = std::max(newest_step, r.step);
  }
  const std::vector<const FailureReport*>* source = nullptr;
  std::string lost;
  for (const auto& [key, members] : groups) {
    const auto layout = layout::StateLayout::build(cfg.model, members.front()->plan);
    std::vector<bool> available(size_t(layout.world()), false);
    for (const auto* r : members) available[size_t(r->rank)] = true;
    const auto missing = reshard::lost_state(layout, available);
    if (missing.empty()) {
      source = &members;
      break;
    }
    if (lost.empty())
      lost = fmt::format("{} at step {}: {}", members.front()->plan.describe(), key.first,
                         reshard::describe(missing, layout));
  }
  if (groups.empty()) lost = "no surviving process holds a consistent copy of its state";

  // 2. The processes: sources first in old rank order, then the other survivors.
  std::vector<int> survivors;
  if (source != nullptr) {
    std::vector<const FailureReport*> by_rank = *source;
    std::sort(by_rank.begin(), by_rank.end(),
              [](const auto* a, const auto* b) { return a->rank < b->rank; });
    for (const auto* r : by_rank) survivors.push_back(r->process);
  }
  std::vector<int> others;
  for (const auto& r : in.reports)
    if (std::find(survivors.begin(), survivors.end(), r.process) == survivors.end())
      others.push_back(r.process);
  std::sort(others.begin(), others.end());
  survivors.insert(survivors.end(), others.begin(), others.end());

  TESSEL_CHECK(!survivors.empty() || in.replace_failed, Error,
               "{}: no worker survived; run the job again (it resumes from its newest "
               "checkpoint), or set elastic.replace_failed so new workers take the dead ones' "
               "places",
               in.cause);
  const int wanted = std::min(int(survivors.size()) + (in.replace_failed ? int(in.dead.size()) : 0),
                              in.max_workers);
  std::string why_not;
  int workers = wanted;
  // Survivors that keep their micro-batch size keep their activations (no fresh memory touched
  // in the pause), where the planner sees no cost in it.
  const int micro_batch = source != nullptr ? int(source->front()->plan.micro_batch) : 0;
  for (; workers >= 1; --workers) {
    try {
      m.to = cfg.plan_for_workers(workers, micro_batch);
      break;
    } catch (const ConfigError& e) {
      if (why_not.empty()) why_not = e.what();
    }
  }
  TESSEL_CHECK(workers >= 1, ConfigError, "after {}: no plan fits {} or fewer workers: {}",
               in.cause, wanted, why_not);
  m.to_members.assign(
      survivors.begin(),
      survivors.begin() + std::min<ptrdiff_t>(workers, ptrdiff_t(survivors.size())));
  while (int(m.to_members.size()) < workers) {
    m.to_members.push_back(m.next_process_id);
    m.spawn.push_back(m.next_process_id++);
  }

  nlohmann::json dead = in.dead;
  m.record = {{"dead", dead},
              {"survivors", survivors.size()},
              {"old_workers", survivors.size() + in.dead.size()}};
  if (source != nullptr) {
    const FailureReport& any = *source->front();
    m.from = any.plan;
    m.from_members.assign(size_t(any.plan.world()), kLostProcess);
    for (const auto* r : *source) m.from_members[size_t(r->rank)] = r->process;
    m.step = any.step;
    m.cursor = any.cursor;
    m.record["steps_lost"] = newest_step - m.step;
    return m;
  }

  const auto checkpoint =
      in.checkpoint ? in.checkpoint
                    : (in.find_checkpoint ? in.find_checkpoint() : std::optional<std::string>());
  TESSEL_CHECK(checkpoint.has_value(), Error,
               "{}; state has no surviving copy ({}) and there is no checkpoint to restore it "
               "from: set checkpoint.dir and checkpoint.every in the config so a job can survive "
               "losing the only copy of some state",
               in.cause, lost);
  // Only its meta is read here: a cluster's host holds some of its rank files (the workers read
  // the rest from other hosts, elastic/cluster_checkpoints.h), and the workers verify what they
  // read.
  store::CheckpointReaderOptions partial;
  partial.allow_missing_files = true;
  store::CheckpointReader reader(*checkpoint, partial);
  m.checkpoint = *checkpoint;
  // Every rank reads from the checkpoint; `from` only names the plan that failed (the newest
  // any survivor held) for the event line.
  m.from = m.to;
  int newest_generation = -1;
  for (const auto& r : in.reports)
    if (r.generation > newest_generation) {
      newest_generation = r.generation;
      m.from = r.plan;
    }
  m.step = reader.meta().at("step").get<int64_t>();
  m.cursor = reader.meta().at("cursor").get<int64_t>();
  m.record["lost"] = lost;
  m.record["steps_lost"] = std::max<int64_t>(0, newest_step - m.step);
  return m;
}

}  // namespace tessel::elastic
