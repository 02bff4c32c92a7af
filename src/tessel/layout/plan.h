// Plan: how one training job is laid out over its workers (a plain value type).
//
// A plan fixes the 3D-parallel degrees (dp data, tp tensor, pp pipeline), the number of virtual
// pipeline stages per pipeline rank, the micro-batching, the pipeline schedule, the ZeRO stage,
// activation recompute, how the model is cut into pipeline stages and how ranks map to (dp, tp,
// pp) coordinates. It is read from the YAML config by the runtime, stored in checkpoints and sent
// between processes as JSON (to_json / plan_from_json).
//
// Pipeline stages. The model is a sequence of n_layer + 2 *units*: unit 0 is the embedding (token
// and position embeddings), units 1..n_layer are the transformer blocks 0..n_layer-1, and unit
// n_layer + 1 is the head (final norm, LM head and loss). The plan cuts that sequence into
// num_stages() = pp * virtual_stages consecutive, non-empty pieces; layers_per_stage[s] is the
// number of units in piece s. A piece may hold only the embedding or only the head (so gpt2-tiny,
// 6 layers, can run with 8 stages of one unit each).
//
// Virtual stages (interleaved 1F1B, as in Megatron-LM): stage s lives on pipeline rank s % pp as
// that rank's chunk s / pp, so each pipeline rank holds virtual_stages pieces spread along the
// model. With virtual_stages == 1, stage s is simply pipeline rank s.
//
// Rank order. A rank r in [0, world()) has the coordinate (dp, tp, pp). With the default order
// tp_dp_pp, tp varies fastest (tensor-parallel peers are neighbouring ranks, i.e. on one host),
// then dp, then pp:  r = (pp * dp_size + dp) * tp_size + tp.  dp_tp_pp makes dp fastest instead:
// r = (pp * tp_size + tp) * dp_size + dp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessel/model/model_config.h"
#include "tessel/model/recompute.h"
#include "tessel/model/stage_range.h"

namespace tessel::layout {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved_one_f_one_b, zb_h1, zb_v, adaptive };
// "gpipe" / "1f1b" / "interleaved-1f1b" / "zb-h1" / "zb-v" (schedule/named.h), or "adaptive".
// zb-v places its two chunks per rank as a V (schedule/instruction.h): rank r holds virtual
// stages r and 2 pp - 1 - r, so rank 0 holds the embedding and the head. adaptive has no fixed
// lists: every pipeline rank picks its next compute from what has arrived
// (schedule/dispatcher.h), with split backward passes whose weight halves fill idle time, under
// Plan::memory_cap; placed as interleaved (any virtual_stages).
std::string_view schedule_name(ScheduleKind s);
// Throws ConfigError listing the known names.
ScheduleKind parse_schedule(std::string_view name);

// Named innermost (fastest varying) first.
enum class RankOrder { tp_dp_pp, dp_tp_pp };
// "tp-dp-pp" / "dp-tp-pp".
std::string_view rank_order_name(RankOrder o);
// Throws ConfigError listing the known names.
RankOrder parse_rank_order(std::string_view name);

// A worker's place in the 3D grid: its data-parallel replica, tensor-parallel shard and pipeline
// rank.
struct Coord {
  int dp = 0;
  int tp = 0;
  int pp = 0;
  bool operator==(const Coord&) const = default;
};

struct Plan {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int virtual_stages = 1;     // model chunks per pipeline rank; > 1 only for interleaved 1F1B
  int64_t micro_batch = 1;    // samples per forward/backward on one dp replica
  int64_t micro_batches = 1;  // micro-batches per optimizer step on one dp replica
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  int zero_stage = 0;  // 0: replicated optimizer state; 1: state sharded over dp
  // Activation recomputation (model/recompute.h): full re-runs each block's forward in its
  // backward, selective only the attention probabilities. The planner chooses none or full.
  model::Recompute recompute = model::Recompute::none;
  // Just-in-time recomputation (Varuna): each chunk keeps one micro-batch's activations, and a
  // backward whose forward's were overwritten re-runs that forward first, while its gradient is
  // on the way (schedule::with_jit_recompute). Whole backward passes and recompute none only.
  bool jit_recompute = false;
  // adaptive: micro-batches of activations a pipeline rank may hold at once (summed over its
  // chunks); 0 means 1F1B's budget on that rank (dispatch_cap).
  int memory_cap = 0;
  // adaptive with virtual_stages 2: place the two chunks per rank as zb-v's V instead of
  // interleaved (rank r holds virtual stages r and 2 pp - 1 - r).
  bool v_shape = false;
  // Units (see above) per pipeline stage, num_stages() entries; empty means "the default split"
  // (with_defaults fills it in).
  std::vector<int> layers_per_stage;
  RankOrder order = RankOrder::tp_dp_pp;

