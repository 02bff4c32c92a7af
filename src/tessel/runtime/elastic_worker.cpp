#include "tessel/runtime/elastic_worker.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "tessel/checkpoint/model_weights.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/json_file.h"
#include "tessel/core/log.h"
#include "tessel/core/stop_signal.h"
#include "tessel/reshard/executor.h"
#include "tessel/runtime/host_settings.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {

using checkpoint::check_resumable;
using checkpoint::load_rank_state;
using config::PlanSwitch;
using elastic::FailureReport;
using elastic::Reconfiguration;
using elastic::RecordFeed;
using elastic::recovery_deadline;

namespace {

int index_of(const std::vector<int>& v, int x) {
  auto it = std::find(v.begin(), v.end(), x);
  return it == v.end() ? -1 : int(it - v.begin());
}

}  // namespace

PlannedSwitch::Kept PlannedSwitch::kept_chunks(int old_rank, int new_rank) const {
  Kept kept{std::vector<bool>(size_t(from->plan().virtual_stages), false),
            std::vector<bool>(size_t(to->plan().virtual_stages), false)};
  if (new_rank < 0) return kept;
  for (int c = 0; c < to->plan().virtual_stages; ++c) {
    const int b =
        transfer.kept_from(new_rank, to->buffer_id(new_rank, c, layout::StateKind::param));
    if (b < 0) continue;
    kept.new_chunks[size_t(c)] = true;
    if (old_rank >= 0) kept.old_chunks[size_t(from->buffers(old_rank)[size_t(b)].chunk)] = true;
  }
  return kept;
}

bool PlannedSwitch::is_for(const Reconfiguration& sw) const {
  return from->plan() == sw.from && to->plan() == sw.to && from_members == sw.from_members &&
         to_members == sw.to_members;
}

ElasticWorker::ElasticWorker(config::TrainConfig c, const WorkerEnv& e)
    : cfg(std::move(c)), env(e) {
  apply_host_settings(cfg.training);
  // Workers of a timeline or of scale requests are started as the plans need them, so the
  // world size in the environment is only checked against a fixed run.
  cfg.validate_for_workers(cfg.timeline.empty() && !elastic() ? env.world_size : cfg.max_workers());
  TESSEL_CHECK(elastic() || cfg.timeline.empty(), ConfigError,
               "the config's timeline switches plans while training, which needs the coordinator "
               "of `tessel train CONFIG` (this worker was started by a fixed launch)");
  plan = cfg.plan;
  if (elastic()) {
    control = env.open_control_store(std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000)));
    if (!env.cluster.empty() && !cfg.checkpoint.dir.empty()) {
      // Each host keeps its share on its own disk (elastic/cluster_checkpoints.h).
      elastic::ClusterCheckpointsConfig cc;
      cc.cluster = env.cluster;
      cc.job = env.job_id;
      cc.checkpoint_dir = cfg.checkpoint.dir;
      cc.root = env.checkpoint_root.empty() ? cfg.checkpoint.dir : env.checkpoint_root;
      cc.keep = cfg.checkpoint.keep;
      cc.copies = cfg.checkpoint.copies;
      cc.secret = env.secret;
      cc.timeout = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000));
      cfg.checkpoint.dir = cc.root;
      env.cluster_saves = std::make_shared<elastic::ClusterSaves>(control, cc, env.host_id);
    }
    feed = std::make_unique<RecordFeed>(control, env.job_id);
    env.signals = std::make_shared<GenerationSignals>();
    feed->on_failure([signals = env.signals](int64_t e) { signals->announce(e); });
    progress = std::make_unique<elastic::Reporter>(control, elastic::progress_key(env.job_id));
    // A client of its own, whose calls end within half the lease: one hanging on a cut link for
    // the whole communication timeout would outlive the lease it renews.
    const auto ttl = std::chrono::milliseconds(int64_t(cfg.heartbeat_timeout_s * 1000));
    heartbeat = std::make_unique<elastic::Heartbeat>(env.open_control_store(ttl / 2),
                                                     elastic::alive_key(env.job_id, env.rank), ttl);
  }
  if (env.launcher) env.launcher->on_notice([this] { on_launcher_loss(); });
  try {
    join_job();
  } catch (...) {
    // No destructor runs for a constructor that throws: the callback must not outlive `this`.
    if (env.launcher) env.launcher->on_notice(nullptr);
    throw;
  }
}

ElasticWorker::~ElasticWorker() {
  if (env.launcher) env.launcher->on_notice(nullptr);
}

