// Bookkeeping shared by the training loops (ReferenceTrainer, ParallelTrainer): times each step,
// keeps the run's summary, drives the progress line and forms each step's metrics record.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessel/runtime/metrics.h"

namespace tessel::runtime {

struct TrainSummary {
  int64_t first_step = 0;  // 0, or the step resumed from
  int64_t steps_run = 0;
  double final_loss = NAN;
  double final_eval_loss = NAN;
  double tokens_per_second = 0;
  std::vector<double> losses;  // training loss of every step run, in order
};

class RunTracker {
 public:
  // `show_progress` is false on every worker but the one that reports (rank 0).
  RunTracker(int64_t first_step, int64_t total_steps, int64_t log_every, int64_t tokens_per_step,
             bool show_progress);

  // Starts or stops showing progress (the reporting worker changes when rank 0's process dies).
  void show_progress(bool on, int64_t total_steps, int64_t log_every);

  // Starts the clock of the next step.
  void begin_step();
  // Records the step just taken (`step` counts steps taken so far) and returns its metrics record.
  // Throws Error when the loss is not finite, naming the fix.
  nlohmann::json end_step(int64_t step, double loss, double lr, double grad_norm, int64_t cursor);
  void record_eval(int64_t step, double eval_loss);
  // Ends the progress line and fills in the run's throughput.
  const TrainSummary& finish();
  double elapsed_seconds() const;

 private:
  using Clock = std::chrono::steady_clock;
  int64_t tokens_per_step_;
  std::optional<ProgressLine> progress_;
  Clock::time_point start_, step_start_;
  double smoothed_step_s_ = 0;
  TrainSummary summary_;
};

}  // namespace tessel::runtime
