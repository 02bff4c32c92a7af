// The reference training loop: one process, the whole model, the plain arithmetic -- the oracle
// the parallel runtime is checked against (runtime/step_check_test_util.h), as the reference
// backend is for the kernels. `tessel train` does not use it: a single worker is a world of one,
// run by ParallelTrainer like every layout.
//
// One step consumes one global batch of `training.global_batch` samples from the data cursor,
// split into micro-batches whose gradients accumulate; the loss is the mean over every valid
// target token of the global batch. Then the global gradient norm is clipped, AdamW steps every
// parameter (weight decay on matrices and embeddings only) at the scheduled learning rate, and
// the cursor advances by the global batch. Periodic evaluation, metrics, progress and checkpoints
// follow the config. Resuming from a checkpoint restores parameters, Adam moments, step and
// cursor, so a resumed run continues with exactly the losses the uninterrupted run would have.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessel/kernels/optimizer.h"

#include "tessel/config/train_config.h"
#include "tessel/runtime/run_tracker.h"

namespace tessel::model {
class Transformer;
}

namespace tessel::runtime {

class ReferenceTrainer {
 public:
  // Opens the data, builds the model and optimizer state, and resumes from the latest checkpoint
  // when the config asks for it. Throws ConfigError / IoError / CorruptDataError on bad input.
  explicit ReferenceTrainer(config::TrainConfig config);
  ~ReferenceTrainer();
  ReferenceTrainer(const ReferenceTrainer&) = delete;
  ReferenceTrainer& operator=(const ReferenceTrainer&) = delete;

  // Trains until training.steps steps have been taken in total.
  TrainSummary run();
  // Takes one optimizer step (no eval, metrics or checkpoint) and returns its mean loss.
  double train_step();

  // Continues from the checkpoint in `dir` (one saved by any number of workers under any plan):
  // parameters, Adam moments, step and cursor. Throws like a resume does (sharded_checkpoint.h).
  void load_checkpoint(const std::string& dir);

  // Called in every step with the gradients the optimizer is about to apply (the global batch's,
  // before clipping) and the step's AdamW settings (learning rate, step, and the clipping factor
  // as grad_scale; weight decay is set per parameter after this call): lets a test follow the
  // optimizer's arithmetic (testing/rounding.h).
  using GradientObserver =
      std::function<void(std::span<const float> grads, const kernels::AdamWConfig& step)>;
  void observe_gradients(GradientObserver observer);

  int64_t step() const;
  int64_t cursor() const;
  const model::Transformer& model() const;
  // AdamW's moments, laid out like model().params().
  std::span<const float> adam_m() const;
  std::span<const float> adam_v() const;
  // Mean loss over the first `training.eval_batches` micro-batches of the held-out samples.
  double evaluate();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::runtime