  int world() const { return dp * tp * pp; }
  int num_stages() const { return pp * virtual_stages; }
  // Samples per optimizer step over all replicas.
  int64_t global_batch() const { return micro_batch * micro_batches * dp; }

  // Rank <-> coordinate under `order`. Both throw InvalidArgumentError when out of range.
  Coord coord_of(int rank) const;
  int rank_of(Coord c) const;

  // Interleaving: the pipeline rank holding virtual stage s, its chunk index on that rank, and
  // the stage a (pipeline rank, chunk) pair holds.
  // The map between virtual stages and (pipeline rank, local chunk): interleaved, or a V for
  // zb-v (see ScheduleKind).
  bool v_shaped() const {
    return schedule == ScheduleKind::zb_v || (schedule == ScheduleKind::adaptive && v_shape);
  }
  // Whether the schedule splits each backward into its input and weight gradients (zero-bubble).
  bool split_backward() const {
    return schedule == ScheduleKind::zb_h1 || schedule == ScheduleKind::zb_v ||
           schedule == ScheduleKind::adaptive;
  }
  // The adaptive dispatcher's memory cap on pipeline rank `pp_rank`: memory_cap, or when 0 the
  // budget of the schedule the dispatcher stands in for: with one chunk ZB-H1's min(m, pp) (its
  // peak is 1F1B's, rank 0's), interleaved 1F1B's min(v m, 2 (pp - r - 1) + (v - 1) pp + 1), and
  // on a V ZB-V's min(2 m, 2 pp).
  int dispatch_cap(int pp_rank) const;
  // ... and the cap on micro-batches whose backward has not run (schedule::DispatchOptions::
  // backward_cap): with one chunk and memory_cap 0, 1F1B's min(m, pp - r), the rest of
  // dispatch_cap being room for deferred weight passes (ZB-H1's budget); else 0, none.
  int dispatch_backward_cap(int pp_rank) const;
  int pp_rank_of_stage(int stage) const {
    return v_shaped() && stage >= pp ? 2 * pp - 1 - stage : stage % pp;
  }
  int chunk_of_stage(int stage) const { return v_shaped() ? (stage >= pp ? 1 : 0) : stage / pp; }
  int stage_of(int pp_rank, int chunk) const {
    return v_shaped() && chunk == 1 ? 2 * pp - 1 - pp_rank : chunk * pp + pp_rank;
  }
  // True when pipeline rank `pp_rank` holds two adjacent virtual stages (the turn of a V, or a
  // single rank's chunks): data between them passes by copy, not by message.
  bool holds_adjacent_stages(int pp_rank) const {
    for (int vs = 0; vs + 1 < num_stages(); ++vs)
      if (pp_rank_of_stage(vs) == pp_rank && pp_rank_of_stage(vs + 1) == pp_rank) return true;
    return false;
  }

  // This plan with layers_per_stage filled by default_layers_per_stage when it is empty.
  Plan with_defaults(const model::ModelConfig& config) const;

  // The part of the model each virtual stage holds, indexed by stage (requires a filled
  // layers_per_stage that sums to n_layer + 2; throws ConfigError otherwise). The ranges tile the
  // model exactly once.
  std::vector<model::StageRange> stage_ranges(const model::ModelConfig& config) const;

  // Checks the plan against the model, the global batch and the number of workers started, and
  // throws ConfigError naming the field and the fix. An empty layers_per_stage is checked as the
  // default split.
  void validate(const model::ModelConfig& config, int64_t global_batch, int world_size) const;

  // One line for logs, e.g. "dp=2 tp=2 pp=1 v=1 mb=4x2 1f1b zero1".
  std::string describe() const;

  bool operator==(const Plan&) const = default;
};

// The default cut of the model's n_layer + 2 units into pp * virtual_stages stages: every stage
// gets floor(units / stages) units, and the remainder goes one each to the interior stages
// (1, 2, ...) first, then to stage 0. So the stages that also carry the embedding or the head get
// fewer transformer blocks, and the head stage (a vocabulary-sized GEMM plus the loss, the more
// expensive end) is the last to get an extra one. Example: gpt2-124m (12 layers, 14 units) on
// pp=4 gives 3,4,4,3 = emb+2 blocks, 4 blocks, 4 blocks, 2 blocks+head. Throws ConfigError when
// there are more stages than units.
std::vector<int> default_layers_per_stage(const model::ModelConfig& config, int pp,
                                          int virtual_stages);

nlohmann::json to_json(const Plan& plan);
// Throws CorruptDataError naming the missing or malformed field. Checks only the document's
// shape and types; Plan::validate checks the values against a model.
Plan plan_from_json(const nlohmann::json& doc);

}  // namespace tessel::layout
