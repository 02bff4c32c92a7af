#include "tessel/model/model_spec.h"

#include <cmath>

#include "tessel/core/check.h"

namespace tessel::model {

std::string_view init_kind_name(InitKind k) {
  switch (k) {
    case InitKind::normal:
      return "normal";
    case InitKind::zeros:
      return "zeros";
    case InitKind::ones:
      return "ones";
  }
  return "?";
}

std::string_view tp_split_name(TpSplit s) {
  switch (s) {
    case TpSplit::replicated:
      return "replicated";
    case TpSplit::column:
      return "column";
    case TpSplit::row:
      return "row";
    case TpSplit::vocab:
      return "vocab";
    case TpSplit::qkv_fused_per_head:
      return "qkv_fused_per_head";
    case TpSplit::kv_heads:
      return "kv_heads";
  }
  return "?";
}

std::string layer_param_name(Family family, int layer, LayerParam p) {
  const char* suffix = "";
  if (family == Family::gpt2) {
    switch (p) {
      case LayerParam::norm1_weight:
        suffix = "ln_1.weight";
        break;
      case LayerParam::norm1_bias:
        suffix = "ln_1.bias";
        break;
      case LayerParam::qkv_weight:
        suffix = "attn.c_attn.weight";
        break;
      case LayerParam::qkv_bias:
        suffix = "attn.c_attn.bias";
        break;
      case LayerParam::attn_out_weight:
        suffix = "attn.c_proj.weight";
        break;
      case LayerParam::attn_out_bias:
        suffix = "attn.c_proj.bias";
        break;
      case LayerParam::norm2_weight:
        suffix = "ln_2.weight";
        break;
      case LayerParam::norm2_bias:
        suffix = "ln_2.bias";
        break;
      case LayerParam::mlp_in_weight:
        suffix = "mlp.c_fc.weight";
        break;
      case LayerParam::mlp_in_bias:
        suffix = "mlp.c_fc.bias";
        break;
      case LayerParam::mlp_out_weight:
        suffix = "mlp.c_proj.weight";
        break;
      case LayerParam::mlp_out_bias:
        suffix = "mlp.c_proj.bias";
        break;
      case LayerParam::q_weight:
      case LayerParam::k_weight:
      case LayerParam::v_weight:
      case LayerParam::mlp_up_weight:
        return "";
    }
    return "transformer.h." + std::to_string(layer) + "." + suffix;
  }
  switch (p) {
    case LayerParam::norm1_weight:
      suffix = "input_layernorm.weight";
      break;
    case LayerParam::q_weight:
      suffix = "self_attn.q_proj.weight";
      break;
    case LayerParam::k_weight:
      suffix = "self_attn.k_proj.weight";
      break;
    case LayerParam::v_weight:
      suffix = "self_attn.v_proj.weight";
      break;
    case LayerParam::attn_out_weight:
      suffix = "self_attn.o_proj.weight";
      break;
    case LayerParam::norm2_weight:
      suffix = "post_attention_layernorm.weight";
      break;
    case LayerParam::mlp_in_weight:
      suffix = "mlp.gate_proj.weight";
      break;
    case LayerParam::mlp_up_weight:
      suffix = "mlp.up_proj.weight";
      break;
    case LayerParam::mlp_out_weight:
      suffix = "mlp.down_proj.weight";
      break;
    case LayerParam::norm1_bias:
    case LayerParam::qkv_weight:
    case LayerParam::qkv_bias:
    case LayerParam::attn_out_bias:
    case LayerParam::norm2_bias:
    case LayerParam::mlp_in_bias:
    case LayerParam::mlp_out_bias:
      return "";
  }
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

std::string global_param_name(Family family, GlobalParam p) {
  const bool gpt2 = family == Family::gpt2;
  switch (p) {
    case GlobalParam::token_embedding:
      return gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
    case GlobalParam::position_embedding:
      return gpt2 ? "transformer.wpe.weight" : "";
    case GlobalParam::final_norm_weight:
      return gpt2 ? "transformer.ln_f.weight" : "model.norm.weight";
    case GlobalParam::final_norm_bias:
      return gpt2 ? "transformer.ln_f.bias" : "";
    case GlobalParam::lm_head:
      return "lm_head.weight";
  }
  return "";
}

void ModelSpec::add(ParamSpec p) {
  TESSEL_CHECK(!p.name.empty() && !index_.contains(p.name), InvalidArgumentError,
               "duplicate or empty parameter name '{}'", p.name);
  index_.emplace(p.name, int(params_.size()));
  params_.push_back(std::move(p));
}

namespace {

constexpr float kInitStd = 0.02f;

ParamSpec matrix(std::string name, int64_t rows, int64_t cols, float std, TpSplit split,
                 int layer) {
  return ParamSpec{
      std::move(name), Shape{rows, cols}, InitKind::normal, std, true, split, layer, -1};
}
ParamSpec vector_of(std::string name, int64_t n, InitKind init, TpSplit split, int layer) {
  return ParamSpec{std::move(name), Shape{n}, init, 0.0f, false, split, layer, -1};
}
ParamSpec vocab_matrix(std::string name, const ModelConfig& c, int layer) {
  ParamSpec p =
      matrix(std::move(name), c.padded_vocab(), c.n_embd, kInitStd, TpSplit::vocab, layer);
  p.init_rows = c.vocab_size;
  return p;
}

}  // namespace

ModelSpec ModelSpec::from(const ModelConfig& c) {
  c.validate();
  ModelSpec s;
  s.config_ = c;
  const Family f = c.family;
  const int64_t C = c.n_embd, F = c.ffn_hidden, D = c.head_dim();
  const int64_t q_rows = int64_t(c.n_head) * D, kv_rows = int64_t(c.n_kv_head) * D;
  const int L = c.n_layer;
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2L) so that the
  // stream's variance does not grow with depth (the GPT-2 paper, nanoGPT, llm.c).
  const float residual_std = f == Family::gpt2 ? kInitStd / std::sqrt(2.0f * float(L)) : kInitStd;
  auto lname = [&](int l, LayerParam p) { return layer_param_name(f, l, p); };
  auto gname = [&](GlobalParam p) { return global_param_name(f, p); };
  using TS = TpSplit;
  using LP = LayerParam;

  s.add(vocab_matrix(gname(GlobalParam::token_embedding), c, -1));
  if (f == Family::gpt2) {
    s.add(matrix(gname(GlobalParam::position_embedding), c.max_seq_len, C, kInitStd, TS::replicated,
                 -1));
  }
  for (int l = 0; l < L; ++l) {
    if (f == Family::gpt2) {
      s.add(vector_of(lname(l, LP::norm1_weight), C, InitKind::ones, TS::replicated, l));
      if (c.bias) s.add(vector_of(lname(l, LP::norm1_bias), C, InitKind::zeros, TS::replicated, l));
      s.add(matrix(lname(l, LP::qkv_weight), 3 * C, C, kInitStd, TS::qkv_fused_per_head, l));
      if (c.bias)
        s.add(vector_of(lname(l, LP::qkv_bias), 3 * C, InitKind::zeros, TS::qkv_fused_per_head, l));
      s.add(matrix(lname(l, LP::attn_out_weight), C, C, residual_std, TS::row, l));
      if (c.bias)
        s.add(vector_of(lname(l, LP::attn_out_bias), C, InitKind::zeros, TS::replicated, l));
      s.add(vector_of(lname(l, LP::norm2_weight), C, InitKind::ones, TS::replicated, l));
      if (c.bias) s.add(vector_of(lname(l, LP::norm2_bias), C, InitKind::zeros, TS::replicated, l));
      s.add(matrix(lname(l, LP::mlp_in_weight), F, C, kInitStd, TS::column, l));
      if (c.bias) s.add(vector_of(lname(l, LP::mlp_in_bias), F, InitKind::zeros, TS::column, l));
      s.add(matrix(lname(l, LP::mlp_out_weight), C, F, residual_std, TS::row, l));
      if (c.bias)
        s.add(vector_of(lname(l, LP::mlp_out_bias), C, InitKind::zeros, TS::replicated, l));
    } else {
      s.add(vector_of(lname(l, LP::norm1_weight), C, InitKind::ones, TS::replicated, l));
      s.add(matrix(lname(l, LP::q_weight), q_rows, C, kInitStd, TS::column, l));
      s.add(matrix(lname(l, LP::k_weight), kv_rows, C, kInitStd, TS::kv_heads, l));
      s.add(matrix(lname(l, LP::v_weight), kv_rows, C, kInitStd, TS::kv_heads, l));
      s.add(matrix(lname(l, LP::attn_out_weight), C, q_rows, residual_std, TS::row, l));
      s.add(vector_of(lname(l, LP::norm2_weight), C, InitKind::ones, TS::replicated, l));
      s.add(matrix(lname(l, LP::mlp_in_weight), F, C, kInitStd, TS::column, l));
      s.add(matrix(lname(l, LP::mlp_up_weight), F, C, kInitStd, TS::column, l));
      s.add(matrix(lname(l, LP::mlp_out_weight), C, F, residual_std, TS::row, l));
    }
  }
  s.add(vector_of(gname(GlobalParam::final_norm_weight), C, InitKind::ones, TS::replicated, L));
  if (f == Family::gpt2 && c.bias)
    s.add(vector_of(gname(GlobalParam::final_norm_bias), C, InitKind::zeros, TS::replicated, L));
  if (!c.tie_embeddings) s.add(vocab_matrix(gname(GlobalParam::lm_head), c, L));
  return s;
}

ModelSpec ModelSpec::for_stage(const StageRange& stage) const {
  const StageRange r = stage.resolved(config_);
  const std::string wte = global_param_name(config_.family, GlobalParam::token_embedding);
  ModelSpec s;
  s.config_ = config_;
  for (const ParamSpec& p : params_) {
    bool keep = (p.layer >= r.layer_begin && p.layer < r.layer_end) ||
                (p.layer == -1 && r.has_embedding) || (p.layer == config_.n_layer && r.has_head) ||
                (config_.tie_embeddings && r.has_head && p.name == wte);
    if (keep) s.add(p);
  }
  return s;
}

int ModelSpec::index_of(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? -1 : it->second;
}

const ParamSpec& ModelSpec::at(std::string_view name) const {
  int i = index_of(name);
  TESSEL_CHECK(i >= 0, InvalidArgumentError, "model '{}' has no parameter named '{}' here",
               config_.name, name);
  return params_[size_t(i)];
}

int64_t ModelSpec::numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  return n;
}

