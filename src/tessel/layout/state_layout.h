// StateLayout: where every element of the training state lives under a Plan.
//
// Derived from the model config and the plan alone (no shape files), it describes, for every rank
// of the plan, the local float buffers the runtime keeps and how they map onto the logical state
// (training_state.h: a tensor of ModelSpec::from(config), a StateKind, a box of the tensor).
//
// Buffers (exactly ParallelTrainer's memory layout). Rank r with coordinate (dp, tp, pp) holds
// chunks c = 0 .. virtual_stages-1, chunk c being virtual stage plan.stage_of(pp, c). A chunk's
// *flat parameter space* is the Transformer's flat parameter buffer: the tp-local shards of
// ModelSpec::for_stage(stage range) in that order, back to back (tp_shard.h decides the shards:
// column / row / vocab splits, per-head fused QKV, split or replicated GQA kv heads, replicated
// norms and positions; with tied embeddings a head stage that lacks the embedding holds a copy of
// the token embedding). Per (chunk, kind) the rank has ONE flat buffer, in the order
//   chunk 0: kinds[0], kinds[1], ...; chunk 1: ...
// holding the elements [chunk_begin, chunk_begin + numel) of the chunk's flat space:
//   - param: the whole space (dp replicas hold identical copies);
//   - optimizer state (master, adam_m, adam_v): the whole space, or under ZeRO-1 the dp rank's
//     contiguous range: with n elements and dp ranks, dp rank d owns
//     [d * (n / dp) + min(d, n % dp), +n / dp + (d < n % dp)) -- no padding, possibly empty.
// Vocabulary padding rows (>= vocab_size of the padded embedding / head) are ordinary state here.
//
// Pieces. Every buffer is tiled exactly by pieces; a piece is one box of one logical tensor (one
// kind) stored in one buffer as a strided region (row-major tp shard strides). A shard of a tp
// split gives one piece per ShardPiece (three for per-head fused QKV); a ZeRO-1 range that cuts a
// shard mid-way is decomposed into boxes first (flat_range_boxes: partial first row, full rows,
// partial last row, recursively over the dimensions). Over all ranks, the pieces of (tensor,
// kind) cover the tensor; an element held by several ranks (dp, tp replicas, tied copies) appears
// in several pieces: replicas() finds them.
//
// Valid layouts never hold one element of one kind twice on one rank. A StateLayout is an
// immutable value; copying it is cheap enough (sizes are in pieces, not elements).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "tessel/layout/plan.h"
#include "tessel/layout/training_state.h"
#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/tensor/box.h"
#include "tessel/tensor/shape.h"
#include "tessel/tensor/strided_region.h"

namespace tessel::layout {

// The elements [begin, end) in row-major flat order of an array of `shape`, as disjoint boxes in
// flat order: per dimension a partial leading block, a run of whole slices, a partial trailing
// block. Empty for begin >= end. Throws InvalidArgumentError when the range leaves the array.
std::vector<Box> flat_range_boxes(const Shape& shape, int64_t begin, int64_t end);

// The kinds a layout holds unless told otherwise: parameters and Adam's moments.
inline const std::vector<StateKind>& default_state_kinds() {
  static const std::vector<StateKind> kinds = {StateKind::param, StateKind::adam_m,
                                               StateKind::adam_v};
  return kinds;
}

// One local buffer of a rank.
struct BufferInfo {
  int chunk = 0;  // the rank's model chunk
  int stage = 0;  // the virtual pipeline stage that chunk is
  StateKind kind = StateKind::param;
  int64_t numel = 0;        // floats in the buffer (0 is possible under ZeRO-1)
  int64_t chunk_begin = 0;  // first element of the chunk's flat space it holds
  int64_t chunk_numel = 0;  // size of the chunk's flat space (Transformer::num_params())
  bool operator==(const BufferInfo&) const = default;
};

// A box of one kind of one logical tensor, stored in one buffer of one rank.
struct StatePiece {
  int tensor = 0;  // index into StateLayout::spec()
  StateKind kind = StateKind::param;
  Box global;  // in the tensor's (global, padded) index space
  int rank = 0;
  int buffer = 0;                // index into StateLayout::buffers(rank)
  int64_t offset = 0;            // flat index in the buffer of the element global.lo()
  std::vector<int64_t> strides;  // buffer strides along the box's dimensions

  // Where the sub-box `sub` (contained in `global`) lies in the buffer (tensor/box_copy.h copies
  // it).
  StridedRegion region(const Box& sub) const;
  StridedRegion region() const { return region(global); }
  bool operator==(const StatePiece&) const = default;
};

class StateLayout {
 public:
  // Packed row-major values of `box` of a tensor, one kind (out has box.volume() floats).
  using BoxSource = std::function<void(const model::ParamSpec& tensor, StateKind kind,
                                       const Box& box, float* out)>;

  // The layout of `plan` (empty layers_per_stage filled with the default split) for `config`,
  // holding `kinds` (distinct). Throws ConfigError when the plan cannot lay out the model: tp not
  // splitting it (validate_tp), a bad stage cut, zero_stage other than 0 / 1, non-positive
  // degrees, or more than one stage per pipeline rank with pp == 1 and tied embeddings (a rank
  // would hold the embedding twice).
  static StateLayout build(const model::ModelConfig& config, const Plan& plan,
                           const std::vector<StateKind>& kinds = default_state_kinds());

  const model::ModelConfig& config() const { return spec_.config(); }
  // The whole model, global shapes; StatePiece::tensor indexes it.
  const model::ModelSpec& spec() const { return spec_; }
  const Plan& plan() const { return plan_; }
  const std::vector<StateKind>& kinds() const { return kinds_; }
  bool has_kind(StateKind k) const;
  int world() const { return plan_.world(); }

  // Rank r's buffers; buffer ids index this vector. Throws InvalidArgumentError for a bad rank.
  const std::vector<BufferInfo>& buffers(int rank) const;
  // The id of (chunk, kind) on `rank`, or -1 when the layout lacks the kind.
  int buffer_id(int rank, int chunk, StateKind kind) const;
  // Rank r's pieces, grouped by buffer in buffer order, each buffer's in ascending offset.
  std::span<const StatePiece> pieces(int rank) const;
  // Floats rank r holds, all buffers together.
  int64_t numel(int rank) const;

  // Every piece (over all ranks, in rank order) of (tensor, kind) whose box meets `box`; all of
  // them for an empty box argument of rank 0 (Box()). Throws InvalidArgumentError for an unknown
  // tensor or a kind the layout lacks.
  std::vector<const StatePiece*> replicas(int tensor, StateKind kind, const Box& box = {}) const;
  std::vector<const StatePiece*> replicas(std::string_view tensor, StateKind kind,
                                          const Box& box = {}) const;

  // Writes rank r's state into its buffers (buffers.size() == buffers(rank).size(), each of at
  // least its numel floats): every piece's box is asked of `source` and scattered into place.
  // Throws InvalidArgumentError for buffers of the wrong count or size.
  void fill(int rank, const BoxSource& source, const std::vector<std::span<float>>& buffers) const;

 private:
  model::ModelSpec spec_;
  Plan plan_;
  std::vector<StateKind> kinds_;
  std::vector<std::vector<BufferInfo>> buffers_;  // per rank
  std::vector<StatePiece> pieces_;                // all ranks, rank-major
  std::vector<size_t> rank_begin_;                // world + 1 offsets into pieces_
  std::vector<std::vector<size_t>> by_state_;     // [tensor * 4 + kind] -> indices into pieces_
};

}  // namespace tessel::layout
