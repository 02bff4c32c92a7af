#include "tessel/elastic/decider.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/log.h"
#include "tessel/elastic/recovery.h"

namespace tessel::elastic {

Decider::Decider(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store,
                 std::string job, int initial_workers, int64_t start_step)
    : cfg_(std::move(cfg)), store_(std::move(store)), job_(std::move(job)) {
  const auto claimed = store_->compare_and_set(generation_key(job_), 0, "0");
  TESSEL_CHECK(claimed.has_value(), ConfigError,
               "job {} already has decisions in the control store ({} exists): another `tessel "
               "train` of this job runs, or an earlier one left them behind; give this job "
               "another id, or remove them (etcdctl del --prefix {})",
               job_, generation_key(job_), job_prefix(job_));
  generation_revision_ = *claimed;
  plan_ = cfg_.plan_at(start_step);
  members_ = first_members(initial_workers);
  next_process_id_ = initial_workers;
  running_ = {members_.begin(), members_.end()};
  step_ = start_step;
  skip_timeline_through(start_step);
}

void Decider::skip_timeline_through(int64_t step) {
  next_timeline_ = 0;
  while (next_timeline_ < cfg_.timeline.size() && cfg_.timeline[next_timeline_].at_step <= step)
    ++next_timeline_;
}

std::string Decider::scale(int workers) {
  if (workers < 1) return "refused: scale needs a worker count >= 1 (scale N)";
  layout::Plan plan;
  try {
    plan = cfg_.plan_for_workers(workers);
  } catch (const Error& e) {
    return fmt::format("refused: {}", e.what());
  }
  const int64_t r = ++requests_;
  queued_ = {r, plan};
  const std::string when =
      cfg_.prepare_steps > 0
          ? fmt::format("prepared from the next step boundary on, switched {} steps later",
                        cfg_.prepare_steps)
          : std::string("at the next step boundary");
  spdlog::info("scale request {}: {} workers ({}) {}", r, workers, plan.describe(), when);
  return fmt::format("ok: request {}: {} workers ({}) {}", r, workers, plan.describe(), when);
}

void Decider::stop(const std::string& reason) {
  if (!stop_reason_.empty()) return;
  stop_reason_ = reason;
  store_->set(stop_key(job_), nlohmann::json{{"reason", reason}}.dump());
  spdlog::warn("{}: the workers save a checkpoint at their next step boundary and stop", reason);
}

std::vector<int> Decider::take_fences() {
  return std::exchange(to_fence_, {});
}

void Decider::fence(int process, const std::string& why) {
  if (!running_.contains(process) || fenced_.contains(process)) return;
  fenced_[process] = why;
  to_fence_.push_back(process);
  spdlog::warn("worker {} {}; fencing it (SIGKILL)", process, why);
}

void Decider::check_heartbeats() {
  std::set<int> alive;
  for (const auto& kv : store_->list(alive_prefix(job_)))
    if (const int p = key_number(alive_prefix(job_), kv.key); p >= 0) alive.insert(p);
  for (int p : running_) {
    if (alive.contains(p))
      heartbeats_.insert(p);
    else if (heartbeats_.contains(p))
      fence(p, fmt::format("stopped answering: its heartbeat expired (not renewed within "
                           "elastic.heartbeat_timeout_s = {} s)",
                           cfg_.heartbeat_timeout_s));
  }
}

std::vector<Decider::Start> Decider::leave() {
  std::vector<int> leaving, staying;
  for (const auto& kv : store_->list(leaving_prefix(job_)))
    if (const int p = key_number(leaving_prefix(job_), kv.key); p >= 0 && !left_.contains(p))
      leaving.push_back(p);
  std::erase_if(leaving, [&](int p) {
    return std::find(members_.begin(), members_.end(), p) == members_.end();
  });
  if (leaving.empty()) return {};
  left_.insert(leaving.begin(), leaving.end());
  for (int p : members_)
    if (std::find(leaving.begin(), leaving.end(), p) == leaving.end()) staying.push_back(p);
  std::string who;
  for (int p : leaving) who += fmt::format("{}{}", who.empty() ? "" : ", ", p);
  const std::string cause = fmt::format("planned leave (worker {} received SIGTERM)", who);
  layout::Plan plan;
  try {
    TESSEL_CHECK(!staying.empty(), ConfigError, "no worker would be left");
    plan = cfg_.plan_for_workers(int(staying.size()));
  } catch (const Error& e) {
    stop(fmt::format("{}: no plan for the {} other workers ({})", cause, staying.size(), e.what()));
    return {};
  }
  auto r = switch_to(std::move(plan), cause, staying);
  r.at_step = 0;  // at the first boundary every member has seen it: a preemption does not wait
  spdlog::info("{}: switching to {} on {} workers", cause, r.to.describe(), r.to.world());
  return publish(std::move(r));
}

std::string Decider::status() const {
  return fmt::format("ok: job {}, {} workers, {} scale requests, {} switches, {} failures", job_,
                     members_.size(), requests_, generation_, failures_);
}

bool Decider::on_exit(int process, bool ok, bool signaled, const std::string& how) {
  running_.erase(process);
  preparing_.erase(process);
  if (ok) {
    if (recovery_) {
      recovery_->expected.erase(process);
      recovery_->someone_finished = true;
    }
    return true;
  }
  // Only a death by a signal is a lost worker; an error exit ends the job with its message --
  // unless the process was fenced (it leaves with an error when it finds out).
  if (!signaled && !fenced_.contains(process)) return false;
  auto fenced = fenced_.find(process);
  const std::string cause =
      fenced != fenced_.end() ? fmt::format("worker {} {} and was fenced", process, fenced->second)
                              : fmt::format("worker {} {}", process, how);
  if (recovery_)
    recovery_->cause += "; " + cause;
  else
    start_recovery(cause);
  recovery_->dead.insert(process);
  recovery_->expected = state_holders();
  return true;
}

std::set<int> Decider::state_holders() const {
  std::set<int> out;
  for (int p : running_)
    if (!preparing_.contains(p)) out.insert(p);
  return out;
}

void Decider::start_recovery(const std::string& cause) {
  ++failures_;
  // Not emplace(): clang 14 does not see the nested type as constructible here.
  recovery_ = Recovery{};
  recovery_->cause = cause;
  recovery_->detected = Clock::now();
  recovery_->deadline = recovery_->detected + recovery_deadline(cfg_.comm_timeout_s);
  recovery_->expected = state_holders();
  // Workers waiting on the store rather than on a peer (for a record, for the go) hear of it
  // here and report too.
  store_->set(failure_key(job_), std::to_string(failures_));
  spdlog::warn("{}: recovering (failure {})", cause, failures_);
}

Reconfiguration Decider::switch_to(layout::Plan to, const std::string& cause,
                                   const std::vector<int>& pool) const {
  const auto& from = pool.empty() ? members_ : pool;
  Reconfiguration r;
  r.generation = generation_ + 1;
  r.cause = cause;
  r.from = plan_;
  r.from_members = members_;
  r.to = std::move(to);
  const int n = r.to.world();
  int next = next_process_id_;
  r.to_members.assign(from.begin(), from.begin() + std::min<ptrdiff_t>(n, ptrdiff_t(from.size())));
  while (int(r.to_members.size()) < n) {
    r.to_members.push_back(next);
    r.spawn.push_back(next++);
  }
  r.next_process_id = next;
  r.applied_request = applied_request_;
  r.failures = failures_;
  r.step = step_;
  return r;
}

std::vector<Decider::Start> Decider::publish(Reconfiguration r) {
  TESSEL_CHECK(r.generation > generation_, InvalidArgumentError,
               "record of generation {} published after generation {}", r.generation, generation_);
  const auto rev = store_->compare_and_set(generation_key(job_), generation_revision_,
                                           std::to_string(r.generation));
  TESSEL_CHECK(rev.has_value(), ConfigError,
               "job {}: {} was changed by someone else (a second coordinator of this job, or a "
               "hand edit); stopping rather than letting two deciders split the job",
               job_, generation_key(job_));
  generation_revision_ = *rev;
  r.decided_at = unix_seconds();
  store_->set(record_key(job_, r.generation), r.to_json().dump());
  generation_ = r.generation;
  plan_ = r.to;
  members_ = r.to_members;
  next_process_id_ = std::max(next_process_id_, r.next_process_id);
  applied_request_ = std::max(applied_request_, r.applied_request);
  accept_progress_from_ = r.recovery ? r.generation : r.generation - 1;
  pending_ = r.generation;
  pending_request_ = r.request;
  std::vector<Start> starts;
  for (int p : r.spawn) {
    starts.push_back({p, r.generation});
    running_.insert(p);
    // Until the switch, a process started for it holds no state (a recovery's are state holders
    // at once: they join its transition).
    if (!r.recovery) preparing_.insert(p);
  }
  return starts;
}

std::vector<Decider::Start> Decider::update() {
  check_heartbeats();
  if (auto kv = store_->get(progress_key(job_))) {
    try {
      const auto p = Progress::from_json(nlohmann::json::parse(kv->value), kv->key);
      // Reports of a world a failure replaced say nothing about the one in force.
      if (p.generation >= accept_progress_from_) {
        step_ = p.step;
        if (pending_ && p.generation >= *pending_) {
          pending_.reset();
          preparing_.clear();
        }
      }
    } catch (const std::exception& e) {
      spdlog::warn("ignoring {}: {}", kv->key, e.what());
    }
  }
  if (!recovery_) {
    // A failure nobody died of (a collective timed out, a connection reset) is reported as the
    // next failure; it is recovered from the same way, with every process surviving.
    const auto reports = store_->list(reports_prefix(job_, failures_ + 1));
    if (!reports.empty()) {
      std::string error = "a failure";
      try {
        error = FailureReport::from_json(nlohmann::json::parse(reports.front().value),
                                         reports.front().key)
                    .error;
      } catch (const std::exception&) {
      }
      start_recovery(fmt::format("a worker met: {}", error));
    }
  }
  if (recovery_) return recover();
  if (pending_ || !stop_reason_.empty()) return {};
  if (auto starts = leave(); pending_) return starts;
  if (next_timeline_ < cfg_.timeline.size()) {
    const auto& e = cfg_.timeline[next_timeline_];
    // A step before the members need it (they prepare prepare_steps before the entry).
    const int64_t ahead = cfg_.prepare_steps + 1;
    if (e.at_step < cfg_.training.end_step() && step_ >= e.at_step - ahead) {
      auto r = switch_to(e.plan, e.workers > 0 ? "timeline (workers)" : "timeline (plan)");
      r.at_step = e.at_step;
      r.timeline = true;
      ++next_timeline_;
      return publish(std::move(r));
    }
  }
  if (queued_) {
    auto [request, plan] = std::move(*queued_);
    queued_.reset();
    applied_request_ = std::max(applied_request_, request);
    if (plan == plan_) return {};  // what the job runs already
    auto r = switch_to(std::move(plan), "scale request");
    r.request = request;
    r.applied_request = request;
    last_request_ = {request, r.to};
    return publish(std::move(r));
  }
  return {};
}

std::vector<Decider::Start> Decider::recover() {
  auto& p = *recovery_;
  std::map<int, FailureReport> reported;
  for (const auto& kv : store_->list(reports_prefix(job_, failures_))) {
    try {
      auto r = FailureReport::from_json(nlohmann::json::parse(kv.value), kv.key);
      reported.insert_or_assign(r.process, std::move(r));
    } catch (const std::exception& e) {
      spdlog::warn("ignoring {}: {}", kv.key, e.what());
    }
  }
  std::vector<FailureReport> reports;
  std::string missing;
  for (int process : p.expected) {
    auto it = reported.find(process);
    if (it == reported.end()) {
      missing += fmt::format("{}{}", missing.empty() ? "" : ", ", process);
      continue;
    }
    reports.push_back(it->second);
  }
  if (!missing.empty()) {
    // Every survivor meets the failure within the communication timeout (a collective with the
    // failed process times out, or fails at once when a peer gives up on it): one that has not
    // reported by then is stuck where no timeout reaches it, or stopped.
    const auto fence_at =
        p.detected + std::chrono::milliseconds(int64_t(cfg_.comm_timeout_s * 1000) + 5000);
    if (Clock::now() >= fence_at)
      for (int process : p.expected)
        if (!reported.contains(process))
          fence(process, fmt::format("did not report the failure its peers met within {} s",
                                     int64_t(cfg_.comm_timeout_s) + 5));
    TESSEL_CHECK(Clock::now() < p.deadline, TimeoutError,
                 "{}: workers {} did not report within {} s of it; stopping the job", p.cause,
                 missing, int64_t(cfg_.comm_timeout_s * 2) + 30);
    return {};
  }
  if (reports.empty() && p.someone_finished) {
    spdlog::info("{}: every other worker had finished the run; nothing to recover", p.cause);
    recovery_.reset();
    return {};
  }
  const auto t0 = Clock::now();
  RecoveryInput in;
  in.reports = std::move(reports);
  in.dead.assign(p.dead.begin(), p.dead.end());
  in.cause = p.cause;
  in.failures = failures_;
  // Above every generation published, a pending one included: some processes may have begun
  // its transition (registered under its rendezvous prefix), dead ones too.
  int g = generation_ + 1;
  for (const auto& r : in.reports) g = std::max(g, r.generation + 1);
  in.generation = g;
  in.next_process_id = next_process_id_;
  in.replace_failed = cfg_.replace_failed;
  if (!cfg_.checkpoint.dir.empty())
    in.find_checkpoint = [dir = cfg_.checkpoint.dir] {
      return checkpoint::newest_intact_checkpoint(dir);
    };
  auto m = decide_recovery(cfg_, in);
  m.record["detection_s"] = std::chrono::duration<double>(t0 - p.detected).count();
  m.record["planning_s_coordinator"] = std::chrono::duration<double>(Clock::now() - t0).count();
  spdlog::warn(
      "failure {}: continuing at step {} with {} workers ({}) {}{}", failures_, m.step,
      m.to.world(), m.to.describe(),
      m.checkpoint.empty() ? "from the survivors' state" : "from checkpoint " + m.checkpoint,
      m.record.contains("lost") ? " (lost: " + m.record["lost"].get<std::string>() + ")"
                                : std::string());
  recovery_.reset();
  // Processes started for a record the failure voided leave when they see this one.
  preparing_.clear();
  // A scale request whose record the failure voided is made again, unless a newer one waits.
  if (last_request_ && last_request_->first > m.applied_request && !queued_)
    queued_ = last_request_;
  step_ = m.step;
  skip_timeline_through(m.step);
  // A leave the failure voided is decided again from the new members.
  for (int process : m.to_members) left_.erase(process);
  return publish(std::move(m));
}

}  // namespace tessel::elastic