void ElasticWorker::on_launcher_loss() noexcept {
  // What this process knew when the launcher died: a heartbeat lost by then expired at a live
  // store (this process was fenced); one lost later only failed against the dead store.
  fenced_before_launcher_loss = heartbeat != nullptr && heartbeat->lost();
  if (!env.signals || !feed) return;
  // A switch or recovery in progress cannot be finished without the store (its rendezvous, or a
  // handshake with a peer that left instead, would wait up to parallel.timeout_s and more): the
  // signals of every generation past the world in force, up to the newest record, fire, so it
  // fails at once and this process leaves. The world in force is left alone: it saves.
  try {
    const int in_force = generation_in_force;
    int newest = in_force;
    for (const auto& [g, r] : feed->view().records) newest = std::max(newest, g);
    for (int g = in_force + 1; g <= newest; ++g)
      env.signals->of(env.generation + g)->abort(launcher_gone_message());
  } catch (const std::exception& e) {
    // Only an allocation can fail here; the watchdog still bounds the process.
    spdlog::warn("process {}: could not abort the switches in progress: {}", env.rank, e.what());
  }
}

std::string ElasticWorker::launcher_gone_message() const {
  return fmt::format("the coordinator (tessel train, pid {}) is gone",
                     env.launcher ? env.launcher->pid() : 0);
}

void ElasticWorker::leave_without_saving(const std::string& why) const {
  const std::string held = world != nullptr
                               ? fmt::format("its state after step {} is not saved", world->step)
                               : std::string("it holds no state");
  std::string resume;
  if (cfg.checkpoint.dir.empty()) {
    resume = "without checkpoint.dir nothing was saved";
  } else {
    std::optional<std::string> latest;
    try {
      latest = checkpoint::latest_sharded_checkpoint(cfg.checkpoint.dir);
    } catch (const std::exception&) {
      // Named as none: `tessel train` decides what it resumes from when it starts again.
    }
    resume = latest ? fmt::format("run the same command to resume from {}", *latest)
                    : std::string("no checkpoint was saved yet");
  }
  throw CoordinatorLostError(fmt::format("process {}: {} and {}: {}; {}", env.rank,
                                         launcher_gone_message(), why, held, resume));
}

void ElasticWorker::join_job() {
  const int64_t join = env.join_generation;
  if (join > 0) {
    TESSEL_CHECK(feed != nullptr, ConfigError,
                 "TESSEL_JOIN_GENERATION={} needs the job's control store (TESSEL_CONTROL_STORE)",
                 join);
    // Started for the switch to generation `join`: take part in it as a receiver only. Its
    // record was published before this process was started.
    std::optional<Reconfiguration> record;
    try {
      record = wait_for_record(int(join), "the switch this process was started for");
    } catch (const CoordinatorLostError&) {
      // Nothing to save: this process has no rank yet. run() ends at once (no world, no switch).
      spdlog::warn(
          "process {}: {} before the switch to generation {} it was started for: it "
          "holds no state; leaving",
          env.rank, launcher_gone_message(), join);
      return;
    }
    auto m = std::move(*record);
    TESSEL_CHECK(index_of(m.to_members, env.rank) >= 0, ConfigError,
                 "TESSEL_JOIN_GENERATION={}: process {} has no place in {}", join, env.rank,
                 m.to.describe());
    generation = int(join) - 1;
    generation_in_force = generation;
    plan = m.from;
    members = m.from_members;
    failures = m.failures;
    env.signals->acknowledge(failures);
    applied_request = m.applied_request;
    skip_timeline_through(m.recovery ? m.step : m.step - 1);
    joining = std::move(m);
    return;
  }
  if (resume()) return;
  TESSEL_CHECK(env.rank < plan.world(), ConfigError,
               "worker rank {} has no place in {}: `tessel train` starts workers as the plans "
               "need them",
               env.rank, plan.describe());
  members = elastic::first_members(plan.world());
  const bool fine_tune = !cfg.init_from.empty();
  world = std::make_unique<RankTrainer>(cfg, env, plan, env.rank, env.generation, !fine_tune);
  if (fine_tune) {
    // Weights only: the optimizer, data cursor and schedule start afresh.
    const auto weights = checkpoint::ModelWeights::open(cfg.init_from);
    checkpoint::load_rank_weights(*weights, world->layout(), env.rank, world->state_buffers());
    if (env.rank == 0) spdlog::info("initialised from {}", weights->describe());
  }
  entered = true;  // a switch may be due before the first step (one prepared from step 0)
}

void ElasticWorker::skip_timeline_through(int64_t step) {
  while (next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= step)
    ++next_static;
}

ElasticWorker::OpenedCheckpoint ElasticWorker::open_checkpoint(const std::string& path) const {
  OpenedCheckpoint o;
  if (env.cluster_saves) {
    // Records name the checkpoint as the coordinator's host has it: each host has its own copy
    // of the step directory.
    auto c = env.cluster_saves->open(std::filesystem::path(path).filename().string());
    o.reader = std::move(c.reader);
    o.fetch = std::move(c.fetch);
    o.remote_files = std::move(c.remote_files);
  } else {
    o.reader = std::make_unique<store::CheckpointReader>(path);
  }
  return o;
}