ParamOffsets param_offsets(const ModelSpec& spec, int layer_begin, int layer_end,
                           const std::vector<int64_t>& offsets) {
  const ModelConfig& c = spec.config();
  auto offset_of = [&](const std::string& name) -> int64_t {
    if (name.empty()) return -1;
    const int i = spec.index_of(name);
    return i < 0 ? -1 : offsets[size_t(i)];
  };
  ParamOffsets o;
  for (int l = layer_begin; l < layer_end; ++l) {
    std::vector<int64_t> off(kNumLayerParams);
    for (int k = 0; k < kNumLayerParams; ++k)
      off[size_t(k)] = offset_of(layer_param_name(c.family, l, LayerParam(k)));
    o.layer.push_back(std::move(off));
  }
  o.wte = offset_of(global_param_name(c.family, GlobalParam::token_embedding));
  o.wpe = offset_of(global_param_name(c.family, GlobalParam::position_embedding));
  o.lnf_w = offset_of(global_param_name(c.family, GlobalParam::final_norm_weight));
  o.lnf_b = offset_of(global_param_name(c.family, GlobalParam::final_norm_bias));
  o.head = c.tie_embeddings ? o.wte : offset_of(global_param_name(c.family, GlobalParam::lm_head));
  return o;
}

}  // namespace tessel::model
