#include "tessel/runtime/run_tracker.h"

#include <fmt/format.h>

#include "tessel/core/check.h"

namespace tessel::runtime {

RunTracker::RunTracker(int64_t first_step, int64_t total_steps, int64_t log_every,
                       int64_t tokens_per_step, bool show_progress)
    : tokens_per_step_(tokens_per_step), start_(Clock::now()) {
  summary_.first_step = first_step;
  if (show_progress) progress_.emplace(total_steps, log_every);
}

void RunTracker::show_progress(bool on, int64_t total_steps, int64_t log_every) {
  if (on && !progress_) progress_.emplace(total_steps, log_every);
  if (!on) progress_.reset();
}

void RunTracker::begin_step() {
  step_start_ = Clock::now();
}

double RunTracker::elapsed_seconds() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

nlohmann::json RunTracker::end_step(int64_t step, double loss, double lr, double grad_norm,
                                    int64_t cursor) {
  TESSEL_CHECK(std::isfinite(loss), Error,
               "loss became {} at step {}: lower optimizer.lr or enable training.grad_clip", loss,
               step);
  const double dt = std::chrono::duration<double>(Clock::now() - step_start_).count();
  smoothed_step_s_ = smoothed_step_s_ == 0 ? dt : 0.9 * smoothed_step_s_ + 0.1 * dt;
  summary_.losses.push_back(loss);
  summary_.final_loss = loss;
  ++summary_.steps_run;
  const double tps = double(tokens_per_step_) / dt;
  if (progress_) progress_->step(step - 1, loss, lr, tps, smoothed_step_s_);
  // Wall-clock time the step ended (seconds since the epoch): lines of several runs (a resumed
  // job, a benchmark of pauses between steps) share one clock.
  const double unix_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  return {
      {"step", step},        {"loss", loss}, {"lr", lr},         {"grad_norm", grad_norm},
      {"tokens_per_s", tps}, {"step_s", dt}, {"cursor", cursor}, {"elapsed_s", elapsed_seconds()},
      {"time", unix_time}};
}

void RunTracker::record_eval(int64_t step, double eval_loss) {
  summary_.final_eval_loss = eval_loss;
  if (progress_) progress_->message(fmt::format("step {}: eval loss {:.4f}", step, eval_loss));
}

const TrainSummary& RunTracker::finish() {
  if (progress_) progress_->finish();
  const double elapsed = elapsed_seconds();
  summary_.tokens_per_second =
      elapsed > 0 ? double(summary_.steps_run * tokens_per_step_) / elapsed : 0;
  return summary_;
}

}  // namespace tessel::runtime
