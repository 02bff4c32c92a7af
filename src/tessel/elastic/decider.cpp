#include "tessel/elastic/decider.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/log.h"
#include "tessel/elastic/recovery.h"

namespace tessel::elastic {

namespace {

// What a failure's reports say caused it. One process's failure is met by others as its
// consequence: a peer that times out aborts its channels, and the peers blocked on it then fail
// with "peer lost" at once -- often reporting first. A timeout is where a failure was met first;
// a peer lost is most often a consequence, so it names the cause only when nothing else does.
const FailureReport* root_report(const std::vector<FailureReport>& reports) {
  const auto rank = [](const FailureReport& r) {
    if (r.kind == "timeout") return 0;
    if (r.kind == "peer lost") return 2;
    return 1;
  };
  const FailureReport* best = nullptr;
  for (const auto& r : reports)
    if (best == nullptr || rank(r) < rank(*best)) best = &r;
  return best;
}

}  // namespace

Decider::Decider(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store,
                 std::string job, int initial_workers, int64_t start_step, std::vector<Host> hosts)
    : cfg_(std::move(cfg)),
      store_(std::move(store)),
      job_(std::move(job)),
      hosts_(std::move(hosts)) {
  TESSEL_CHECK(!hosts_.empty(), ConfigError, "job {}: no host to run workers on", job_);
  TESSEL_CHECK(initial_workers <= capacity(), ConfigError,
               "job {}: {} workers do not fit the hosts' {} slots", job_, initial_workers,
               capacity());
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
  for (int p : members_) {
    host_of_[p] = free_host();
    running_.insert(p);
  }
  step_ = start_step;
  skip_timeline_through(start_step);
}

Decider::Decider(config::TrainConfig cfg, std::shared_ptr<comm::ControlStore> store,
                 std::string job, const History& history, std::vector<Host> hosts)
    : cfg_(std::move(cfg)), store_(std::move(store)), job_(std::move(job)) {
  // The job as the last record left it (the first world when there is none).
  std::optional<Reconfiguration> last;
  for (const auto& kv : store_->list(records_prefix(job_))) {
    const int g = record_generation(job_, kv.key);
    if (g < 0) continue;
    auto r = Reconfiguration::from_json(nlohmann::json::parse(kv.value), kv.key);
    if (!last || r.generation > last->generation) last = std::move(r);
  }
  const auto claimed = store_->get(generation_key(job_));
  TESSEL_CHECK(claimed.has_value(), CorruptDataError, "job {} has no {}: nothing to take over",
               job_, generation_key(job_));
  generation_ = last ? last->generation : 0;
  generation_revision_ = claimed->revision;
  if (claimed->value != std::to_string(generation_)) {
    // Claimed by the coordinator that died before it wrote the record: nobody saw it.
    const auto rev = store_->compare_and_set(generation_key(job_), claimed->revision,
                                             std::to_string(generation_));
    TESSEL_CHECK(rev.has_value(), ConfigError,
                 "job {}: {} changed while this coordinator took over; another one runs", job_,
                 generation_key(job_));
    generation_revision_ = *rev;
  }
  plan_ = last ? last->to : cfg_.plan_at(history.start_step);
  members_ = last ? last->to_members : history.first_members;
  step_ = last ? std::max(last->step, history.start_step) : history.start_step;
  next_process_id_ = last ? last->next_process_id : int(history.first_members.size());
  for (const auto& [p, h] : history.host_of) next_process_id_ = std::max(next_process_id_, p + 1);
  applied_request_ = requests_ = last ? last->applied_request : 0;
  failures_ = last ? last->failures : 0;
  accept_progress_from_ = !last ? 0 : last->recovery ? last->generation : last->generation - 1;
  if (auto kv = store_->get(progress_key(job_))) {
    const auto pr = Progress::from_json(nlohmann::json::parse(kv->value), kv->key);
    if (pr.generation >= accept_progress_from_) step_ = std::max(step_, pr.step);
    if (last && pr.generation < last->generation) {
      pending_ = last->generation;
      pending_request_ = last->request;
      if (!last->recovery) preparing_.insert(last->spawn.begin(), last->spawn.end());
    }
  }
  // The processes the job counts on: the last record's members and the ones it started, and
  // while it is pending the ones it moves state from. Every other process was counted out by an
  // earlier decision (it died, or left and exits by itself). An exit of one the job counts on may
  // not have been acted on before the coordinator was lost: such a process stays running here,
  // and its exit is handed to on_exit() again (the caller's next round).
  std::set<int> current(members_.begin(), members_.end());
  if (last) current.insert(last->spawn.begin(), last->spawn.end());
  if (last && pending_) current.insert(last->from_members.begin(), last->from_members.end());
  host_of_ = history.host_of;
  for (const auto& [p, h] : history.host_of)
    if (current.contains(p)) running_.insert(p);
  // Every host a running process is on, so that set_hosts() below finds the gone ones lost.
  for (const auto& [p, h] : history.host_of)
    if (running_.contains(p) &&
        std::none_of(hosts_.begin(), hosts_.end(), [&](const Host& x) { return x.id == h; }))
      hosts_.push_back(
          {h, 1,
           history.host_names.contains(h) ? history.host_names.at(h) : fmt::format("host {}", h)});
  for (const auto& kv : store_->list(alive_prefix(job_)))
    if (const int p = key_number(alive_prefix(job_), kv.key); p >= 0) heartbeats_.insert(p);
  skip_timeline_through(step_);
  if (last && last->timeline)
    while (next_timeline_ < cfg_.timeline.size() &&
           cfg_.timeline[next_timeline_].at_step <= last->at_step)
      ++next_timeline_;
  if (auto kv = store_->get(stop_key(job_))) {
    try {
      stop_reason_ = nlohmann::json::parse(kv->value).at("reason").get<std::string>();
    } catch (const std::exception&) {
      stop_reason_ = kv->value;
    }
  }
  // A failure announced but not yet decided: decided again, from the reports already written.
  if (auto kv = store_->get(failure_key(job_))) {
    const int64_t announced = comm::parse_counter(kv->key, kv->value);
    if (announced > failures_) {
      failures_ = announced - 1;
      start_recovery(
          fmt::format("failure {} (its coordinator was lost before deciding)", announced));
    }
  }
  spdlog::info("job {}: took over at generation {} ({} workers, step {}{})", job_, generation_,
               members_.size(), step_, pending_ ? ", a switch pending" : "");
  set_hosts(hosts, false);
}

std::vector<Decider::Start> Decider::initial_starts() const {
  std::vector<Start> out;
  for (int p : members_) out.push_back({p, 0, host_of(p)});
  return out;
}

int Decider::capacity() const {
  int64_t n = 0;
  for (const auto& h : hosts_) {
    if (h.slots <= 0) return std::numeric_limits<int>::max();
    n += h.slots;
  }
  return int(std::min<int64_t>(n, std::numeric_limits<int>::max()));
}

std::string Decider::where(int process) const {
  // Only where there is more than the one local host.
  const int h = host_of(process);
  for (const auto& x : hosts_)
    if (x.id == h) return x.slots > 0 ? fmt::format(" on host {} ({})", h, x.name) : "";
  return h >= 0 ? fmt::format(" on host {}", h) : "";
}

std::string Decider::host_name(int host) const {
  for (const auto& x : hosts_)
    if (x.id == host) return x.name;
  return fmt::format("host {}", host);
}

int Decider::host_of(int process) const {
  auto it = host_of_.find(process);
  return it == host_of_.end() ? -1 : it->second;
}

int Decider::free_host() const {
  // Fill hosts in order: consecutive ranks (a tensor-parallel group) share a host.
  for (const auto& h : hosts_) {
    if (h.slots <= 0) return h.id;
    int used = 0;
    for (int p : running_)
      if (host_of(p) == h.id) ++used;
    if (used < h.slots) return h.id;
  }
  TESSEL_THROW(ConfigError,
               "job {}: every host's slots are taken ({} in all); no place for one "
               "more worker",
               job_, capacity());
}

int Decider::workers_for_capacity() const {
  // Any larger count would not fit; the planner may lay out none of the counts near it.
  const int most = std::min(capacity(), std::max(cfg_.max_workers(), 1) * 64);
  for (int n = most; n >= 1; --n) {
    try {
      cfg_.plan_for_workers(n);
      return n;
    } catch (const ConfigError&) {
    }
  }
  return 0;
}

void Decider::set_hosts(const std::vector<Host>& hosts, bool grow) {
  std::set<int> listed;
  for (const auto& h : hosts) listed.insert(h.id);
  std::vector<Host> lost;
  for (const auto& h : hosts_)
    if (!listed.contains(h.id)) lost.push_back(h);
  for (const auto& h : lost) {
    std::vector<int> gone;
    for (int p : running_)
      if (host_of(p) == h.id) gone.push_back(p);
    spdlog::warn("host {} ({}) is lost with {} worker(s)", h.id, h.name, gone.size());
    for (int p : gone) on_exit(p, false, true, "was lost with its host");
  }
  hosts_ = hosts;  // after the deaths: their causes name the host
  if (!grow || !stop_reason_.empty()) return;
  const int target = workers_for_capacity();
  if (target > int(members_.size()) && target != grow_target_) {
    grow_target_ = target;
    spdlog::info("the hosts hold {} workers: {}", target, scale(target));
  }
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

bool Decider::on_exit(int process, bool ok, bool signaled, const std::string& how, bool crashed) {
  // Already counted out (lost with its host, whose agent reports the exit once back): its death
  // was recovered from then.
  if (!running_.contains(process)) return true;
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
      fenced != fenced_.end()
          ? fmt::format("worker {}{} {} and was fenced", process, where(process), fenced->second)
          : fmt::format("worker {}{} {}", process, where(process), how);
  if (recovery_)
    recovery_->cause += "; " + cause;
  else
    start_recovery(cause);
  recovery_->dead.insert(process);
  // A fenced process was stuck (a restore that hangs fails as surely as one that throws).
  if (signaled && !crashed && fenced == fenced_.end()) recovery_->killed = true;
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
  // Where each new process runs (placed before anything is written: a record that cannot be
  // placed is never published), and where every rank's process is: a transfer prefers sources
  // on the receiver's host.
  for (int p : r.spawn) {
    host_of_[p] = free_host();
    running_.insert(p);
  }
  r.from_hosts.clear();
  for (int p : r.from_members) r.from_hosts.push_back(std::max(host_of(p), 0));
  r.to_hosts.clear();
  for (int p : r.to_members) r.to_hosts.push_back(host_of(p));
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
    starts.push_back({p, r.generation, host_of(p)});
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
    auto reports = store_->list(reports_prefix(job_, failures_ + 1));
    // Only from processes of the job: one fenced or lost with its host (cut off, then back)
    // may report what it met long after its world was replaced.
    std::erase_if(reports, [&](const comm::KeyValue& kv) {
      return !running_.contains(key_number(reports_prefix(job_, failures_ + 1), kv.key));
    });
    std::vector<FailureReport> parsed;
    for (const auto& kv : reports) {
      try {
        parsed.push_back(FailureReport::from_json(nlohmann::json::parse(kv.value), kv.key));
      } catch (const std::exception& e) {
        spdlog::warn("ignoring {}: {}", kv.key, e.what());
      }
    }
    if (!reports.empty()) {
      const auto* root = root_report(parsed);
      const std::string error = root != nullptr ? root->error : "a failure";
      start_recovery(fmt::format("a worker met: {}", error));
      recovery_->reported = error;
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
  // Every report is in: the one that names the failure may have come after the first.
  if (const auto* root = root_report(reports);
      root != nullptr && !p.reported.empty() && root->error != p.reported) {
    if (auto at = p.cause.find(p.reported); at != std::string::npos)
      p.cause.replace(at, p.reported.size(), root->error);
    p.reported = root->error;
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
  in.max_workers = capacity();
  if (find_checkpoint_)
    in.find_checkpoint = find_checkpoint_;
  else if (!cfg_.checkpoint.dir.empty())
    in.find_checkpoint = [dir = cfg_.checkpoint.dir] {
      return checkpoint::newest_intact_checkpoint(dir);
    };
  auto m = decide_recovery(cfg_, in);
  const bool no_progress = !m.checkpoint.empty() && m.checkpoint == repeated_checkpoint_ &&
                           m.record.value("steps_lost", int64_t(0)) == 0;
  // A kill from outside during a restore is a new failure, not the restore failing: a job
  // preempted faster than it restores goes on while the kills do (the OOM killer's SIGKILL is
  // one of them, and is not told apart: a restore that runs out of memory every time repeats).
  if (!(no_progress && p.killed)) {
    repeated_restores_ = no_progress ? repeated_restores_ + 1 : (m.checkpoint.empty() ? 0 : 1);
    repeated_checkpoint_ = m.checkpoint;
  }
  TESSEL_CHECK(repeated_restores_ <= kMaxRepeatedRestores, Error,
               "{}: the job was restored from checkpoint {} {} times in a row and no worker got "
               "past it, so the restore itself fails (see the workers' logs: a checkpoint that "
               "cannot be read, or damaged on every host that holds it); stopping the job. Move "
               "that checkpoint aside (or repair it) and run the same command to resume from an "
               "older one",
               p.cause, m.checkpoint, kMaxRepeatedRestores);
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
