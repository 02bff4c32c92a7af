#include "tessel/elastic/cluster_coordinator.h"

#include <csignal>

#include <fmt/format.h>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/elastic/reconfiguration.h"

namespace tessel::elastic {

ClusterCoordinator::ClusterCoordinator(config::TrainConfig cfg,
                                       std::shared_ptr<comm::ControlStore> store,
                                       std::string cluster, std::string job,
                                       CheckpointFinder newest_checkpoint)
    : cfg_(std::move(cfg)),
      store_(std::move(store)),
      cluster_(std::move(cluster)),
      job_(std::move(job)),
      newest_checkpoint_(std::move(newest_checkpoint)) {}

// A cluster's checkpoints are on its hosts' disks, committed in etcd: the newest committed is
// the one to resume from (this host's copy of its step directory; every host has one).
std::optional<checkpoint::ResumePoint> ClusterCoordinator::resume_point() {
  if (!newest_checkpoint_ || !cfg_.checkpoint.resume) return std::nullopt;
  const auto newest = newest_checkpoint_();
  if (!newest) return std::nullopt;
  return checkpoint::ResumePoint{newest->first, newest->second};
}

void ClusterCoordinator::use_cluster_checkpoints() {
  if (!newest_checkpoint_) return;
  decider_->set_checkpoint_finder([find = newest_checkpoint_]() -> std::optional<std::string> {
    if (const auto n = find()) return n->first;
    return std::nullopt;
  });
}

bool ClusterCoordinator::start_first_world(const std::vector<Host>& hosts) {
  const auto resume = resume_point();
  const int64_t step = resume ? resume->step : 0;
  const int wanted = cfg_.plan_at(step).world();
  int slots = 0;
  for (const auto& h : hosts) slots += h.slots;
  if (slots < wanted) {
    if (!waiting_logged_)
      spdlog::info("job {}: waiting for hosts: {} worker slots of the {} the plan needs", job_,
                   slots, wanted);
    waiting_logged_ = true;
    return false;
  }
  decider_ = std::make_unique<Decider>(cfg_, store_, job_, wanted, step, hosts);
  use_cluster_checkpoints();
  StartRecord start;
  start.plan = cfg_.plan_at(step);
  start.step = step;
  start.resume_from = resume ? resume->path : "";
  const auto starts = decider_->initial_starts();
  for (const auto& s : starts) {
    start.members.push_back(s.process);
    start.hosts.push_back(s.host);
  }
  store_->set(start_key(job_), start.to_json().dump());
  spdlog::info("job {}: starting {} workers ({}) on {} hosts{}", job_, wanted,
               start.plan.describe(), hosts.size(),
               resume ? fmt::format(", resuming from {}", resume->path) : "");
  place(starts);
  return true;
}

void ClusterCoordinator::place(const std::vector<Decider::Start>& starts) {
  for (const auto& s : starts)
    store_->set(
        placement_key(job_, s.process),
        Placement{s.process, s.host, s.generation, decider_->host_name(s.host)}.to_json().dump());
}

std::optional<JobEnd> ClusterCoordinator::finish(JobEnd end) {
  store_->set(done_key(job_), end.to_json().dump());
  if (end.exit_code == 0)
    spdlog::info("job {}: finished", job_);
  else
    spdlog::error("job {}: ended ({}): {}", job_, end.exit_code, end.reason);
  return end;
}

void ClusterCoordinator::take_over(const StartRecord& start, const std::vector<Host>& hosts) {
  Decider::History h;
  h.start_step = start.step;
  h.first_members = start.members;
  for (const auto& kv : store_->list(placement_prefix(job_))) {
    const auto p = Placement::from_json(nlohmann::json::parse(kv.value), kv.key);
    h.host_of[p.process] = p.host;
    h.host_names[p.host] = p.host_name;
  }
  for (const auto& kv : store_->list(fence_prefix(job_)))
    if (const int p = key_number(fence_prefix(job_), kv.key); p >= 0) fenced_.insert(p);
  decider_ = std::make_unique<Decider>(cfg_, store_, job_, h, hosts);
  use_cluster_checkpoints();
}

std::optional<JobEnd> ClusterCoordinator::tick() {
  if (auto done = store_->get(done_key(job_)))
    return JobEnd::from_json(nlohmann::json::parse(done->value), done->key);
  std::vector<Host> hosts;
  for (const auto& h : list_hosts(*store_, cluster_)) hosts.push_back({h.id, h.slots, h.name});
  try {
    if (!decider_) {
      // A job whose first world exists was being coordinated by an agent that is gone.
      if (auto kv = store_->get(start_key(job_)))
        take_over(StartRecord::from_json(nlohmann::json::parse(kv->value), kv->key), hosts);
      else if (!start_first_world(hosts))
        return std::nullopt;
    }
    // Exits first: a host's loss and its processes' exit reports (written by its agent once back)
    // are one event, and the decider counts each process out once.
    for (const auto& kv : store_->list(exits_prefix(job_))) {
      const int p = key_number(exits_prefix(job_), kv.key);
      if (p < 0 || !exits_seen_.insert(p).second) continue;
      const auto e = ExitReport::from_json(nlohmann::json::parse(kv.value), kv.key);
      if (!decider_->running(p)) continue;
      if (!decider_->on_exit(p, e.ok, e.signaled, e.how, e.crashed) && failure_.empty()) {
        failure_ = fmt::format("worker {} on host {} {}", p, e.host, e.how);
        decider_->stop(failure_);
      }
    }
    decider_->set_hosts(hosts, cfg_.grow_to_slots);
    if (auto stop = store_->get(stop_request_key(job_))) decider_->stop(stop->value);
    place(decider_->update());
    for (int p : decider_->take_fences())
      if (fenced_.insert(p).second) store_->set(fence_key(job_, p), "fenced");
  } catch (const Error& e) {
    // No recovery is possible (state lost without a checkpoint, survivors that never reported):
    // the agents stop whatever still runs.
    return finish({1, e.what()});
  }
  if (!decider_->idle()) return std::nullopt;
  if (!failure_.empty()) return finish({1, failure_});
  const std::string& stopped = decider_->stop_reason();
  if (!stopped.empty()) return finish({128 + SIGTERM, stopped});
  return finish({0, ""});
}

}  // namespace tessel::elastic