bool ElasticWorker::resume() {
  std::optional<std::string> path;
  if (!env.resume_from) {
    // A worker of a fixed launch, told nothing: the checkpoint `latest` names. (`tessel train`
    // decides once, verifying it, and tells every worker: several of them checking and setting
    // aside damaged checkpoints at once would race.)
    if (cfg.checkpoint.resume && !cfg.checkpoint.dir.empty())
      path = checkpoint::latest_sharded_checkpoint(cfg.checkpoint.dir);
  } else if (!env.resume_from->empty()) {
    path = *env.resume_from;
  }
  if (!path) return false;
  const auto opened = open_checkpoint(*path);
  const auto& reader = *opened.reader;
  const auto& meta = reader.meta();
  check_resumable(cfg, meta, *path);
  const int64_t step = meta.at("step").get<int64_t>();
  plan = cfg.plan_at(step);
  skip_timeline_through(step);
  TESSEL_CHECK(env.rank < plan.world(), ConfigError,
               "worker rank {} has no place in {}, the plan at step {}", env.rank, plan.describe(),
               step);
  members = elastic::first_members(plan.world());
  world = std::make_unique<RankTrainer>(cfg, env, plan, env.rank, env.generation, false);
  load_rank_state(reader, world->layout(), env.rank, world->state_buffers(), opened.fetch);
  world->step = step;
  world->cursor = meta.at("cursor").get<int64_t>();
  entered = true;
  if (env.rank == 0)
    spdlog::info("resumed from {} at step {} (saved under {}, continuing under {})", *path, step,
                 layout::plan_from_json(meta.at("plan")).describe(), world->plan.describe());
  return true;
}

void ElasticWorker::report_progress(int entering) {
  if (progress && world && world->rank == 0)
    progress->post(elastic::Progress{generation, world->step, entering}.to_json().dump());
}

Reconfiguration ElasticWorker::wait_for_record(int g, const std::string& why) {
  const auto limit = recovery_deadline(cfg.comm_timeout_s);
  const int64_t known_failures = failures;
  bool failed = false, lost = false;
  // The launcher's death is looked at whenever the feed wakes: with the store gone, it wakes at
  // every failed retry (within a second).
  const bool got = feed->wait_until(
      [&](const RecordFeed::View& v) {
        failed = v.failure > known_failures;
        lost = launcher_gone();
        return v.record(g) != nullptr || failed || lost;
      },
      RecordFeed::Clock::now() + limit);
  if (auto r = feed->record(g)) return std::move(*r);
  if (lost) leave_without_saving(fmt::format("no record of generation {} ({}) came", g, why));
  TESSEL_CHECK(!failed, PeerLostError,
               "process {}: the coordinator is recovering from failure {} (waiting for {})",
               env.rank, known_failures + 1, why);
  TESSEL_CHECK(got, TimeoutError,
               "process {}: the coordinator published no record of generation {} ({}) within {} "
               "s; is `tessel train` still running?",
               env.rank, g, why, limit.count() / 1000);
  TESSEL_THROW(TimeoutError, "process {}: no record of generation {} ({})", env.rank, g, why);
}

