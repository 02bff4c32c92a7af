// A pipeline rank's share of the model: its chunks (virtual stages), each a Transformer shard with
// its parameters and gradients, and the Adam moments of the range this rank steps.
//
// The buffers are those StateLayout (layout/state_layout.h) lists for the rank: per chunk its
// parameters, Adam m and Adam v, in that order; with ZeRO-1 the moments cover only the rank's
// owned range of the chunk's flat buffer (layout/zero_split.h). A stage built for a live switch
// takes over, instead of rebuilding, the chunks and moments the transfer plan keeps in place, and
// can give them back if the switch fails.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tessel/config/train_config.h"
#include "tessel/kernels/backend.h"
#include "tessel/layout/plan.h"
#include "tessel/layout/state_layout.h"
#include "tessel/layout/training_state.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/transformer.h"
#include "tessel/reshard/transfer_plan.h"
#include "tessel/runtime/prepared_chunks.h"
#include "tessel/tensor/tensor.h"

namespace tessel::runtime {

// One model chunk (virtual stage) of a pipeline rank.
struct Chunk {
  int vs = 0;  // its virtual stage in the whole pipeline
  model::StageRange range;
  std::unique_ptr<model::Transformer> model;
  Tensor adam_m, adam_v;          // ZeRO-1: only the owned range [own_lo, own_lo + own_n)
  std::vector<size_t> dp_counts;  // ZeRO-1: the flat buffer's split over dp ranks
  int64_t own_lo = 0, own_n = 0;
  int tied_view = -1;      // the token embedding's view when its two copies are summed
  bool tied_copy = false;  // the head stage's copy (left out of the gradient norm)
  // Activation slots: slot_of[mb] is the slot holding micro-batch mb's activations (-1: none);
  // a forward takes a free slot, its backward gives it back.
  int slots = 1;  // activation slots: the schedule's peak of micro-batches in flight
  std::vector<int> slot_of;
  std::vector<int> free_slots;
  int backwards_done = 0;  // this step's backwards so far (the M-th completes the gradients)

  // The chunk's state buffer of `kind` (param, adam_m or adam_v).
  std::span<float> state(layout::StateKind kind);
};

class Stage;

// Where a stage built for a live switch may take its chunks from instead of building them.
struct StageSources {
  Stage* donor = nullptr;                           // the old world's stage of this process
  const reshard::TransferPlan* transfer = nullptr;  // what the switch keeps in place
  PreparedChunks* prepared = nullptr;               // built ahead for this rank
};

class Stage {
 public:
  // Builds the buffers `layout` lists for `rank`: one Transformer per chunk (micro-batch
  // `micro_batch`, `slots[c]` activation slots for chunk c: the schedule's peak in flight) on
  // `backend`, and the chunk's Adam moments. Parameters come from the seed when `init_params`,
  // else they are zero (the state arrives by resharding or from a checkpoint).
  Stage(const config::TrainConfig& cfg, std::shared_ptr<const layout::StateLayout> layout, int rank,
        int micro_batch, kernels::Backend& backend, model::TpGroup* tp,
        const std::vector<int>& slots, bool init_params, StageSources sources = {});

  const layout::StateLayout& layout() const { return *layout_; }
  int rank() const { return rank_; }
  int micro_batch() const { return micro_batch_; }

  std::vector<Chunk>& chunks() { return chunks_; }
  const std::vector<Chunk>& chunks() const { return chunks_; }

  // This rank's buffers in StateLayout order: per chunk its parameters, Adam m, Adam v.
  std::vector<std::span<float>> state_buffers();

  // Gives the chunks and moments taken over from `donor` back to it (a switch failed), bound to
  // the donor's tensor-parallel group again.
  void give_back(Stage& donor, model::TpGroup* donor_tp);

  // Frees the gradients and activations of the chunks not marked in `kept` (they are not state;
  // a switch needs the memory).
  void release_unkept(const std::vector<bool>& kept);

  // Writes <dir>/rank<R>.params: for every parameter view of every chunk, a text line
  // "<name> <numel> <tp_rank> <tp_size>\n" followed by numel raw native floats (this rank's local
  // shard; tensor-parallel shards are not reassembled). For tests (output.rank_params).
  void dump_params(const std::string& dir, int tp_rank, int tp_size) const;

 private:
  // State taken over from the donor of a switch: (chunk, donor chunk, kind).
  struct Taken {
    int chunk = 0, donor_chunk = 0;
    layout::StateKind kind = layout::StateKind::param;
  };
  std::shared_ptr<const layout::StateLayout> layout_;
  int rank_ = 0;
  int micro_batch_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<Taken> taken_;
};

}  // namespace tessel::runtime
