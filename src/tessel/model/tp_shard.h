// Tensor-parallel sharding: which part of every parameter a tp rank holds.
//
// A parameter's ParamSpec::split says how tensor parallelism cuts it over tp ranks; this header
// turns that into shapes and boxes. Rank r of tp holds, per split kind:
//   replicated          the whole tensor (every rank a copy)
//   column              rows [r R/tp, (r+1) R/tp) of dim 0 (output features; a bias likewise)
//   row                 columns [r K/tp, (r+1) K/tp) of dim 1 (input features)
//   vocab               rows [r Vp/tp, (r+1) Vp/tp) of the padded vocabulary (padding rows >= V
//                       may fill the last shard(s) partly or entirely)
//   qkv_fused_per_head  GPT-2 c_attn [3C, C] (and its [3C] bias): from each of q, k and v the
//                       rows of this rank's heads, stacked [q_r; k_r; v_r] -> local [3C/tp, C]
//   kv_heads            LLaMA k_proj / v_proj [Hkv D, C]: split by kv heads (like column) when tp
//                       divides n_kv_head; otherwise (tp a multiple of n_kv_head) rank r holds the
//                       ONE kv head its query heads use, kv head r Hkv / tp, so each kv head is
//                       replicated on tp / Hkv consecutive ranks
// Query head h uses kv head h / (Hq / Hkv), globally; rank r holds query heads
// [r Hq/tp, (r+1) Hq/tp).
//
// Shards are described as pieces: (global box in the full tensor, local box in the shard). The
// local boxes of a rank tile its shard exactly; over all ranks the global boxes cover each element
// of the tensor tp_copies() times. Resharding and checkpoint I/O need exactly these pieces.
#pragma once

#include <vector>

#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/tensor/box.h"
#include "tessel/tensor/shape.h"

namespace tessel::model {

// Throws ConfigError unless `config` can be split over tp ranks: tp >= 1 dividing n_head,
// ffn_hidden and padded_vocab(), and (llama) either dividing n_kv_head or being a multiple of it.
void validate_tp(const ModelConfig& config, int tp);

// The attention heads of one tp rank.
struct TpHeads {
  int q_begin = 0;             // first global query head
  int q_heads = 0;             // Hq / tp
  int kv_begin = 0;            // first global kv head held
  int kv_heads = 0;            // Hkv / tp when tp divides Hkv, else 1
  bool kv_replicated = false;  // tp does not divide Hkv: the kv head is shared with other ranks
};
TpHeads tp_heads(const ModelConfig& config, int tp_rank, int tp_size);

// The padded-vocabulary rows [start, start + rows) of a vocab-parallel shard.
struct TpVocabRange {
  int start = 0;
  int rows = 0;
};
TpVocabRange tp_vocab_range(const ModelConfig& config, int tp_rank, int tp_size);

// One piece of a shard: the elements `global` of the full tensor are stored at `local` in the
// rank's shard (boxes of equal extents).
struct ShardPiece {
  Box global;
  Box local;
  bool operator==(const ShardPiece&) const = default;
};

// The shard of `spec` on tp rank `tp_rank` of `tp_size`: its shape, and its pieces in local order.
// Throws ConfigError when the config cannot be split tp ways (validate_tp), InvalidArgumentError
// for a rank outside [0, tp_size) or a tensor whose shape does not fit its split kind.
Shape tp_local_shape(const ParamSpec& spec, const ModelConfig& config, int tp_rank, int tp_size);
std::vector<ShardPiece> tp_shard_pieces(const ParamSpec& spec, const ModelConfig& config,
                                        int tp_rank, int tp_size);

// How many tp ranks hold a copy of each element of `spec` (1 for split tensors, tp_size for
// replicated ones, tp_size / n_kv_head for replicated kv heads).
int tp_copies(const ParamSpec& spec, const ModelConfig& config, int tp_size);
// Whether rank `tp_rank`'s copy is the first of the tp_copies() identical copies of its elements:
// the one to count in a global gradient norm and to write to a checkpoint.
bool tp_is_primary(const ParamSpec& spec, const ModelConfig& config, int tp_rank, int tp_size);

}  // namespace tessel::model