std::optional<Reconfiguration> ElasticWorker::next_switch() {
  boundary_at = unix_seconds();
  boundary_steady = std::chrono::steady_clock::now();
  report_progress();
  const int64_t b = world->step;
  // Whether the launcher that served the control store is gone, read once: everything below
  // decides on the same answer, and the ranks agree on it in the all-gather.
  const bool gone = launcher_gone();
  // A heartbeat lost at a live store is a fencing. Once the store died with the launcher,
  // renewals fail for that reason alone -- unless the heartbeat had been lost before.
  if (heartbeat && heartbeat->lost() && (!gone || fenced_before_launcher_loss)) {
    // Taken for stalled (SIGSTOP, a frozen VM) and fenced: the job went on without this process,
    // whose state is stale. It must not send it or write a checkpoint.
    fatal = true;
    TESSEL_THROW(PeerLostError,
                 "process {}: fenced after its heartbeat expired (stalled for more than "
                 "elastic.heartbeat_timeout_s); leaving without sending state",
                 env.rank);
  }
  if (gone && heartbeat) {
    // Nobody is left to renew it for: renewals against the dead store would only log failures
    // and, a ttl later, a misleading "fenced".
    heartbeat.reset();
  }
  // A planned leave needs the coordinator; with it gone, the stop below covers the request.
  if (feed && !gone && stop_requested() != 0 && !leave_requested) {
    leave_requested = true;
    control->set(elastic::leaving_key(env.job_id, env.rank), nlohmann::json{{"step", b}}.dump());
    spdlog::warn(
        "process {} received a stop signal after step {}: asking the coordinator to "
        "switch it out",
        env.rank, b);
  }
  if (feed) {
    const int64_t failure = feed->failure();
    TESSEL_CHECK(failure <= failures, PeerLostError,
                 "process {}: the coordinator is recovering from failure {}", env.rank, failure);
  }
  // The record after this world's generation (a recovery's record is not: it is waited for by
  // those who report), if this process has it, and whether to stop; the ranks agree on whether
  // any of them has seen either.
  const int g = generation + 1;
  const auto next = feed ? feed->record(g) : std::nullopt;
  const bool stop = feed ? !feed->stop().empty() : stop_requested() != 0;
  // The third value: this rank noticed the launcher's death. The ranks notice it at different
  // moments; the one that noticed first takes everyone along at this boundary.
  int64_t mine[3] = {next && !next->recovery ? g : 0, stop ? 1 : 0, gone ? 1 : 0};
  std::vector<int64_t> all(3 * size_t(world->groups.world->size()));
  world->groups.world->all_gather(mine, 3, all.data());
  int64_t seen = 0;
  for (size_t i = 0; i < all.size(); i += 3) {
    seen = std::max(seen, all[i]);
    stopping = stopping || all[i + 1] != 0;
    orphaned = orphaned || all[i + 2] != 0;
  }
  stopping = stopping || orphaned;
  if (stopping || !feed) return std::nullopt;
  // A timeline entry's record is due elastic.prepare_steps before its step (at it when nothing
  // is prepared), so that every rank starts preparing at the same boundary; the coordinator
  // publishes it a step before that, so this waits only when the coordinator was slower than a
  // step (or a scale request's switch came just before).
  bool timeline_due = false;
  if (next_static < cfg.timeline.size() && b < cfg.training.end_step()) {
    const int64_t at = cfg.timeline[next_static].at_step;
    const bool prepared = preparing && preparing->sw.generation == g;
    timeline_due = at >= b && at - b <= cfg.prepare_steps && !prepared;
  }
  if (seen == 0 && !timeline_due) return std::nullopt;
  std::optional<Reconfiguration> record;
  try {
    record = wait_for_record(g, "the next switch");
  } catch (const CoordinatorLostError&) {
    // Every rank of the world waits here for the same record (`seen` and the timeline are
    // agreed), so each notices the loss as well: they save at this boundary together. A rank
    // that got the record just before tries the switch, fails at the dead store, and breaks the
    // world: then nobody saves, which is consistent too.
    orphaned = stopping = true;
    return std::nullopt;
  }
  Reconfiguration r = std::move(*record);
  Reconfiguration sw;
  if (preparing && preparing->sw.generation == g) {
    if (preparing->at_step > b) return std::nullopt;
    // A scale-up waits, a boundary at a time and at most elastic.prepare_steps of them, until the
    // processes it starts and every member have built their buffers: the pause is then the
    // transfer's, not the rest of a build (one on cores shared with training can take longer than
    // the steps it was given). The ranks agree on it; a timeline switch keeps its step.
    const bool timeline_next =
        next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= b + 1;
    if (!preparing->sw.timeline && preparing->waited < cfg.prepare_steps &&
        b + 1 < cfg.training.end_step() && !timeline_next) {
      const bool built =
          !preparing->chunks.valid() ||
          preparing->chunks.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
      int64_t waiting = built && feed->prepared(g, preparing->sw.spawn) ? 0 : 1;
      world->groups.world->all_reduce_sum(&waiting, 1);
      if (waiting > 0) {
        ++preparing->waited;
        return std::nullopt;
      }
    }
    sw = preparing->sw;  // the buffers stay in `preparing` for transition()
  } else {
    int64_t at = r.at_step >= 0 ? r.at_step : b;
    if (r.at_step < 0 && cfg.prepare_steps > 0) {
      // A scale request: prepared over the next elastic.prepare_steps steps, unless the run ends
      // or the timeline switches first (then now, built during the pause).
      const int64_t later = b + cfg.prepare_steps;
      const bool timeline_first =
          next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= later;
      if (later < cfg.training.end_step() && !timeline_first) at = later;
    }
    if (at > b) {
      if (cfg.prepare_steps > 0 && at - b <= cfg.prepare_steps) {
        r.step = b;  // announced at this step
        start_preparation(std::move(r), at);
      }
      return std::nullopt;
    }
    sw = std::move(r);
  }
  sw.step = b;
  sw.cursor = world->cursor;
  return sw;
}

void ElasticWorker::start_preparation(Reconfiguration sw, int64_t at_step) {
  Preparation p;
  p.sw = std::move(sw);
  p.at_step = at_step;
  p.planned = plan_switch(p.sw);
  if (const int new_rank = index_of(p.sw.to_members, env.rank); new_rank >= 0) {
    const auto kept = p.planned->kept_chunks(world->rank, new_rank).new_chunks;
    p.chunks = std::async(std::launch::async,
                          [this, to = p.sw.to, new_rank, backend = world->backend, kept] {
                            return prepare_chunks(cfg, to, new_rank, backend, kept);
                          });
  }
  preparing = std::move(p);
}

