// This process as one rank of one generation's plan: its process groups, its stage (the model
// chunks and their state, stage.h), the pipeline executor, the optimizer step, its share of the
// data, the step and data cursor, and its checkpoint writes. A live switch of plans builds a new
// RankTrainer and moves the state into it (elastic_worker.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessel/comm/process_groups.h"
#include "tessel/config/train_config.h"
#include "tessel/data/batch_loader.h"
#include "tessel/data/token_source.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/plan.h"
#include "tessel/layout/state_layout.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/runtime/arriving_state.h"
#include "tessel/runtime/lr_schedule.h"
#include "tessel/runtime/metrics.h"
#include "tessel/runtime/optimizer_step.h"
#include "tessel/runtime/pipeline_executor.h"
#include "tessel/runtime/prepared_chunks.h"
#include "tessel/runtime/stage.h"
#include "tessel/runtime/step_trace.h"
#include "tessel/runtime/tp_comm_group.h"
#include "tessel/runtime/worker_env.h"
#include "tessel/store/async_saver.h"

namespace tessel::runtime {

class RankTrainer {
 public:
  // Joins store generation `store_generation` as rank `rank` of `plan`'s world and builds the
  // rank's stage: initialised from the seed when `init_params`, else zero (the state arrives by
  // resharding or from a checkpoint). `layout`: the plan's StateLayout when the caller has it
  // (else built here). For a live switch, `donor` is this process's old RankTrainer: chunks the
  // transfer plan keeps in place are taken over from it instead of being rebuilt (only their
  // activations are re-sized to the new micro-batching); `prepared` chunks (prepared_chunks.h)
  // are used where nothing is taken over.
  RankTrainer(const config::TrainConfig& cfg, const WorkerEnv& env, const layout::Plan& plan,
              int rank, int64_t store_generation, bool init_params,
              std::shared_ptr<const layout::StateLayout> layout = nullptr,
              RankTrainer* donor = nullptr, const reshard::TransferPlan* transfer = nullptr,
              PreparedChunks* prepared = nullptr);
  ~RankTrainer();
  RankTrainer(const RankTrainer&) = delete;
  RankTrainer& operator=(const RankTrainer&) = delete;

  // One optimizer step; returns the global mean loss (the same on every rank) and sets
  // `grad_norm` to the global gradient norm before clipping.
  double train_step(double* grad_norm);

  // The mean loss on the held-out samples (evaluation.h), the same on every rank. Collective
  // over the world.
  double evaluate();

  // Breaks every communicator (so peers waiting on this process fail at once), stops a
  // background save from waiting for the other ranks' files, drops the step's transfers.
  void abort(const std::string& why) noexcept;
  // Gives the chunk state this rank took over from `donor` back to it (a switch failed).
  void give_back(RankTrainer& donor);
  // Frees what a switch does not keep (stage.h: release_unkept) and stops the overlapped
  // all-reduce that points at it.
  void release_unkept(const std::vector<bool>& kept);

  // Saves the whole state as checkpoint.dir/step-N (checkpoint/sharded_checkpoint.h): every
  // rank writes its share, then rank 0 publishes it. Collective over the world. A save that
  // fails on any rank (a full disk) is abandoned by all: its files are removed, the previous
  // checkpoint stays, and checkpoint.on_error says whether training goes on (the failure logged,
  // and kept as an incomplete output when it was the run's last save) or IoError ends it.
  void save_checkpoint();
  // Ends the background save, if one runs; its failure is handled as above. False when it
  // failed.
  bool finish_checkpoint();
  // Saves this step's checkpoint unless checkpoint.dir has it published already (collective).
  void save_checkpoint_unless_published();

  void save_failed(const std::string& dir, int64_t at_step, const std::string& why);

  // This rank's buffers in StateLayout order (complete: after finish_arrival()).
  std::vector<std::span<float>> state_buffers() {
    finish_arrival();
    return stage.state_buffers();
  }
  const layout::StateLayout& layout() const { return stage.layout(); }
  // True while a ZeRO-1 update is half applied (owned range stepped, parameters not yet
  // gathered), and after the optimizer state a switch was moving here failed to arrive: a
  // failure then leaves this rank's state inconsistent.
  bool updating() const { return optimizer->updating() || state_incomplete_; }
  // Waits for the optimizer state still arriving from a switch (`arriving`), if any; rethrows
  // the transfer's error (the state is then incomplete, see updating()). Called before the first
  // optimizer update and before anything reads or replaces the state.
  void finish_arrival();

  const config::TrainConfig& cfg;
  WorkerEnv env;
  layout::Plan plan;            // defaults applied
  int rank = 0;                 // in this generation's world
  double groups_connect_s = 0;  // how long connecting `groups` took (part of a switch's pause)
  comm::ProcessGroups groups;
  std::unique_ptr<CommTpGroup> tp_group;
  // Shared with the next generation's RankTrainer, which may take over models that refer to it.
  std::shared_ptr<kernels::Backend> backend;
  std::shared_ptr<const data::TokenSource> source;  // the training data
  std::unique_ptr<PipelineExecutor> executor;
  Stage stage;
  std::unique_ptr<OptimizerStep> optimizer;
  LrSchedule lr_schedule;
  int64_t step = 0, cursor = 0;  // steps done; samples of the global order consumed
  int generation = 0;            // the job's generation this rank belongs to
  MetricsWriter metrics;         // output.metrics (rank 0)
  double pipeline_idle = 0;      // last step: share of the pipeline phase all ranks spent waiting
  StepTracer tracer;             // output.trace
  bool cancelled_save_checked = false;  // see ParallelTrainer::run
  // The optimizer state the switch into this world still moves here (arriving_state.h).
  std::unique_ptr<ArrivingState> arriving;

 private:
  // Ends the step's trace slices; when the output.trace window is complete, gathers and writes
  // it (collective over the world).
  void end_trace_step();
  // One line of output.data_order for the samples this replica has just loaded for step + 1.
  void log_data_order(int64_t first, int64_t count) const;

  // Makes every model of the stage stop at its next layer once abort_signal_ fires.
  void install_layer_hooks();

  // This generation's abort signal (elastic processes; null for a fixed launch).
  std::shared_ptr<comm::AbortSignal> abort_signal_;
  bool state_incomplete_ = false;  // the arriving optimizer state did not all arrive
  std::unique_ptr<data::BatchLoader> loader_;
  std::vector<int32_t> inputs_, targets_;  // this replica's share of the global batch
  // Set when a peer failed: a background save then stops waiting for the other ranks' files.
  std::atomic<bool> save_cancelled_{false};
  int64_t async_step_ = -1;  // the step of the newest background save
  store::AsyncSaver saver_;  // checkpoint.async (after save_cancelled_: its thread reads it)
  int data_log_fd_ = -1;     // output.data_order, on the first tp and pp rank of each replica
};

}  // namespace tessel::runtime
