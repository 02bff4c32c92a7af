// What one rank of a plan holds, known from the plan alone, and its buffers built ahead of a
// switch.
//
// A live switch used to build its successor's model chunks and Adam moments during the pause.
// Most of that time is the allocation and first touch of fresh memory (on a VM whose host backs
// guest memory lazily, seconds per GiB: bench/README.md, elastic). For a switch known in advance
// (a timeline entry, elastic.prepare_steps ahead), prepare_chunks() builds them while the job
// still trains -- on a background thread of a survivor, or in a process started early for the
// switch -- so the pause holds only the transfer. Nothing here needs a communicator: the pipeline
// coordinate, the schedule's activation slots and the ZeRO-1 split (layout/zero_split.h) all
// follow from (plan, rank).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/plan.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/transformer.h"
#include "tessel/tensor/tensor.h"

namespace tessel::runtime {

// The model chunks and Adam moments of one rank of a plan, built before that rank's world
// exists. Tensor-parallel models are built against a stand-in group of the right rank and size
// (its collectives throw); the world rebinds them to its communicators (rebind_tp_group).
struct PreparedChunks {
  std::shared_ptr<kernels::Backend> backend;   // the models run on it; it outlives them
  std::unique_ptr<model::TpGroup> unbound_tp;  // the stand-in, until the models are rebound
  // Per chunk of the rank; null / undefined where nothing was prepared.
  std::vector<std::unique_ptr<model::Transformer>> models;
  std::vector<Tensor> adam_m, adam_v;
};

// Builds rank `rank` of `plan` (defaults applied as a RankTrainer does) on `backend`: every chunk c
// with !skip[c] (skip may be empty: nothing skipped) gets its Transformer (parameters zero, every
// buffer touched) and its zeroed Adam moments (ZeRO-1: the owned range only). Throws what the
// Transformer constructor throws (ConfigError, UnsupportedError).
PreparedChunks prepare_chunks(const config::TrainConfig& cfg, const layout::Plan& plan, int rank,
                              std::shared_ptr<kernels::Backend> backend,
                              const std::vector<bool>& skip);

}  // namespace tessel::runtime