void ElasticWorker::drop_preparation() noexcept {
  if (!preparing) return;
  if (preparing->chunks.valid()) {
    try {
      preparing->chunks.get();
    } catch (const std::exception& e) {
      spdlog::warn("preparing the switch to generation {} failed: {}", preparing->sw.generation,
                   e.what());
    }
  }
  preparing.reset();
}

std::optional<PreparedChunks> ElasticWorker::take_prepared(const Reconfiguration& sw,
                                                           nlohmann::json& record) {
  if (!preparing || sw.recovery || preparing->sw.generation != sw.generation) return {};
  auto p = std::move(*preparing);
  preparing.reset();
  record["announced_at_step"] = p.sw.step;
  if (p.waited > 0) record["waited_for_builds_steps"] = p.waited;
  if (!p.chunks.valid()) return {};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    auto chunks = p.chunks.get();
    record["prepare_wait_s"] = seconds_since(t0);
    return chunks;
  } catch (const std::exception& e) {
    // E.g. no memory for both worlds at once: the switch builds them after freeing the old.
    spdlog::warn("preparing the switch to generation {} failed ({}); building during the pause",
                 sw.generation, e.what());
    return {};
  }
}

std::shared_ptr<const PlannedSwitch> ElasticWorker::plan_switch(const Reconfiguration& sw) const {
  // The plan depends only on the two layouts and their members, which is_for compares.
  if (preparing && preparing->planned && preparing->planned->is_for(sw)) return preparing->planned;
  auto from =
      std::make_shared<const layout::StateLayout>(layout::StateLayout::build(cfg.model, sw.from));
  auto to =
      std::make_shared<const layout::StateLayout>(layout::StateLayout::build(cfg.model, sw.to));
  // The hosts the coordinator placed the processes on (none named: all on this one).
  auto hosts = [](const std::vector<int>& named, int world) {
    return named.empty() ? std::vector<int>(size_t(world), 0) : named;
  };
  auto transfer = reshard::TransferPlan::build(*from, *to, hosts(sw.from_hosts, sw.from.world()),
                                               hosts(sw.to_hosts, sw.to.world()), sw.from_members,
                                               sw.to_members);
  return std::make_shared<const PlannedSwitch>(PlannedSwitch{
      std::move(from), std::move(to), sw.from_members, sw.to_members, std::move(transfer)});
}

std::optional<Reconfiguration> ElasticWorker::await_switch(const Reconfiguration& announced) {
  const int new_rank = index_of(announced.to_members, env.rank);
  // The user's sign that the process the switch needs is up (and the tests' cue that it waits).
  spdlog::info(
      "process {}: started for the switch to generation {} ({}); building its state and "
      "waiting for the world to switch",
      env.rank, announced.generation, announced.to.describe());
  Preparation p;
  p.sw = announced;
  const int g = announced.generation;
  p.chunks = std::async(std::launch::async, [this, to = announced.to, new_rank, g] {
    auto chunks = prepare_chunks(
        cfg, to, new_rank,
        std::shared_ptr<kernels::Backend>(kernels::make_backend(cfg.training.backend)), {});
    // A scale-up's members switch once every process it starts has said so (boundary above).
    try {
      control->set(elastic::prepared_key(env.job_id, g, env.rank), "built");
    } catch (const std::exception& e) {
      spdlog::warn("process {}: could not report its buffers built: {}", env.rank, e.what());
    }
    return chunks;
  });
  preparing = std::move(p);
  const auto limit = recovery_deadline(cfg.comm_timeout_s) * (cfg.prepare_steps + 1);
  const auto deadline = RecordFeed::Clock::now() + limit;
  // The go: rank 0 began the switch (or, its report overwritten since, finished it: that needed
  // this process, so it cannot have happened without it). A recovery record for a later failure
  // than the switch's voids the switch.
  auto go = [&](const RecordFeed::View& v) {
    return v.progress.entering >= g || v.progress.generation >= g;
  };
  auto overtaken = [&](const RecordFeed::View& v) {
    if (!v.stop.empty()) return true;  // the job stops: the switch will not happen
    if (launcher_gone()) return true;  // nobody is left to make it
    for (const auto& [gen, r] : v.records)
      if (r.recovery && r.failures > announced.failures) return true;
    return false;
  };
  feed->wait_until([&](const RecordFeed::View& v) { return go(v) || overtaken(v); }, deadline);
  const auto view = feed->view();
  if (launcher_gone()) {
    drop_preparation();
    spdlog::warn(
        "process {}: {} before the switch to generation {} this process was started for began: "
        "it holds no state; leaving",
        env.rank, launcher_gone_message(), g);
    return std::nullopt;
  }
  if (overtaken(view)) {
    drop_preparation();
    spdlog::info("process {}: {} overtook the switch to generation {} it was started for; leaving",
                 env.rank, view.stop.empty() ? "a failure recovery" : "the job's stop", g);
    return std::nullopt;
  }
  fatal = !go(view);  // no recovery helps this
  TESSEL_CHECK(!fatal, TimeoutError,
               "process {} was started for the switch to generation {} ({}), which did not "
               "begin within {} s",
               env.rank, g, announced.to.describe(), limit.count() / 1000);
  auto sw = announced;
  sw.step = view.progress.step;
  return sw;
}

