// The multi-process training worker: one rank of a job laid out by a layout::Plan (dp, tp, pp).
//
// Every worker of the job runs this with the same config; its rank, the world size and the
// rendezvous store come from the environment the launcher sets (WorkerEnv::from_environment). A
// worker joins the process groups of its (dp, tp, pp) coordinate, builds one Transformer per model
// chunk it holds (pipeline rank r holds virtual stages r, r + pp, ...; each chunk a tp shard),
// initialises them with the config's seed (so every shard equals the same slice of the
// single-process model) and then, per optimizer step:
//   * loads its dp replica's contiguous slice of the global batch at the shared cursor,
//   * runs its pipeline rank's instruction list of the plan's schedule (schedule/instruction.h):
//     stage-boundary activations [B, T, C] and their gradients travel over the pp communicator,
//     tagged with (micro-batch, sending virtual stage, kind). Each chunk's Transformer has as
//     many activation slots as the chunk's peak number of micro-batches in flight in the
//     program (pp at most for 1F1B, M for GPipe), so no forward is ever recomputed;
//     Every receive of the step is posted when the step starts, so transfers overlap compute;
//   * scales every micro-batch's loss gradient by 1 / (valid tokens of the GLOBAL batch; the
//     count is all-reduced over dp), all-reduces the gradients over dp -- in buckets of
//     parallel.bucket_mb, from the end of each chunk's buffer, on a background thread with its own
//     communicator, while the chunk's last backward of the step still runs (bucketed_all_reduce.h)
//     -- and the tied embedding's two copies over the first/last pipeline ranks, clips by the
//     global norm (each element counted once: tp_primary, and the head stage's tied copy skipped),
//     and steps AdamW;
//   * with parallel.zero_stage 1 (ZeRO-1) instead: sums the tied embedding's copies first, then
//     reduce-scatters each chunk's flat gradient buffer over dp -- dp rank r owns the contiguous
//     range [r * (n / dp) + min(r, n % dp), ...) of n / dp (+1 for the first n % dp ranks)
//     elements, no padding -- takes the norm over the owned ranges (all-reduced over dp, tp and
//     pp), steps AdamW on the owned range only (Adam m/v are allocated for it alone) and
//     all-gathers the parameters over dp;
//   * forms the step's loss on every rank (all-reduce over the world of the head stages' loss
//     sums), so the losses equal the single-process ReferenceTrainer's up to float summation order.
// Rank 0 prints progress and writes the metrics and event files; every rank writes its share of
// checkpoints (sharded_checkpoint.h). Evaluation and ZeRO stages above 1 are not supported here
// (config::TrainConfig::validate_for_workers rejects them). Plans change at step boundaries by the
// timeline or by scale requests (a live switch: elastic_worker.h).
// With output.rank_params: DIR, every rank writes its local parameters to DIR/rank<R>.params at
// the end of run() (format: Stage::dump_params; used by the tests).
//
// Failures of peers surface as PeerLostError / TimeoutError from the communicators (bounded by
// parallel.timeout_s, default 60 s); config problems as ConfigError. In an elastic job
// (TESSEL_ELASTIC=1, set by `tessel train`) a process that meets such a failure does not end:
// it breaks its communicators, reports its state to the coordinator and carries out the
// coordinator's recovery (ElasticWorker::recover; docs/architecture.md, "Failures").
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessel/config/train_config.h"
#include "tessel/runtime/run_tracker.h"
#include "tessel/runtime/worker_env.h"

namespace tessel::runtime {

class ParallelTrainer {
 public:
  // Validates the config for env.world_size workers, connects the process groups and builds this
  // rank's model chunks. Blocks until every peer has connected (bounded by the store timeout).
  ParallelTrainer(config::TrainConfig config, const WorkerEnv& env);
  ~ParallelTrainer();
  ParallelTrainer(const ParallelTrainer&) = delete;
  ParallelTrainer& operator=(const ParallelTrainer&) = delete;

  // Trains until training.steps steps; every rank returns the same losses.
  TrainSummary run();
  // One optimizer step; returns the global mean loss (the same on every rank).
  double train_step();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel::runtime
