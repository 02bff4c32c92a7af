// The optimizer step of one rank after its pipeline ran: the gradients reduced over data
// parallelism and the tied embedding's two copies, the global gradient norm, clipping and AdamW.
//
//  * dp > 1 without ZeRO: the gradients are all-reduced over dp in buckets of parallel.bucket_mb,
//    from the end of each chunk's buffer, on a background thread with its own communicator, while
//    the chunk's last backward of the step still runs (comm/bucketed_all_reduce.h); then the tied
//    embedding's copies are summed over the first and last pipeline ranks.
//  * ZeRO-1: the tied embedding's copies are summed first, then each chunk's flat gradient
//    buffer is reduce-scattered over dp (layout/zero_split.h: dp rank r owns a contiguous range),
//    AdamW steps the owned range only (the moments exist for it alone), and the parameters are
//    all-gathered over dp.
// The norm counts each element once (tp_primary views; the head stage's tied copy skipped), summed
// over dp (ZeRO-1's ranges are distinct), tp and pp.
#pragma once

#include <memory>

#include "tessel/comm/bucketed_all_reduce.h"
#include "tessel/comm/process_groups.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/optimizer.h"
#include "tessel/layout/plan.h"
#include "tessel/runtime/stage.h"

namespace tessel::runtime {

class OptimizerStep {
 public:
  // For `stage` of a rank of `plan` (defaults applied) in `groups`; the overlapped dp all-reduce
  // uses buckets of `bucket_mb` MiB.
  OptimizerStep(Stage& stage, const layout::Plan& plan, comm::ProcessGroups& groups,
                kernels::Backend& backend, double bucket_mb);

  // What reports chunk c's finished gradients during its last backward of the step (the
  // pipeline executor's hook), or an empty function.
  model::Transformer::GradsReady on_last_backward(int chunk);

  // Completes the gradient reductions; returns the global gradient norm (before clipping).
  double reduce_gradients();

  // Steps AdamW with `opt` (its weight_decay applies to the views that take it) and, under
  // ZeRO-1, gathers the parameters. `updating()` is true in between: a failure then leaves this
  // rank's state inconsistent.
  void apply(kernels::AdamWConfig opt, float weight_decay);
  bool updating() const { return updating_; }

  // Stops the overlapped all-reduce (it points at gradients a switch is about to free).
  void release() { grad_reduce_.reset(); }

 private:
  Stage& stage_;
  const layout::Plan& plan_;
  comm::ProcessGroups& groups_;
  kernels::Backend& backend_;
  std::unique_ptr<comm::BucketedAllReduce> grad_reduce_;
  std::vector<int> bucket_ids_;  // per chunk, its gradient buffer in grad_reduce_
  bool updating_ = false;
};

}  // namespace tessel::runtime