void ElasticWorker::write_event(const nlohmann::json& record) {
  if (!events) events.emplace(cfg.events_path);
  events->write(record);
}

void ElasticWorker::write_switch_event(nlohmann::json record, const Reconfiguration& sw,
                                       double total_s) {
  for (const auto& [k, v] : sw.record.items()) record[k] = v;
  record["total_pause_s"] = sw.recovery ? record.value("detection_s", 0.0) +
                                              record.value("planning_s_coordinator", 0.0) + total_s
                                        : total_s;
  write_event(record);
}

void ElasticWorker::transition(const Reconfiguration& sw) {
  const int me = env.rank;
  const int new_rank = index_of(sw.to_members, me);
  const int old_rank = world != nullptr ? index_of(sw.from_members, me) : -1;
  const auto t0 = std::chrono::steady_clock::now();
  // The go for the processes started for this switch (they wait for it, buffers built).
  if (!sw.recovery) report_progress(sw.generation);
  auto enter = [&] {
    generation = sw.generation;
    generation_in_force = generation;
    plan = sw.to;
    members = sw.to_members;
    if (sw.timeline) skip_timeline_through(sw.at_step);
    failures = std::max(failures, sw.failures);
    if (env.signals) env.signals->acknowledge(failures);
    applied_request = std::max(applied_request, sw.applied_request);
  };
  if (new_rank < 0 && old_rank < 0) {  // nothing to give or take
    world.reset();
    enter();
    return;
  }
  // The control plane's share of the pause, on this process: from the step boundary (or the
  // decision, when it came later; a recovery: the decision) to here. Processes started for the
  // switch were not paused: they count 0.
  const double control_s =
      world == nullptr
          ? 0.0
          : std::clamp(unix_seconds() -
                           (sw.recovery ? sw.decided_at : std::max(sw.decided_at, boundary_at)),
                       0.0, seconds_since(boundary_steady));
  const int64_t store_generation = env.generation + sw.generation;
  if (!sw.checkpoint.empty()) {
    restore_from_checkpoint(sw, new_rank, store_generation, t0);
    enter();
    entered = world != nullptr;
    report_progress();
    return;
  }
  // A survivor whose state is not a source drops it first (its memory is needed).
  if (old_rank < 0) world.reset();
  const auto ps = plan_switch(sw);
  const auto& tplan = ps->transfer;
  const double planning_s = seconds_since(t0);
  const auto store = env.store(store_generation, cfg.comm_timeout_s);
  // Waits for every process of the transition, joiners (being started now) included.
  auto t1 = std::chrono::steady_clock::now();
  auto union_world =
      reshard::connect_transition_world(store, tplan, me, store.timeout, env.transport());
  // Within this host, receivers read the senders' memory directly (one copy; the network when
  // that is not allowed), unless elastic.reshard_transport says network. What goes over the
  // network moves on elastic.transfer_streams streams per pair (every process decides alike,
  // from the plan and the config).
  reshard::ExecuteOptions how;
  how.same_host_direct = cfg.reshard_transport == "direct";
  const bool networked = tplan.stats().bytes_cross_host > 0 ||
                         (!how.same_host_direct && tplan.stats().bytes_moved > 0);
  auto lanes = reshard::connect_transition_lanes(
      store, tplan, me, networked ? cfg.transfer_streams - 1 : 0, store.timeout, env.transport());
  for (const auto& lane : lanes) how.lanes.push_back(lane.get());
  const double connect_s = seconds_since(t1);
  // Between hosts, the Adam moments' messages move after the pause, while the new world computes
  // its first step (arriving_state.h); the parameters and every copy within a process move now.
  // Every process decides alike, from the plan.
  auto in_pause = [](const reshard::Transfer& tr) {
    return tr.kind == layout::StateKind::param || tr.src_process == tr.dst_process;
  };
  std::optional<reshard::TransferPlan> now_part, later_part;
  if (tplan.stats().bytes_cross_host > 0) {
    later_part = tplan.part([&](const reshard::Transfer& tr) { return !in_pause(tr); }, false);
    if (later_part->messages().empty())
      later_part.reset();
    else
      now_part = tplan.part(in_pause, true);
  }
  t1 = std::chrono::steady_clock::now();
  // The old buffers first: the successor may take over chunks (and their memory) it keeps.
  reshard::ProcessBuffers buffers;
  if (world) {
    for (auto b : world->state_buffers()) buffers.old_buffers.emplace_back(b.data(), b.size());
    release_unkept_buffers(*ps, new_rank);
  }
  std::unique_ptr<RankTrainer> successor;
  double rebuild_s = 0, transfer_s = 0;
  nlohmann::json prepare_record = nlohmann::json::object();
  reshard::ExecuteStats moved;
  double control_max_s = 0;
  layout::ScalarState shared{sw.step, sw.step, sw.cursor, {}};
  try {
    // Prepared ahead (maybe_prepare, await_switch): waits for the build if it still runs.
    auto prepared = take_prepared(sw, prepare_record);
    if (new_rank >= 0)
      successor =
          std::make_unique<RankTrainer>(cfg, env, sw.to, new_rank, store_generation, false, ps->to,
                                        world.get(), &tplan, prepared ? &*prepared : nullptr);
    rebuild_s = seconds_since(t1);
    t1 = std::chrono::steady_clock::now();
    if (successor) buffers.new_buffers = successor->state_buffers();
    moved = reshard::execute(now_part ? *now_part : tplan, me, *union_world, buffers, how);
    int64_t by[2] = {moved.bytes_read_directly, moved.bytes_received};
    union_world->all_reduce_sum(by, 2);  // the whole transition's, for the event line
    moved = {by[0], by[1]};
    // The last process's go sets the control plane's share (microseconds: whole numbers gather).
    int64_t mine_us = int64_t(control_s * 1e6);
    std::vector<int64_t> all_us(size_t(union_world->size()));
    union_world->all_gather(&mine_us, 1, all_us.data());
    control_max_s = double(*std::max_element(all_us.begin(), all_us.end())) / 1e6;
    if (!sw.recovery) {
      layout::ScalarState mine;
      if (world) mine = {world->step, world->step, world->cursor, {}};
      shared = reshard::share_scalar_state(tplan, me, *union_world, world ? &mine : nullptr);
    }
    transfer_s = seconds_since(t1);
  } catch (...) {
    if (successor && world) successor->give_back(*world);
    throw;
  }
  const int64_t later_bytes = later_part ? later_part->stats().bytes_moved : 0;
  if (later_part) {
    if (successor) {
      successor->arriving =
          std::make_unique<ArrivingState>(std::move(*later_part), me, std::move(union_world),
                                          std::move(lanes), buffers, how, std::move(world));
    } else {
      // Leaving: nothing to overlap it with, and its buffers must stay until the peers have them.
      reshard::execute(*later_part, me, *union_world, buffers, how);
    }
  }
  world = std::move(successor);
  enter();
  if (!world) return;  // left the job
  world->generation = generation;
  world->step = shared.step;
  world->cursor = shared.data_cursor;
  // Timeline entries before the switch's step are past (a process that joined knew only about
  // when it would come); the one at it is the switch's own when it carried it.
  skip_timeline_through(world->step - 1);
  if (sw.timeline) skip_timeline_through(sw.at_step);
  entered = true;
  report_progress();
  if (world->rank == 0) {
    const auto& st = tplan.stats();
    const double total_s = seconds_since(t0);
    spdlog::info(
        "step {}: {} from {} to {} in {:.3f} s: {:.1f} MB moved between processes, {:.1f} MB "
        "copied locally, {} messages",
        shared.step, sw.recovery ? "recovered" : "switched", sw.from.describe(), sw.to.describe(),
        total_s, double(st.bytes_moved) / 1e6, double(st.local_copy_bytes) / 1e6, st.messages);
    nlohmann::json record = {{"event", sw.recovery ? "recover" : "reconfigure"},
                             {"cause", sw.cause},
                             {"generation", generation},
                             {"step", shared.step},
                             {"old_plan", sw.from.describe()},
                             {"new_plan", sw.to.describe()},
                             {"old_workers", sw.from.world()},
                             {"new_workers", sw.to.world()},
                             {"restored_from", "survivors"},
                             {"detection_s", 0.0},
                             {"control_s", control_max_s},
                             {"planning_s", planning_s},
                             {"connect_s", connect_s},
                             {"rebuild_s", rebuild_s},
                             {"groups_connect_s", world->groups_connect_s},
                             {"transfer_s", transfer_s},
                             {"bytes_moved", st.bytes_moved},
                             {"bytes_cross_host", st.bytes_cross_host},
                             {"bytes_cross_host_min", st.min_cross_host_bytes},
                             {"bytes_copied_locally", st.local_copy_bytes},
                             {"max_send_bytes", st.max_send_bytes},
                             {"max_recv_bytes", st.max_recv_bytes},
                             {"messages", st.messages},
                             {"bytes_read_directly", moved.bytes_read_directly},
                             {"bytes_over_network", moved.bytes_received},
                             // Adam moments moved between hosts after the pause (not counted in
                             // bytes_over_network, which is the pause's).
                             {"bytes_after_pause", later_bytes},
                             {"steps_lost", 0}};
    record.update(prepare_record);
    write_switch_event(std::move(record), sw, total_s);
  }
}

