#include "tessel/runtime/rank_trainer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/runtime/evaluation.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::runtime {

namespace {

comm::ProcessGroups connect(const config::TrainConfig& cfg, const WorkerEnv& env,
                            const layout::Plan& plan, int rank, int64_t store_generation,
                            double& seconds) {
  const auto start = std::chrono::steady_clock::now();
  comm::GridLayout grid;
  grid.dp = plan.dp;
  grid.tp = plan.tp;
  grid.pp = plan.pp;
  if (plan.order == layout::RankOrder::dp_tp_pp)
    grid.order = {comm::Axis::kDp, comm::Axis::kTp, comm::Axis::kPp};
  const auto store = env.store(store_generation, cfg.comm_timeout_s);
  auto groups =
      comm::connect_process_groups(store, grid, rank, plan.world(), store.timeout, env.transport());
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return groups;
}

std::shared_ptr<const data::TokenSource> open_data(const config::TrainConfig& cfg) {
  auto source = data::open_token_source(cfg.data.path);
  TESSEL_CHECK(source->vocab_size() <= uint64_t(cfg.model.vocab_size), ConfigError,
               "{}: the data {} has token ids up to {} but model '{}' has vocab_size {}",
               cfg.source, source->describe(), source->vocab_size() - 1, cfg.model.name,
               cfg.model.vocab_size);
  return source;
}

// Waits until every rank 0..n-1 has either its file (each appears whole: they are renamed into
// place) or its failure marker in a save's staging directory, bounded by `timeout`; returns the
// ranks that failed. Waiting for all of them, not just to the first failure, means nobody writes
// into the directory any more once it is cleaned up. `cancelled` (set when a peer failed) ends
// the wait at once with PeerLostError.
std::vector<int> wait_for_rank_files(const std::string& staging, int n,
                                     std::chrono::milliseconds timeout,
                                     const std::atomic<bool>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> failed;
  for (int r = 0; r < n; ++r) {
    const auto path = std::filesystem::path(staging) / store::rank_file_name(r);
    const auto marker = std::filesystem::path(staging) / store::rank_failed_name(r);
    while (!std::filesystem::exists(path)) {
      if (std::filesystem::exists(marker)) {
        failed.push_back(r);
        break;
      }
      TESSEL_CHECK(!cancelled.load(), PeerLostError,
                   "checkpoint: a peer failed before rank {}'s file {} was written", r,
                   path.string());
      TESSEL_CHECK(std::chrono::steady_clock::now() < deadline, TimeoutError,
                   "checkpoint: rank {}'s file {} did not appear within {} ms", r, path.string(),
                   timeout.count());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return failed;
}

}  // namespace

RankTrainer::RankTrainer(const config::TrainConfig& c, const WorkerEnv& e, const layout::Plan& p,
                         int rank_in_plan, int64_t store_generation, bool init_params,
                         std::shared_ptr<const layout::StateLayout> layout, RankTrainer* donor,
                         const reshard::TransferPlan* transfer, PreparedChunks* prepared)
    : cfg(c),
      env(e),
      plan(p.with_defaults(c.model)),
      rank(rank_in_plan),
      groups(connect(cfg, env, plan, rank, store_generation, groups_connect_s)),
      tp_group(plan.tp > 1 ? std::make_unique<CommTpGroup>(*groups.tp) : nullptr),
      backend(donor != nullptr ? donor->backend
              : prepared != nullptr
                  ? prepared->backend
                  : std::shared_ptr<kernels::Backend>(kernels::make_backend(cfg.training.backend))),
      source(open_data(cfg)),
      executor(std::make_unique<PipelineExecutor>(plan, groups.coord.pp, cfg.data.seq_len,
                                                  cfg.model.n_embd)),
      stage(cfg,
            layout ? std::move(layout)
                   : std::make_shared<const layout::StateLayout>(
                         layout::StateLayout::build(cfg.model, plan)),
            rank, int(plan.micro_batch), *backend, tp_group.get(), executor->activation_slots(),
            init_params,
            StageSources{donor != nullptr ? &donor->stage : nullptr, transfer, prepared}),
      optimizer(std::make_unique<OptimizerStep>(stage, plan, groups, *backend, cfg.bucket_mb)),
      lr_schedule{cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.warmup_steps,
                  cfg.training.steps} {
  if (env.signals) abort_signal_ = env.signals->of(store_generation);
  if (!env.pipeline_delay.empty()) executor->set_delay(DelayInjection::parse(env.pipeline_delay));
  install_layer_hooks();
  loader_ = std::make_unique<data::BatchLoader>(source, cfg.data.seq_len, cfg.data.seed,
                                                cfg.data.eval_fraction);
  inputs_.resize(size_t(plan.micro_batch * plan.micro_batches * cfg.data.seq_len));
  targets_.resize(inputs_.size());
  if (rank == 0) metrics = MetricsWriter(cfg.metrics_path);
  tracer = StepTracer(cfg.trace_path, cfg.trace_steps);
  executor->set_tracer(&tracer);
  if (!cfg.data_order_path.empty() && groups.coord.tp == 0 && groups.coord.pp == 0) {
    data_log_fd_ =
        ::open(cfg.data_order_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    TESSEL_CHECK(data_log_fd_ >= 0, IoError, "cannot open output.data_order file {}",
                 cfg.data_order_path);
  }
}

RankTrainer::~RankTrainer() {
  arriving.reset();  // its thread writes into this world's buffers
  if (data_log_fd_ >= 0) ::close(data_log_fd_);
}

void RankTrainer::finish_arrival() {
  if (!arriving) return;
  const auto a = std::move(arriving);
  try {
    a->wait();
  } catch (...) {
    state_incomplete_ = a->receives();
    throw;
  }
  if (a->receives())
    spdlog::info("process {}: the optimizer state ({:.1f} MB) arrived {:.3f} s after the switch",
                 env.rank, double(a->bytes_received()) / 1e6, a->seconds());
}

void RankTrainer::abort(const std::string& why) noexcept {
  if (arriving) arriving->abort(why);
  groups.abort(why);
  save_cancelled_ = true;
  executor->abort();
}

void RankTrainer::give_back(RankTrainer& donor) {
  stage.give_back(donor.stage, donor.tp_group.get());
  donor.install_layer_hooks();
}

void RankTrainer::install_layer_hooks() {
  // A world being replaced (its generation's signal fired: a peer or its host was lost, the
  // coordinator recovers) stops computing at the next layer instead of finishing a step that will
  // be redone: on a lost host the survivors would otherwise compute on until they reach the
  // collective that needs it. The step's optimizer update has not started, so the state is still
  // the step boundary's.
  if (!abort_signal_) return;
  for (auto& ch : stage.chunks()) {
    if (!ch.model) continue;
    ch.model->set_layer_hook([signal = abort_signal_] {
      if (signal->aborted())
        throw PeerLostError(fmt::format("stopped computing the step: {}", signal->reason()));
    });
  }
}

void RankTrainer::release_unkept(const std::vector<bool>& kept) {
  optimizer->release();  // it points at the gradients
  stage.release_unkept(kept);
}

// O_APPEND: lines of different processes do not mix. Written before any collective of the step,
// so a step that commits anywhere has every replica's line in its generation; a step that is
// redone after a failure appears again in a later generation, which then counts.
void RankTrainer::log_data_order(int64_t first, int64_t count) const {
  if (data_log_fd_ < 0) return;
  const std::string line = nlohmann::json({{"step", step + 1},
                                           {"generation", generation},
                                           {"process", env.rank},
                                           {"dp_rank", groups.coord.dp},
                                           {"first", first},
                                           {"count", count}})
                               .dump() +
                           "\n";
  TESSEL_CHECK(::write(data_log_fd_, line.data(), line.size()) == ssize_t(line.size()), IoError,
               "writing {} failed", cfg.data_order_path);
}

double RankTrainer::train_step(double* grad_norm) {
  tracer.begin_step();
  std::optional<TraceScope> whole(std::in_place, &tracer, "step", "step");
  const int64_t per_replica = plan.micro_batch * plan.micro_batches;
  const int64_t first = cursor + groups.coord.dp * per_replica;
  int64_t valid = 0;
  {
    TraceScope scope(&tracer, "load", "data");
    loader_->load(cursor, groups.coord.dp * per_replica, per_replica, inputs_.data(),
                  targets_.data());
    log_data_order(first, per_replica);
    for (int32_t t : targets_) valid += t != model::Transformer::kIgnoreIndex;
    groups.dp->all_reduce_sum(&valid, 1);
  }
  const float grad_scale = valid > 0 ? 1.0f / float(valid) : 0.0f;

  // The bf16 copy of the weights the step's passes read (mixed precision; a no-op in fp32): the
  // parameters changed at the last step's optimizer, a load or a switch.
  for (auto& ch : stage.chunks()) ch.model->refresh_compute_weights();
  PipelineStepResult pipe;
  {
    TraceScope scope(&tracer, "pipeline", "pipeline");
    pipe = executor->run(
        stage, *groups.pp, inputs_.data(), targets_.data(), grad_scale,
        [this](int c) { return optimizer->on_last_backward(c); }, groups.tp.get());
  }
  double norm = 0;
  {
    TraceScope scope(&tracer, "grad reduce", "comm");
    norm = optimizer->reduce_gradients();
  }
  *grad_norm = norm;
  finish_arrival();
  {
    TraceScope scope(&tracer, "optimizer", "optimizer");
    optimizer->apply(
        cfg.optimizer.adamw_step(lr_schedule.at(step), step,
                                 kernels::clip_factor(norm, float(cfg.training.grad_clip))),
        float(cfg.optimizer.weight_decay));
  }
  // The step is committed here: this rank's state is consistent at step + 1 whatever happens to
  // the loss's reduction below (a failure then loses no work of this rank).
  ++step;
  cursor += plan.global_batch();

  // The head stages hold the loss; one tp rank of each dp replica contributes it. The idle and
  // pipeline times ride along to give the world's idle share.
  double sums[3] = {groups.tp->rank() == 0 ? pipe.loss_sum : 0.0, pipe.idle_s, pipe.pipeline_s};
  {
    TraceScope scope(&tracer, "loss reduce", "comm");
    groups.world->all_reduce_sum(sums, 3);
  }
  pipeline_idle = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
  whole.reset();
  end_trace_step();
  return valid > 0 ? sums[0] / double(valid) : 0.0;
}

void RankTrainer::end_trace_step() {
  if (!tracer.active()) return;
  const auto& c = groups.coord;
  try {
    tracer.end_step(*groups.world,
                    fmt::format("rank {} (dp {}, tp {}, pp {})", rank, c.dp, c.tp, c.pp),
                    generation);
  } catch (const IoError& e) {
    // The trace is a diagnostic: losing it must not stop the training it describes.
    spdlog::warn("{}; training goes on without the trace", e.what());
  }
}

double RankTrainer::evaluate() {
  for (auto& ch : stage.chunks()) ch.model->refresh_compute_weights();
  const auto samples = eval_samples(loader_->num_eval_samples(), cfg.training.eval_batches,
                                    cfg.training.eval_batch_size());
  const EvalSums mine = evaluate_stage(stage, *groups.pp, plan, groups.coord.pp, groups.coord.dp,
                                       samples, *loader_, cfg.data.seq_len, cfg.model.n_embd);
  // One tp rank of each replica's head stage counts.
  const bool counts = groups.coord.tp == 0;
  double sums[2] = {counts ? mine.loss_sum : 0.0, counts ? double(mine.valid) : 0.0};
  groups.world->all_reduce_sum(sums, 2);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

void RankTrainer::save_checkpoint() {
  const auto& dir = cfg.checkpoint.dir;
  // The previous background save ends first on every rank (its failure handled here): past the
  // barrier below nobody writes into its staging directory any more, so rank 0 removes what a
  // failed one left (its own thread cleaned up already, unless a rank it stopped waiting for came
  // later).
  const int64_t previous = async_step_;
  const bool previous_saved = finish_checkpoint();
  if (rank == 0) std::filesystem::create_directories(dir);
  groups.world->barrier();
  if (rank == 0 && !previous_saved)
    store::cleanup_interrupted_saves(
        (std::filesystem::path(dir) / checkpoint::checkpoint_step_name(previous)).string());
  store::CheckpointWriterOptions opt;
  // The generation too: a process of a world the job replaced (its host cut off, not yet
  // fenced) saving the same step never writes into this world's staging directory.
  opt.save_id = fmt::format("{}-g{}-{}", env.job_id, generation, step);
  store::CheckpointWriter writer(
      (std::filesystem::path(dir) / checkpoint::checkpoint_step_name(step)).string(), rank, opt);
  std::vector<std::span<const float>> buffers;
  for (auto b : state_buffers()) buffers.emplace_back(b.data(), b.size());
  checkpoint::add_rank_state(writer, layout(), rank, buffers);
  // Only rank 0 commits, and only it needs the manifest's meta (which reads the data's
  // fingerprint).
  const auto meta =
      rank == 0 ? checkpoint::checkpoint_meta(cfg, plan, step, cursor) : nlohmann::json();
  if (cfg.checkpoint.async) {
    async_step_ = step;
    // The state is already copied (add_rank_state): write in the background. Rank 0 then waits
    // for every rank's file and publishes; a save that fails on any rank is reported, its files
    // are removed and the previous checkpoint stays, training goes on.
    const int world_size = plan.world();
    const auto timeout = std::chrono::milliseconds(int64_t(cfg.comm_timeout_s * 1000));
    const int keep = cfg.checkpoint.keep;
    const int r = rank;
    const std::atomic<bool>* cancelled = &save_cancelled_;
    saver_.save(std::move(writer), [world_size, meta, timeout, keep, r, dir, cancelled,
                                    cluster = env.cluster_saves, step = step](
                                       store::CheckpointWriter& w, std::exception_ptr write_error) {
      const std::string name = checkpoint::checkpoint_step_name(step);
      if (cluster && !write_error) cluster->announce(w.save_id(), name, r, w.rank_file_entry());
      if (r != 0) {
        if (write_error) std::rethrow_exception(write_error);
        return;
      }
      try {
        if (cluster) {
          // Every host's share and its copy, announced in etcd; the commit is there too.
          if (write_error) std::rethrow_exception(write_error);
          cluster->commit(w.save_id(), name, step, world_size, meta, *cancelled);
        } else {
          const auto failed = wait_for_rank_files(w.staging_dir(), world_size, timeout, *cancelled);
          if (write_error) std::rethrow_exception(write_error);
          TESSEL_CHECK(failed.empty(), IoError,
                       "rank {} could not write its share of {} (see its log)",
                       failed.empty() ? 0 : failed.front(), w.dir());
          checkpoint::publish_checkpoint(w, world_size, meta, dir, keep);
        }
      } catch (...) {
        // What the ranks wrote would fill the disk until the next start.
        store::cleanup_interrupted_saves(w.dir());
        throw;
      }
      spdlog::info("saved checkpoint {} ({:.1f} MB from this rank, in the background)", w.dir(),
                   double(w.bytes()) / 1e6);
    });
    return;
  }
  // Every rank's outcome: one rank's full disk fails the whole save, on every rank alike.
  std::string error;
  auto agree = [&] {
    int64_t failed = error.empty() ? 0 : 1;
    std::vector<int64_t> all(size_t(groups.world->size()));
    groups.world->all_gather(&failed, 1, all.data());
    return std::find(all.begin(), all.end(), 1) == all.end();
  };
  const std::string name = checkpoint::checkpoint_step_name(step);
  try {
    writer.write_rank_file();
    if (env.cluster_saves)
      env.cluster_saves->announce(writer.save_id(), name, rank, writer.rank_file_entry());
  } catch (const Error& e) {
    error = e.what();
  }
  bool saved = agree();
  if (saved && rank == 0) {
    try {
      if (env.cluster_saves)
        env.cluster_saves->commit(writer.save_id(), name, step, plan.world(), meta,
                                  save_cancelled_);
      else
        checkpoint::publish_checkpoint(writer, plan.world(), meta, dir, cfg.checkpoint.keep);
      spdlog::info("saved checkpoint {} ({:.1f} MB)", writer.dir(), double(writer.bytes()) / 1e6);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  // Nobody runs ahead (and could die) before the checkpoint is published.
  saved = agree() && saved;
  if (saved) return;
  if (rank == 0) store::cleanup_interrupted_saves(writer.dir());
  save_failed(writer.dir(), step,
              error.empty() ? "another rank could not write its share (see its log)" : error);
}

bool RankTrainer::finish_checkpoint() {
  try {
    saver_.wait();
    return true;
  } catch (const IoError& e) {
    save_failed(cfg.checkpoint.dir, async_step_, e.what());
  } catch (const TimeoutError& e) {
    // Rank 0 waited for a rank's file that a failed write never produced, nor marked as failed.
    save_failed(cfg.checkpoint.dir, async_step_, e.what());
  } catch (const PeerLostError& e) {
    // A cluster's save: etcd, or the host that was to keep a copy, could not be reached.
    save_failed(cfg.checkpoint.dir, async_step_, e.what());
  }
  return false;
}

void RankTrainer::save_failed(const std::string& dir, int64_t at_step, const std::string& why) {
  TESSEL_CHECK(cfg.checkpoint.on_error != "stop", IoError,
               "checkpoint {} could not be saved: {} (checkpoint.on_error: stop ends the job)", dir,
               why);
  std::optional<std::string> latest;
  try {
    latest = checkpoint::latest_sharded_checkpoint(cfg.checkpoint.dir);
  } catch (const Error&) {
    // `latest` names nothing readable: the message says there is no earlier checkpoint.
  }
  spdlog::error(
      "checkpoint {} not saved: {}; {}; training goes on and saves again at the next "
      "interval",
      dir, why,
      latest ? fmt::format("the previous checkpoint {} stays", *latest)
             : std::string("there is no earlier checkpoint"));
  // The run's last save: the run is incomplete.
  if (at_step >= cfg.training.end_step())
    record_incomplete_output(fmt::format("checkpoint {}: {}", dir, why));
}

// The barrier first: a member may still be finishing the previous world's background save of
// this very step. Rank 0 looks at what is published; a published checkpoint it cannot read
// (damaged on disk) is as good as none: this step is saved, and the run, which still holds its
// whole state, does not end on it.
void RankTrainer::save_checkpoint_unless_published() {
  groups.world->barrier();
  int64_t published = -1;
  if (rank == 0 && env.cluster_saves) try {
      published = env.cluster_saves->newest_step();
    } catch (const std::exception& e) {
      spdlog::warn("the cluster's checkpoints cannot be listed ({}); saving step {} anyway",
                   e.what(), step);
    }
  else if (rank == 0)
    try {
      if (const auto latest = checkpoint::latest_sharded_checkpoint(cfg.checkpoint.dir))
        published = store::CheckpointReader(*latest).meta().at("step").get<int64_t>();
    } catch (const std::exception& e) {
      spdlog::warn("the newest checkpoint cannot be read ({}); saving step {} anyway", e.what(),
                   step);
    }
  std::vector<int64_t> all(size_t(groups.world->size()));
  groups.world->all_gather(&published, 1, all.data());
  if (all[0] != step) save_checkpoint();
}

}  // namespace tessel::runtime
