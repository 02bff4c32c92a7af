#include "tessel/runtime/parallel_trainer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/runtime/elastic_worker.h"
#include "tessel/runtime/metrics.h"

namespace tessel::runtime {

struct ParallelTrainer::Impl : ElasticWorker {
  using ElasticWorker::ElasticWorker;
};

ParallelTrainer::ParallelTrainer(config::TrainConfig config, const WorkerEnv& env)
    : impl_(std::make_unique<Impl>(std::move(config), env)) {}
ParallelTrainer::~ParallelTrainer() = default;

double ParallelTrainer::train_step() {
  TESSEL_CHECK(impl_->world != nullptr, InvalidArgumentError,
               "process {} has no rank in the current plan", impl_->env.rank);
  double norm = 0;
  return impl_->world->train_step(&norm);
}

namespace {

// `tessel eval`: one evaluation of the weights the world started from, on every rank (it is
// collective); rank 0 reports it as a line of text and one of JSON.
void evaluate_only(RankTrainer& w, const config::TrainConfig& cfg) {
  const auto start = std::chrono::steady_clock::now();
  const double loss = w.evaluate();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (w.rank == 0) {
    const std::string weights =
        cfg.init_from.empty() ? fmt::format("the seed {}", cfg.training.seed) : cfg.init_from;
    std::printf(
        "eval loss %.4f nats/token (perplexity %.2f) on the held-out samples of %s, %s, "
        "in %.1f s; weights: %s\n",
        loss, std::exp(loss), cfg.data.path.c_str(), w.plan.describe().c_str(), seconds,
        weights.c_str());
    const nlohmann::json line = {{"eval_loss", loss},     {"perplexity", std::exp(loss)},
                                 {"data", cfg.data.path}, {"plan", w.plan.describe()},
                                 {"weights", weights},    {"seconds", seconds}};
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  // Nobody leaves before everyone is done with the evaluation's collectives.
  w.groups.world->barrier();
}

}  // namespace

TrainSummary ParallelTrainer::run() {
  auto& s = *impl_;
  const auto& cfg = s.cfg;
  const int64_t tokens_per_step = cfg.training.global_batch * cfg.data.seq_len;
  if (s.lead() && cfg.eval_only) {
    spdlog::info("evaluating {} ({:.3g} parameters) on {} worker{} ({})", cfg.model.name,
                 double(cfg.model.num_params()), s.world->plan.world(),
                 s.world->plan.world() == 1 ? "" : "s", s.world->plan.describe());
  } else if (s.lead()) {
    spdlog::info(
        "training {} ({:.3g} parameters) on {} worker{} ({}) for {} steps, {} tokens per "
        "step, backend {}",
        cfg.model.name, double(cfg.model.num_params()), s.world->plan.world(),
        s.world->plan.world() == 1 ? "" : "s", s.world->plan.describe(), cfg.training.steps,
        tokens_per_step, s.world->backend->name());
  }
  bool described = false;
  RunTracker tracker(s.world ? s.world->step : 0, cfg.training.steps, cfg.training.log_every,
                     tokens_per_step, s.lead());
  // In an elastic job a failed peer (PeerLostError, TimeoutError) is not the end: the process
  // recovers (Impl::recover) and goes on in the generation the coordinator decides.
  std::optional<std::string> failed;
  std::string failed_kind;  // Error::kind() of what failed: the decider ranks the reports by it
  for (;;) {
    try {
      if (failed) {
        const std::string what = *failed;
        failed.reset();
        s.recover(what, failed_kind);
      } else if (s.joining) {
        std::optional<elastic::Reconfiguration> sw = std::move(s.joining);
        s.joining.reset();
        // Started for a switch: wait for its go (a recovery's processes join at once).
        if (!sw->recovery) sw = s.await_switch(*sw);
        if (!sw) break;  // overtaken by a failure recovery: not needed
        s.transition(*sw);
      }
      // A checkpoint is due after a step that checkpoint.every divides, and after the last.
      auto due = [&](int64_t step) {
        const auto& ck = cfg.checkpoint;
        return !ck.dir.empty() && step > 0 &&
               ((ck.every > 0 && step % ck.every == 0) || step == cfg.training.end_step());
      };
      // A failure while a due checkpoint was being written cancels that save; the world its
      // recovery made, standing at that step, writes it again. Once per world (a collective).
      auto resave_cancelled = [&](RankTrainer& w) {
        if (w.cancelled_save_checked) return;
        w.cancelled_save_checked = true;
        if (due(w.step)) w.save_checkpoint_unless_published();
      };
      // The job stops before its last step (a preemption notice): the state at this boundary is
      // saved -- waiting for any background save first -- so that a restart resumes here.
      auto save_and_stop = [&](RankTrainer& w) {
        w.finish_checkpoint();
        if (!cfg.checkpoint.dir.empty()) {
          w.save_checkpoint_unless_published();
          w.finish_checkpoint();
        }
        if (w.rank != 0) return;
        if (cfg.checkpoint.dir.empty())
          spdlog::warn("stopping after step {}: no checkpoint.dir, so nothing is saved", w.step);
        else
          spdlog::warn(
              "stopping after step {}: saved {}", w.step,
              (std::filesystem::path(cfg.checkpoint.dir) / checkpoint::checkpoint_step_name(w.step))
                  .string());
      };
      // The launcher that served the control store is gone (s.orphaned): nobody is left to decide
      // anything, so the world saves the state at this boundary as for a stop, and leaves.
      // checkpoint.dir's lock died with the launcher; rank 0 takes it over first. When it cannot,
      // a `tessel train` was started again meanwhile and resumes from what was published
      // before: nobody writes beside it.
      auto save_and_leave = [&](RankTrainer& w) {
        s.heartbeat.reset();  // no store to renew it in: only failures would be logged
        const std::string gone = s.launcher_gone_message();
        const auto& dir = cfg.checkpoint.dir;
        std::unique_ptr<checkpoint::CheckpointDirLock> lock;
        std::string refused =
            dir.empty() ? "there is no checkpoint.dir, so running the same command starts over"
                        : "";
        if (w.rank == 0 && !dir.empty()) try {
            lock = checkpoint::lock_checkpoint_dir(dir);
          } catch (const Error& e) {
            refused = fmt::format(
                "checkpoint.dir is not this job's any more ({}); the steps since its newest "
                "checkpoint are lost",
                e.what());
          }
        int64_t locked = refused.empty() ? 1 : 0;
        std::vector<int64_t> all(size_t(w.groups.world->size()));
        w.groups.world->all_gather(&locked, 1, all.data());
        w.finish_checkpoint();  // a background save of an earlier step publishes first
        if (all[0] == 0) {
          if (w.rank == 0)
            spdlog::warn("{}: nothing saved after step {}: {}", gone, w.step, refused);
          else
            spdlog::info("process {}: {}: leaving, nothing saved", s.env.rank, gone);
          return;
        }
        w.save_checkpoint_unless_published();
        w.finish_checkpoint();
        if (w.rank != 0) {
          spdlog::info("process {}: {}: saved its share of step {}; leaving", s.env.rank, gone,
                       w.step);
          return;
        }
        // A save that failed was reported by save_checkpoint: say what a restart resumes from.
        const std::string path =
            (std::filesystem::path(dir) / checkpoint::checkpoint_step_name(w.step)).string();
        std::optional<std::string> latest;
        try {
          latest = checkpoint::latest_sharded_checkpoint(dir);
        } catch (const std::exception&) {
          // Reported below as none.
        }
        if (latest == path)
          spdlog::warn("{}: saved step {} to {}; run the same command to resume", gone, w.step,
                       path);
        else
          spdlog::error("{}: step {} could not be saved (see above); {}", gone, w.step,
                        latest ? fmt::format("run the same command to resume from {}", *latest)
                               : std::string("there is no checkpoint to resume from"));
      };
      if (cfg.eval_only && s.world) {
        evaluate_only(*s.world, cfg);
        break;
      }
      while (s.world && s.world->step < cfg.training.end_step()) {
        resave_cancelled(*s.world);
        // A world entered at a step boundary (a switch, a recovery, joining one) may have more
        // switches due there (a scale request's, then the timeline's). Every process of the new
        // world came through transition(), so all of them ask here, in step.
        if (std::exchange(s.entered, false)) {
          if (auto sw = s.next_switch()) {
            s.transition(*sw);
            continue;
          }
          if (s.stopping) break;
        }
        RankTrainer& w = *s.world;
        tracker.show_progress(s.lead(), cfg.training.steps, cfg.training.log_every);
        tracker.begin_step();
        double lr = w.lr_schedule.at(w.step);
        double grad_norm = 0;
        double loss = w.train_step(&grad_norm);
        nlohmann::json record = tracker.end_step(w.step, loss, lr, grad_norm, w.cursor);
        // The run's first record (of this launch) says what is trained, for readers of the file
        // alone (`tessel report`).
        if (!described) {
          record["model"] = cfg.model.name;
          record["params"] = cfg.model.num_params();
          described = true;
        }
        if (w.plan.pp > 1) record["pipeline_idle"] = w.pipeline_idle;
        if (s.generation > 0) record["generation"] = s.generation;
        record["workers"] = w.plan.world();
        const auto& tr = cfg.training;
        if (tr.eval_every > 0 && (w.step % tr.eval_every == 0 || w.step == tr.end_step())) {
          const double eval_loss = w.evaluate();
          record["eval_loss"] = eval_loss;
          tracker.record_eval(w.step, eval_loss);
        }
        if (w.rank == 0) w.metrics.write(record);
        if (due(w.step)) w.save_checkpoint();
        if (w.step >= cfg.training.end_step()) break;
        if (auto sw = s.next_switch()) {
          s.transition(*sw);
          // A worker the new plan does not need leaves; `tessel train` starts a fresh process
          // when a later plan needs one again.
          if (s.world == nullptr) break;
        }
        if (s.stopping) break;
      }
      if (s.world && s.orphaned) {
        save_and_leave(*s.world);
      } else if (s.world && s.stopping) {
        save_and_stop(*s.world);
      } else if (s.world) {
        RankTrainer& w = *s.world;
        w.finish_checkpoint();
        resave_cancelled(w);  // a world a recovery made at the last step
        if (!cfg.rank_params_dir.empty())
          w.stage.dump_params(cfg.rank_params_dir, w.groups.coord.tp, w.plan.tp);
        // Nobody leaves before everyone is done with the last step's collectives.
        w.groups.world->barrier();
      }
      break;
    } catch (const CoordinatorLostError&) {
      throw;  // nobody is left to recover with: the process leaves, saying why
    } catch (const PeerLostError& e) {
      if (!s.elastic()) throw;
      failed = e.what();
      failed_kind = e.kind();
    } catch (const TimeoutError& e) {
      if (!s.elastic() || s.fatal) throw;
      failed = e.what();
      failed_kind = e.kind();
    }
    // Before anything else: peers blocked on this process must fail now, not at their timeout.
    if (s.world) s.world->abort(*failed);
  }
  const double elapsed = tracker.elapsed_seconds();
  const TrainSummary& summary = tracker.finish();
  // The training is done (and checkpointed), but a run whose metrics or events could not all be
  // written is not a success: say which, and why.
  if (const auto lost = incomplete_outputs(); !lost.empty()) {
    std::string list;
    for (const auto& l : lost) list += (list.empty() ? "" : "; ") + l;
    TESSEL_THROW(IoError, "training finished, but its outputs are incomplete: {}", list);
  }
  if (s.world == nullptr) return summary;  // left the job at a switch
  RankTrainer& w = *s.world;
  if (s.stopping) return summary;  // stopped early: the launcher says so
  if (w.rank == 0 && summary.steps_run > 0) {
    const std::string eval = std::isnan(summary.final_eval_loss)
                                 ? std::string()
                                 : fmt::format(", eval loss {:.4f}", summary.final_eval_loss);
    const std::string workers =
        w.plan.world() > 1 ? fmt::format(" on {} workers", w.plan.world()) : std::string();
    std::printf("done: %lld steps in %s%s, final loss %.4f%s, %s tokens/s\n",
                static_cast<long long>(summary.steps_run), format_duration(elapsed).c_str(),
                workers.c_str(), summary.final_loss, eval.c_str(),
                format_rate(summary.tokens_per_second).c_str());
  }
  return summary;
}

}  // namespace tessel::runtime