void ElasticWorker::release_unkept_buffers(const PlannedSwitch& ps, int new_rank) {
  world->release_unkept(ps.kept_chunks(world->rank, new_rank).old_chunks);
}

void ElasticWorker::restore_from_checkpoint(const Reconfiguration& sw, int new_rank,
                                            int64_t store_generation,
                                            std::chrono::steady_clock::time_point t0) {
  world.reset();
  if (new_rank < 0) return;
  const auto opened = open_checkpoint(sw.checkpoint);
  const auto& reader = *opened.reader;
  check_resumable(cfg, reader.meta(), sw.checkpoint);
  world = std::make_unique<RankTrainer>(cfg, env, sw.to, new_rank, store_generation, false);
  const double rebuild_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  try {
    load_rank_state(reader, world->layout(), new_rank, world->state_buffers(), opened.fetch);
  } catch (...) {
    // Half-read state is no state: the failure report must not offer it as a survivor's.
    world.reset();
    throw;
  }
  const double transfer_s = seconds_since(t1);
  if (!opened.remote_files.empty())
    spdlog::info("restored from {}: what this rank needed of {} read from other hosts",
                 sw.checkpoint, fmt::join(opened.remote_files, ", "));
  world->generation = sw.generation;
  world->step = reader.meta().at("step").get<int64_t>();
  world->cursor = reader.meta().at("cursor").get<int64_t>();
  if (new_rank == 0) {
    const double total_s = seconds_since(t0);
    spdlog::info("step {}: restored {} from {} in {:.3f} s ({})", world->step, sw.to.describe(),
                 sw.checkpoint, total_s, sw.cause);
    nlohmann::json record = {{"event", "recover"},
                             {"cause", sw.cause},
                             {"generation", sw.generation},
                             {"step", world->step},
                             {"old_plan", sw.from.describe()},
                             {"new_plan", sw.to.describe()},
                             {"new_workers", sw.to.world()},
                             {"restored_from", sw.checkpoint},
                             {"detection_s", 0.0},
                             {"planning_s", 0.0},
                             {"rebuild_s", rebuild_s},
                             {"transfer_s", transfer_s},
                             {"bytes_read", reader.bytes_read()},
                             {"bytes_moved", 0}};
    // In a cluster: the rank files this rank read from other hosts (it held no copy of them).
    if (env.cluster_saves) record["files_from_other_hosts"] = opened.remote_files;
    write_switch_event(std::move(record), sw, total_s);
  }
}

