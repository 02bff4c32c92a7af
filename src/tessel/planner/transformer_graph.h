// The operator graph of a preset-style transformer's forward pass (GPT-2 or LLaMA family, as
// model/ builds them), for one micro-batch of B samples of T tokens, without reading a file: a
// GPT-3 175B graph (about 20 operators per block, 96 blocks) comes from its ModelConfig alone.
//
// Per block, in the model's order:
//   gpt2   ln_1, c_attn (C -> 3C, bias), split q / k / v, heads (reshape), q k^T, scale, softmax,
//          p v, merge heads, attn.c_proj, residual add, ln_2, c_fc, gelu, mlp.c_proj, residual
//          add
//   llama  rms_1, q, k, v projections, heads, rope on q and k, (GQA: k and v repeated to the
//          query heads), q k^T, scale, softmax, p v, merge heads, o, residual add, rms_2, gate,
//          up, silu, gate * up, down, residual add
// then the final norm, the head (tied to the embedding's table when the model ties them) and the
// loss. Shapes: activations [B, T, C], heads [B, H, T, D], scores [B, H, T, T]. FLOPs: 2 m k n
// per matmul (what planner/cost_model.h counts for blocks and head, so the two agree exactly);
// one per output element for element-wise operators, five for norms and softmax (a rough
// count: they are memory-bound, and the planner costs them by bytes). Parameters: exactly
// ModelConfig::num_params().
#pragma once

#include <cstdint>

#include "tessel/model/model_config.h"
#include "tessel/planner/op_graph.h"

namespace tessel::planner {

// Throws ConfigError for an invalid model, a micro-batch below 1, or a sequence outside
// [1, max_seq_len].
OpGraph transformer_graph(const model::ModelConfig& model, int64_t micro_batch, int seq);

}  // namespace tessel::planner
