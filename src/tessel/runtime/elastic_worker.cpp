#include "tessel/runtime/elastic_worker.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/clock.h"
#include "tessel/core/json_file.h"
#include "tessel/core/log.h"
#include "tessel/reshard/executor.h"
#include "tessel/runtime/host_settings.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/tensor/allocator.h"

namespace tessel::runtime {

using checkpoint::check_resumable;
using checkpoint::load_rank_state;
using config::PlanSwitch;
using elastic::failure_report_path;
using elastic::FailureReport;
using elastic::prepare_marker_path;
using elastic::recovery_deadline;
using elastic::recovery_path;
using elastic::scale_request_path;
using elastic::switch_marker_path;
using elastic::SwitchMarker;

namespace {

int index_of(const std::vector<int>& v, int x) {
  auto it = std::find(v.begin(), v.end(), x);
  return it == v.end() ? -1 : int(it - v.begin());
}

std::vector<int> iota_members(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
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

bool PlannedSwitch::is_for(const SwitchMarker& sw) const {
  return from->plan() == sw.from && to->plan() == sw.to && from_members == sw.from_members &&
         to_members == sw.to_members;
}

ElasticWorker::ElasticWorker(config::TrainConfig c, const WorkerEnv& e)
    : cfg(std::move(c)), env(e) {
  apply_host_settings(cfg.training);
  // Workers of a timeline or of scale requests are started as the plans need them, so the
  // world size in the environment is only checked against a fixed run.
  cfg.validate_for_workers(cfg.timeline.empty() && !elastic() ? env.world_size : cfg.max_workers());
  plan = cfg.plan;
  const int64_t join = env.join_generation;
  if (join > 0) {
    // Started for the switch to generation `join`: take part in it as a receiver only. Its
    // description was written before this process was started.
    // Announced ahead (prepare-<g>) unless the switch itself is already there.
    auto path = switch_marker_path(env.store_dir, env.job_id, int(join));
    if (!std::filesystem::exists(path)) {
      path = prepare_marker_path(env.store_dir, env.job_id, int(join));
      joining_early = true;
    }
    auto m = SwitchMarker::from_json(read_json_file(path), path);
    TESSEL_CHECK(index_of(m.to_members, env.rank) >= 0, ConfigError,
                 "TESSEL_JOIN_GENERATION={}: process {} has no place in {} ({})", join, env.rank,
                 m.to.describe(), path);
    generation = int(join) - 1;
    plan = m.from;
    members = m.from_members;
    next_process_id = m.next_process_id;
    failures = m.failures;
    applied_request = m.applied_request;
    skip_timeline_through(m.step);
    joining = std::move(m);
    return;
  }
  if (resume()) return;
  TESSEL_CHECK(env.rank < plan.world(), ConfigError,
               "worker rank {} has no place in {}: `tessel train` starts workers as the plans "
               "need them",
               env.rank, plan.describe());
  members = iota_members(plan.world());
  next_process_id = plan.world();
  world = std::make_unique<RankTrainer>(cfg, env, plan, env.rank, env.generation, true);
}

void ElasticWorker::skip_timeline_through(int64_t step) {
  while (next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= step)
    ++next_static;
}

bool ElasticWorker::resume() {
  std::optional<std::string> path;
  if (!env.resume_from) {
    if (auto point = checkpoint::find_resume_point(cfg)) path = point->path;
  } else if (!env.resume_from->empty()) {
    path = *env.resume_from;
  }
  if (!path) return false;
  store::CheckpointReader reader(*path);
  const auto& meta = reader.meta();
  check_resumable(cfg, meta, *path);
  const int64_t step = meta.at("step").get<int64_t>();
  plan = cfg.plan_at(step);
  skip_timeline_through(step);
  TESSEL_CHECK(env.rank < plan.world(), ConfigError,
               "worker rank {} has no place in {}, the plan at step {}", env.rank, plan.describe(),
               step);
  members = iota_members(plan.world());
  next_process_id = plan.world();
  world = std::make_unique<RankTrainer>(cfg, env, plan, env.rank, env.generation, false);
  load_rank_state(reader, world->layout(), env.rank, world->state_buffers());
  world->step = step;
  world->cursor = meta.at("cursor").get<int64_t>();
  if (env.rank == 0)
    spdlog::info("resumed from {} at step {} (saved under {}, continuing under {})", *path, step,
                 layout::plan_from_json(meta.at("plan")).describe(), world->plan.describe());
  return true;
}

std::optional<SwitchMarker> ElasticWorker::next_switch() {
  const int64_t step = world->step;
  std::optional<SwitchMarker> sw;
  if (preparing) {
    // Requests wait (queued) while a switch is prepared; it happens at its step.
    if (preparing->at_step > step) return std::nullopt;
    if (preparing->timeline) ++next_static;
    sw = preparing->sw;  // the buffers stay in `preparing` for transition()
  } else if (next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step == step) {
    sw = timeline_switch(cfg.timeline[next_static++]);
  } else if (elastic()) {
    // The newest request any rank has seen; the request files only ever appear, so every rank
    // can read the agreed one after the all-reduce.
    int64_t seen = applied_request;
    while (std::filesystem::exists(scale_request_path(env.store_dir, env.job_id, seen + 1))) ++seen;
    std::vector<int64_t> all(size_t(world->groups.world->size()));
    world->groups.world->all_gather(&seen, 1, all.data());
    seen = *std::max_element(all.begin(), all.end());
    if (seen <= applied_request) return std::nullopt;
    const auto req = read_json_file(scale_request_path(env.store_dir, env.job_id, seen));
    auto to = layout::plan_from_json(req.at("plan")).with_defaults(cfg.model);
    applied_request = seen;
    if (to == plan) return std::nullopt;
    sw = make_switch(std::move(to), "scale request");
    sw->request = seen;
    // Prepared over the next elastic.prepare_steps steps, unless the timeline switches first
    // or the run ends before (then now, built during the pause).
    const int64_t at = step + cfg.prepare_steps;
    const bool timeline_first =
        next_static < cfg.timeline.size() && cfg.timeline[next_static].at_step <= at;
    if (cfg.prepare_steps > 0 && at < cfg.training.end_step() && !timeline_first) {
      start_preparation(std::move(*sw), at, false);
      return std::nullopt;
    }
  }
  if (!sw) return std::nullopt;
  sw->step = step;
  sw->cursor = world->cursor;
  return sw;
}

SwitchMarker ElasticWorker::make_switch(layout::Plan to, const std::string& cause) {
  SwitchMarker sw;
  sw.to = std::move(to);
  sw.cause = cause;
  sw.generation = generation + 1;
  sw.from = plan;
  sw.from_members = members;
  const int n = sw.to.world();
  sw.to_members.assign(members.begin(),
                       members.begin() + std::min<ptrdiff_t>(n, ptrdiff_t(members.size())));
  while (int(sw.to_members.size()) < n) {
    sw.to_members.push_back(next_process_id);
    sw.spawn.push_back(next_process_id++);
  }
  sw.next_process_id = next_process_id;
  sw.applied_request = applied_request;
  sw.failures = failures;
  sw.step = world->step;
  sw.cursor = world->cursor;
  return sw;
}

SwitchMarker ElasticWorker::timeline_switch(const PlanSwitch& e) {
  return make_switch(e.plan, e.workers > 0 ? "timeline (workers)" : "timeline (plan)");
}

void ElasticWorker::maybe_prepare() {
  if (preparing || cfg.prepare_steps <= 0 || next_static >= cfg.timeline.size()) return;
  const auto& e = cfg.timeline[next_static];
  const int64_t step = world->step;
  if (e.at_step <= step || e.at_step - step > cfg.prepare_steps ||
      e.at_step >= cfg.training.end_step())
    return;
  start_preparation(timeline_switch(e), e.at_step, true);
}

void ElasticWorker::start_preparation(SwitchMarker sw, int64_t at_step, bool timeline) {
  Preparation p;
  p.sw = std::move(sw);
  p.at_step = at_step;
  p.timeline = timeline;
  if (world->rank == 0 && !p.sw.spawn.empty())
    write_json_file(prepare_marker_path(env.store_dir, env.job_id, p.sw.generation),
                    p.sw.to_json());
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

std::optional<PreparedChunks> ElasticWorker::take_prepared(const SwitchMarker& sw,
                                                           nlohmann::json& record) {
  if (!preparing || sw.recovery || preparing->sw.generation != sw.generation) return {};
  auto p = std::move(*preparing);
  preparing.reset();
  record["announced_at_step"] = p.sw.step;
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

std::shared_ptr<const PlannedSwitch> ElasticWorker::plan_switch(const SwitchMarker& sw) const {
  // The plan depends only on the two layouts and their members, which is_for compares.
  if (preparing && preparing->planned && preparing->planned->is_for(sw)) return preparing->planned;
  auto from =
      std::make_shared<const layout::StateLayout>(layout::StateLayout::build(cfg.model, sw.from));
  auto to =
      std::make_shared<const layout::StateLayout>(layout::StateLayout::build(cfg.model, sw.to));
  auto transfer = reshard::TransferPlan::build(
      *from, *to, std::vector<int>(size_t(sw.from.world()), 0),
      std::vector<int>(size_t(sw.to.world()), 0), sw.from_members, sw.to_members);
  return std::make_shared<const PlannedSwitch>(PlannedSwitch{
      std::move(from), std::move(to), sw.from_members, sw.to_members, std::move(transfer)});
}

std::optional<SwitchMarker> ElasticWorker::await_switch(const SwitchMarker& announced) {
  const int new_rank = index_of(announced.to_members, env.rank);
  Preparation p;
  p.sw = announced;
  p.chunks = std::async(std::launch::async, [this, to = announced.to, new_rank] {
    return prepare_chunks(
        cfg, to, new_rank,
        std::shared_ptr<kernels::Backend>(kernels::make_backend(cfg.training.backend)), {});
  });
  preparing = std::move(p);
  const auto go = switch_marker_path(env.store_dir, env.job_id, announced.generation);
  const auto overtaken = recovery_path(env.store_dir, env.job_id, announced.failures + 1);
  const auto limit = recovery_deadline(cfg.comm_timeout_s) * (cfg.prepare_steps + 1);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (std::filesystem::exists(go)) {
      auto sw = SwitchMarker::from_json(read_json_file(go), go);
      skip_timeline_through(sw.step);
      return sw;
    }
    if (std::filesystem::exists(overtaken)) {
      drop_preparation();
      spdlog::info(
          "process {}: a failure recovery overtook the switch to generation {} it "
          "was started for; leaving",
          env.rank, announced.generation);
      return std::nullopt;
    }
    fatal = std::chrono::steady_clock::now() >= deadline;  // no recovery helps this
    TESSEL_CHECK(!fatal, TimeoutError,
                 "process {} was started for the switch to generation {} ({}), which did not "
                 "happen within {} s ({} did not appear)",
                 env.rank, announced.generation, announced.to.describe(), limit.count() / 1000, go);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void ElasticWorker::write_event(const nlohmann::json& record) {
  if (!events) events.emplace(cfg.events_path);
  events->write(record);
}

void ElasticWorker::write_switch_event(nlohmann::json record, const SwitchMarker& sw,
                                       double total_s) {
  for (const auto& [k, v] : sw.record.items()) record[k] = v;
  record["total_pause_s"] = sw.recovery ? record.value("detection_s", 0.0) +
                                              record.value("planning_s_coordinator", 0.0) + total_s
                                        : total_s;
  write_event(record);
}

void ElasticWorker::transition(const SwitchMarker& sw) {
  const int me = env.rank;
  const int new_rank = index_of(sw.to_members, me);
  const int old_rank = world != nullptr ? index_of(sw.from_members, me) : -1;
  const auto t0 = std::chrono::steady_clock::now();
  if (!sw.recovery && world != nullptr && world->rank == 0) {
    // Tells the coordinator (which starts the processes this switch adds) and those processes
    // what it is.
    write_json_file(switch_marker_path(env.store_dir, env.job_id, sw.generation), sw.to_json());
  }
  auto enter = [&] {
    generation = sw.generation;
    plan = sw.to;
    members = sw.to_members;
    next_process_id = std::max(next_process_id, sw.next_process_id);
    failures = std::max(failures, sw.failures);
    applied_request = std::max(applied_request, sw.applied_request);
  };
  if (new_rank < 0 && old_rank < 0) {  // nothing to give or take
    world.reset();
    enter();
    return;
  }
  const int64_t store_generation = env.generation + sw.generation;
  if (!sw.checkpoint.empty()) {
    restore_from_checkpoint(sw, new_rank, store_generation, t0);
    enter();
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
  auto union_world = reshard::connect_transition_world(store, tplan, me, store.timeout);
  const double connect_s = seconds_since(t1);
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
    // Within this host, receivers read the senders' memory directly (one copy; the network
    // when that is not allowed), unless elastic.reshard_transport says network.
    reshard::ExecuteOptions how;
    how.same_host_direct = cfg.reshard_transport == "direct";
    moved = reshard::execute(tplan, me, *union_world, buffers, how);
    int64_t by[2] = {moved.bytes_read_directly, moved.bytes_received};
    union_world->all_reduce_sum(by, 2);  // the whole transition's, for the event line
    moved = {by[0], by[1]};
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
  world = std::move(successor);
  enter();
  if (!world) return;  // left the job
  world->generation = generation;
  world->step = shared.step;
  world->cursor = shared.data_cursor;
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
                             {"planning_s", planning_s},
                             {"connect_s", connect_s},
                             {"rebuild_s", rebuild_s},
                             {"transfer_s", transfer_s},
                             {"bytes_moved", st.bytes_moved},
                             {"bytes_cross_host", st.bytes_cross_host},
                             {"bytes_copied_locally", st.local_copy_bytes},
                             {"max_send_bytes", st.max_send_bytes},
                             {"max_recv_bytes", st.max_recv_bytes},
                             {"messages", st.messages},
                             {"bytes_read_directly", moved.bytes_read_directly},
                             {"bytes_over_network", moved.bytes_received},
                             {"steps_lost", 0}};
    record.update(prepare_record);
    write_switch_event(std::move(record), sw, total_s);
  }
}

void ElasticWorker::release_unkept_buffers(const PlannedSwitch& ps, int new_rank) {
  if (world->release_unkept(ps.kept_chunks(world->rank, new_rank).old_chunks))
    HostAllocator::instance().release_cached();
}

void ElasticWorker::restore_from_checkpoint(const SwitchMarker& sw, int new_rank,
                                            int64_t store_generation,
                                            std::chrono::steady_clock::time_point t0) {
  world.reset();
  if (new_rank < 0) return;
  store::CheckpointReader reader(sw.checkpoint);
  check_resumable(cfg, reader.meta(), sw.checkpoint);
  world = std::make_unique<RankTrainer>(cfg, env, sw.to, new_rank, store_generation, false);
  const double rebuild_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  load_rank_state(reader, world->layout(), new_rank, world->state_buffers());
  const double transfer_s = seconds_since(t1);
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
    write_switch_event(std::move(record), sw, total_s);
  }
}

void ElasticWorker::recover(const std::string& what) {
  drop_preparation();
  ++failures;
  FailureReport r;
  r.process = env.rank;
  r.error = what;
  r.applied_request = applied_request;
  r.generation = generation;
  r.plan = plan;
  r.members = members;
  if (world) {
    world->abort(what);
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
  write_json_file(failure_report_path(env.store_dir, env.job_id, failures, env.rank), r.to_json());
  const auto path = recovery_path(env.store_dir, env.job_id, failures);
  // The coordinator's bound on gathering the reports (this wait starts after its own).
  const auto limit = recovery_deadline(cfg.comm_timeout_s);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!std::filesystem::exists(path)) {
    fatal = std::chrono::steady_clock::now() >= deadline;
    TESSEL_CHECK(!fatal, TimeoutError,
                 "process {}: the coordinator decided nothing about failure {} within {} s "
                 "({} did not appear)",
                 env.rank, failures, limit.count() / 1000, path);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto sw = SwitchMarker::from_json(read_json_file(path), path);
  skip_timeline_through(sw.step);
  transition(sw);
}

}  // namespace tessel::runtime