void ElasticWorker::recover(const std::string& what, const std::string& kind) {
  drop_preparation();
  // Nobody is left to decide a recovery, and the world that met `what` cannot save together.
  if (launcher_gone()) leave_without_saving(what);
  ++failures;
  if (env.signals) env.signals->acknowledge(failures);
  FailureReport r;
  r.process = env.rank;
  r.error = what;
  r.kind = kind;
  r.applied_request = applied_request;
  r.generation = generation;
  r.plan = plan;
  r.members = members;
  if (world) {
    world->abort(what);
    try {
      world->finish_arrival();  // the optimizer state a switch was still moving here
    } catch (const std::exception& e) {
      spdlog::warn("process {}: the optimizer state transfer of the last switch did not finish: {}",
                   env.rank, e.what());
    }
    try {
      world->finish_checkpoint();  // a background save may still be writing
    } catch (const std::exception& e) {
      spdlog::warn("the checkpoint being saved when the failure happened is lost: {}", e.what());
    }
    r.valid = !world->updating();
    r.generation = world->generation;
    r.plan = world->plan;
    r.rank = world->rank;
    r.step = world->step;
    r.cursor = world->cursor;
  }
  spdlog::warn("process {}: {}; reporting to the coordinator (failure {}, {} at step {})", env.rank,
               what, failures, r.valid ? "state valid" : "no usable state", r.step);
  TESSEL_CHECK(control != nullptr, PeerLostError, "{}", what);
  control->set(elastic::report_key(env.job_id, failures, env.rank), r.to_json().dump());
  // The coordinator's bound on gathering the reports (this wait starts after its own).
  const auto limit = recovery_deadline(cfg.comm_timeout_s);
  const int64_t e = failures;
  auto decision = [e](const RecordFeed::View& v) -> const Reconfiguration* {
    for (const auto& [g, rec] : v.records)
      if (rec.recovery && rec.failures == e) return &rec;
    return nullptr;
  };
  feed->wait_until(
      [&](const RecordFeed::View& v) { return decision(v) != nullptr || launcher_gone(); },
      RecordFeed::Clock::now() + limit);
  const auto view = feed->view();
  const auto* found = decision(view);
  if (found == nullptr && launcher_gone())
    leave_without_saving(fmt::format("{}, and no recovery was decided", what));
  fatal = found == nullptr;
  TESSEL_CHECK(!fatal, TimeoutError,
               "process {}: the coordinator decided nothing about failure {} within {} s", env.rank,
               failures, limit.count() / 1000);
  auto sw = *found;
  skip_timeline_through(sw.step);
  transition(sw);
}

}  // namespace tessel::runtime
