// ModelSpec: every parameter tensor of a model, in canonical order, with Hugging Face names.
//
// The canonical order is forward order: embeddings, then per block its norms and projections,
// then the final norm and the (untied) head. It is the layout of a Transformer's flat parameter
// buffer and the order checkpoints list tensors in.
//
// GPT-2 (tied head: no lm_head.weight)
//   transformer.wte.weight            [Vp, C]     transformer.wpe.weight         [max_seq, C]
//   transformer.h.{i}.ln_1.weight     [C]         transformer.h.{i}.ln_1.bias    [C]
//   transformer.h.{i}.attn.c_attn.weight [3C, C]  transformer.h.{i}.attn.c_attn.bias [3C]
//   transformer.h.{i}.attn.c_proj.weight [C, C]   transformer.h.{i}.attn.c_proj.bias [C]
//   transformer.h.{i}.ln_2.weight/bias [C]
//   transformer.h.{i}.mlp.c_fc.weight [F, C]      transformer.h.{i}.mlp.c_fc.bias [F]
//   transformer.h.{i}.mlp.c_proj.weight [C, F]    transformer.h.{i}.mlp.c_proj.bias [C]
//   transformer.ln_f.weight/bias      [C]
// LLaMA
//   model.embed_tokens.weight [Vp, C]
//   model.layers.{i}.input_layernorm.weight [C]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight [Hq*D, C], [Hkv*D, C], [Hkv*D, C], [C, C]
//   model.layers.{i}.post_attention_layernorm.weight [C]
//   model.layers.{i}.mlp.{gate,up,down}_proj.weight [F, C], [F, C], [C, F]
//   model.norm.weight [C]             lm_head.weight [Vp, C]
//
// Layout caveats for checkpoint conversion:
// - Linear weights are stored [out, in] like torch.nn.Linear. Hugging Face GPT-2 uses Conv1D,
//   which stores [in, out]: c_attn, c_proj and c_fc weights must be transposed on import/export.
// - Embeddings and the head have Vp = padded_vocab() rows; rows >= vocab_size are padding
//   (initialised to zero, never indexed by tokens, excluded from the loss) and are dropped on
//   export / zero-filled on import.
// - c_attn's rows are [q; k; v], each [C, C] with heads contiguous (head h = rows h*D..h*D+D).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessel/model/model_config.h"
#include "tessel/model/stage_range.h"
#include "tessel/tensor/shape.h"

namespace tessel::model {

enum class InitKind { normal, zeros, ones };
std::string_view init_kind_name(InitKind k);

// How tensor parallelism cuts a tensor across ranks (tp_shard.h has the exact boxes).
enum class TpSplit {
  replicated,          // every rank holds all of it (norms, row-parallel biases, positions)
  column,              // split dim 0: output features of a column-parallel linear (and its bias)
  row,                 // split dim 1: input features of a row-parallel linear
  vocab,               // split dim 0 of the token embedding / head: vocabulary-parallel
  qkv_fused_per_head,  // dim 0 is [q; k; v]: each rank takes its heads from each of the three
  kv_heads,            // llama k/v: split dim 0 by kv heads when tp divides n_kv_head, else each
                       // rank holds the one kv head its query heads use (replicated)
};
std::string_view tp_split_name(TpSplit s);

struct ParamSpec {
  std::string name;
  Shape shape;
  InitKind init = InitKind::normal;
  float std = 0.0f;  // for InitKind::normal
  bool weight_decay = false;
  TpSplit split = TpSplit::replicated;
  int layer = -1;  // block index; -1 for embeddings, n_layer for the final norm and head
  // Rows at or beyond this index start at zero whatever `init` says (vocabulary padding of the
  // embedding and head); -1 when every row follows `init`.
  int64_t init_rows = -1;

  int64_t numel() const { return shape.numel(); }
};

// The per-block parameters, by role. A role a family lacks has no name (see layer_param_name).
enum class LayerParam {
  norm1_weight,     // gpt2 ln_1 / llama input_layernorm
  norm1_bias,       // gpt2 only
  qkv_weight,       // gpt2 fused c_attn
  qkv_bias,         // gpt2 only
  q_weight,         // llama only
  k_weight,         // llama only
  v_weight,         // llama only
  attn_out_weight,  // gpt2 attn.c_proj / llama o_proj
  attn_out_bias,    // gpt2 only
  norm2_weight,     // gpt2 ln_2 / llama post_attention_layernorm
  norm2_bias,       // gpt2 only
  mlp_in_weight,    // gpt2 c_fc / llama gate_proj
  mlp_in_bias,      // gpt2 only
  mlp_up_weight,    // llama up_proj
  mlp_out_weight,   // gpt2 mlp.c_proj / llama down_proj
  mlp_out_bias,     // gpt2 only
};
inline constexpr int kNumLayerParams = int(LayerParam::mlp_out_bias) + 1;
enum class GlobalParam {
  token_embedding,
  position_embedding,  // gpt2 only
  final_norm_weight,
  final_norm_bias,  // gpt2 only
  lm_head,          // untied models only
};

// The Hugging Face name of a parameter role, or "" when the family has no such role. Whether a
// bias exists also depends on ModelConfig::bias; ModelSpec is the authority on what exists.
std::string layer_param_name(Family family, int layer, LayerParam p);
std::string global_param_name(Family family, GlobalParam p);

class ModelSpec {
 public:
  // All parameters of the model (validates the config).
  static ModelSpec from(const ModelConfig& config);

  // The parameters a pipeline stage holds, in canonical order: its blocks, plus the embeddings
  // if it has them, plus the final norm and head if it has them; with tied embeddings a head
  // stage also holds the token embedding (used as its head).
  ModelSpec for_stage(const StageRange& stage) const;

  const ModelConfig& config() const { return config_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  size_t size() const { return params_.size(); }
  const ParamSpec& operator[](size_t i) const { return params_[i]; }
  auto begin() const { return params_.begin(); }
  auto end() const { return params_.end(); }

  // Position in params(), or -1 when absent.
  int index_of(std::string_view name) const;
  // Throws InvalidArgumentError naming the missing parameter.
  const ParamSpec& at(std::string_view name) const;
  bool contains(std::string_view name) const { return index_of(name) >= 0; }
  // Total number of elements.
  int64_t numel() const;

 private:
  void add(ParamSpec p);

  ModelConfig config_;
  std::vector<ParamSpec> params_;
  std::unordered_map<std::string, int> index_;
};

// Where the parameters a forward pass reads sit in a flat buffer holding `spec`'s parameters in
// its order, spec[i] at offsets[i] (floats); -1 for what the spec lacks (another stage's, a
// family's absent bias). The head is the token embedding when the model ties them. Shared by
// the training model and the inference decoder, which lay their buffers out the same way.
struct ParamOffsets {
  std::vector<std::vector<int64_t>> layer;  // [l - layer_begin][LayerParam]
  int64_t wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head = -1;
};
ParamOffsets param_offsets(const ModelSpec& spec, int layer_begin, int layer_end,
                           const std::vector<int64_t>& offsets);

}  // namespace tessel::model
