// Evaluation on the held-out samples, under any plan.
//
// Every layout evaluates the same samples (eval_samples) at the same parameters, so the eval
// loss is the same for every layout and worker count up to the forward pass' rounding. A plan's
// dp replicas split the samples' micro-batches of plan.micro_batch (micro-batch j goes to replica
// j mod dp; the last is padded with ignored targets); each replica runs them forward through its
// pipeline -- on every rank in the order (micro-batch, virtual stage), which every stage-to-stage
// dependency follows, so no rank waits on one that waits on it.
#pragma once

#include <cstdint>
#include <vector>

#include "tessel/comm/communicator.h"
#include "tessel/data/batch_loader.h"
#include "tessel/layout/plan.h"
#include "tessel/runtime/stage.h"

namespace tessel::runtime {

// The held-out samples evaluation reads, in order: `eval_batches` batches of `micro_batch` from
// the start of the held-out set (`available` samples), each batch starting where the previous
// ended, wrapping to the start, and cut short where the set ends. Throws ConfigError when there
// are no held-out samples.
std::vector<int64_t> eval_samples(int64_t available, int64_t eval_batches, int64_t micro_batch);

// Loads eval micro-batch `j` of `batch` samples of `samples` into inputs/targets ([batch, seq_len]
// each); rows past the end of `samples` get token 0 and ignored targets.
void load_eval_batch(const data::BatchLoader& loader, const std::vector<int64_t>& samples,
                     int64_t j, int64_t batch, int64_t seq_len, int32_t* inputs, int32_t* targets);

struct EvalSums {
  double loss_sum = 0;  // of this rank's head-stage micro-batches (0 on other stages)
  int64_t valid = 0;    // their valid target tokens
};

// Runs pipeline rank `pp_rank` / dp replica `dp_rank` of `plan`'s share of `samples` forward on
// `stage` (activation slot 0 of each chunk), with stage-boundary activations over `pp`.
EvalSums evaluate_stage(Stage& stage, comm::Communicator& pp, const layout::Plan& plan, int pp_rank,
                        int dp_rank, const std::vector<int64_t>& samples,
                        const data::BatchLoader& loader, int64_t seq_len, int64_t hidden);

}  // namespace tessel::runtime
