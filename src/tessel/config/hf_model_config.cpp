#include "tessel/config/hf_model_config.h"

#include <fmt/format.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "tessel/core/check.h"

namespace tessel::config {

namespace {

using json = nlohmann::json;
using model::Family;
using model::ModelConfig;

// A float as the JSON number with the shortest decimal that reads back as the same float
// (1e-5f becomes 1e-05, not 9.999999747378752e-06).
double json_number(float f) {
  return std::strtod(fmt::format("{}", f).c_str(), nullptr);
}

std::string torch_dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      TESSEL_THROW(UnsupportedError,
                   "cannot export in dtype {}: Hugging Face models are exported as f32, bf16 or "
                   "f16",
                   dtype_name(t));
  }
}

// ---- config.json ----------------------------------------------------------------------------

class HfConfigReader {
 public:
  HfConfigReader(const json& j, std::string what) : j_(j), what_(std::move(what)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  // For messages only: whatever the file says, never a second error while reporting the first.
  std::string model_type() const {
    return has("model_type") && j_.at("model_type").is_string()
               ? j_.at("model_type").get<std::string>()
               : std::string("model");
  }
  int required_int(const char* key) const {
    TESSEL_CHECK(has(key), CorruptDataError, "{} has no '{}'; a {} config needs it", what_, key,
                 model_type());
    return as_int(key);
  }
  int int_or(const char* key, int fallback) const { return has(key) ? as_int(key) : fallback; }
  float float_or(const char* key, float fallback) const {
    if (!has(key)) return fallback;
    TESSEL_CHECK(j_.at(key).is_number(), CorruptDataError, "{}: '{}' is {}; it must be a number",
                 what_, key, j_.at(key).dump());
    return j_.at(key).get<float>();
  }
  bool bool_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    TESSEL_CHECK(j_.at(key).is_boolean(), CorruptDataError,
                 "{}: '{}' is {}; it must be true or false", what_, key, j_.at(key).dump());
    return j_.at(key).get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    TESSEL_CHECK(j_.at(key).is_string(), CorruptDataError, "{}: '{}' is {}; it must be a string",
                 what_, key, j_.at(key).dump());
    return j_.at(key).get<std::string>();
  }
  // An option tessel does not implement must have its neutral value.
  void require_bool(const char* key, bool neutral, const char* why) const {
    TESSEL_CHECK(bool_or(key, neutral) == neutral, UnsupportedError,
                 "{}: '{}' is {}; tessel supports only {} ({})", what_, key, !neutral, neutral,
                 why);
  }

 private:
  int as_int(const char* key) const {
    const json& v = j_.at(key);
    TESSEL_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 &&
                     v.get<int64_t>() <= std::numeric_limits<int>::max(),
                 CorruptDataError, "{}: '{}' is {}; it must be a positive integer", what_, key,
                 v.dump());
    return v.get<int>();
  }

  const json& j_;
  std::string what_;
};

Family family_of_hf(const json& j, const std::string& what) {
  const std::string type = j.contains("model_type") && j.at("model_type").is_string()
                               ? j.at("model_type").get<std::string>()
                               : "";
  std::vector<std::string> archs;
  if (j.contains("architectures") && j.at("architectures").is_array())
    for (const auto& a : j.at("architectures"))
      if (a.is_string()) archs.push_back(a.get<std::string>());
  auto has_arch = [&](std::initializer_list<const char*> names) {
    for (const auto& a : archs)
      for (const char* n : names)
        if (a == n) return true;
    return false;
  };
  if (type == "gpt2" || (type.empty() && has_arch({"GPT2LMHeadModel", "GPT2Model"})))
    return Family::gpt2;
  if (type == "llama" || (type.empty() && has_arch({"LlamaForCausalLM", "LlamaModel"})))
    return Family::llama;
  std::string arch_list;
  for (const auto& a : archs) arch_list += (arch_list.empty() ? "" : ", ") + a;
  TESSEL_THROW(UnsupportedError,
               "{} describes model_type '{}' (architectures [{}]); tessel converts gpt2 "
               "(GPT2LMHeadModel) and llama (LlamaForCausalLM) models only",
               what, type, arch_list);
}

ModelConfig config_from_hf(const json& j, const std::string& name, const std::string& what) {
  TESSEL_CHECK(j.is_object(), CorruptDataError, "{} is not a JSON object", what);
  const Family family = family_of_hf(j, what);
  const HfConfigReader r(j, what);
  ModelConfig c;
  c.name = name;
  c.family = family;
  if (family == Family::gpt2) {
    c.n_layer = r.required_int("n_layer");
    c.n_embd = r.required_int("n_embd");
    c.n_head = r.required_int("n_head");
    c.n_kv_head = c.n_head;
    // null: 4 n_embd, as transformers does; checked first, as 4 n_embd may not fit an int.
    TESSEL_CHECK(r.has("n_inner") || c.n_embd <= std::numeric_limits<int>::max() / 4,
                 CorruptDataError,
                 "{}: n_embd {} is too large for the default n_inner (4 x n_embd) to fit 32 bits",
                 what, c.n_embd);
    c.ffn_hidden = r.has("n_inner") ? r.required_int("n_inner") : 4 * c.n_embd;
    c.vocab_size = r.required_int("vocab_size");
    c.max_seq_len = r.required_int("n_positions");
    c.norm_eps = r.float_or("layer_norm_epsilon", 1e-5f);
    c.tie_embeddings = r.bool_or("tie_word_embeddings", true);
    c.bias = true;
    const std::string act = r.string_or("activation_function", "gelu_new");
    // All three are 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tessel's GELU.
    TESSEL_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast",
                 UnsupportedError,
                 "{}: activation_function '{}' is not tessel's GELU, the tanh approximation "
                 "(gelu_new)",
                 what, act);
    r.require_bool("scale_attn_weights", true, "scores scaled by 1/sqrt(head_dim)");
    r.require_bool("scale_attn_by_inverse_layer_idx", false, "no per-layer score scaling");
    r.require_bool("add_cross_attention", false, "decoder-only models");
  } else {
    c.n_layer = r.required_int("num_hidden_layers");
    c.n_embd = r.required_int("hidden_size");
    c.n_head = r.required_int("num_attention_heads");
    c.n_kv_head = r.int_or("num_key_value_heads", c.n_head);
    c.ffn_hidden = r.required_int("intermediate_size");
    c.vocab_size = r.required_int("vocab_size");
    c.max_seq_len = r.int_or("max_position_embeddings", 2048);
    c.norm_eps = r.float_or("rms_norm_eps", 1e-6f);
    c.rope_theta = r.float_or("rope_theta", 10000.0f);
    c.tie_embeddings = r.bool_or("tie_word_embeddings", false);
    c.bias = false;
    const std::string act = r.string_or("hidden_act", "silu");
    TESSEL_CHECK(act == "silu", UnsupportedError,
                 "{}: hidden_act '{}' is not tessel's SwiGLU activation (silu)", what, act);
    TESSEL_CHECK(!r.has("rope_scaling"), UnsupportedError,
                 "{}: rope_scaling {} is set; tessel implements plain RoPE only", what,
                 j.at("rope_scaling").dump());
    // Newer transformers keep RoPE settings under rope_parameters.
    if (r.has("rope_parameters")) {
      const json& rp = j.at("rope_parameters");
      TESSEL_CHECK(rp.is_object(), CorruptDataError, "{}: rope_parameters is not an object", what);
      const HfConfigReader rr(rp, what + " rope_parameters");
      const std::string type = rr.string_or("rope_type", "default");
      TESSEL_CHECK(type == "default", UnsupportedError,
                   "{}: rope_parameters.rope_type is '{}'; tessel implements plain RoPE "
                   "(default) only",
                   what, type);
      c.rope_theta = rr.float_or("rope_theta", c.rope_theta);
    }
    r.require_bool("attention_bias", false, "LLaMA without biases");
    r.require_bool("mlp_bias", false, "LLaMA without biases");
    if (r.has("head_dim")) {
      const int head_dim = r.required_int("head_dim");
      TESSEL_CHECK(head_dim * c.n_head == c.n_embd, UnsupportedError,
                   "{}: head_dim {} times num_attention_heads {} differs from hidden_size {}; "
                   "tessel needs head_dim = hidden_size / num_attention_heads",
                   what, head_dim, c.n_head, c.n_embd);
    }
  }
  c.validate();
  return c;
}

}  // namespace

std::string hf_architecture(Family f) {
  return f == Family::gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM";
}

// "gpt2 model 'x' (n_layer 12, n_embd 768, ...)": what error messages say a tensor must fit.
std::string describe_model(const ModelConfig& c) {
  if (c.family == Family::gpt2)
    return fmt::format(
        "gpt2 model '{}' (n_layer {}, n_embd {}, n_head {}, ffn_hidden {}, vocab_size {}, "
        "max_seq_len {})",
        c.name, c.n_layer, c.n_embd, c.n_head, c.ffn_hidden, c.vocab_size, c.max_seq_len);
  return fmt::format(
      "llama model '{}' (n_layer {}, n_embd {}, n_head {}, n_kv_head {}, ffn_hidden {}, "
      "vocab_size {})",
      c.name, c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.ffn_hidden, c.vocab_size);
}

ModelConfig model_config_from_hf(const json& config, const std::string& name,
                                 const std::string& what) {
  return config_from_hf(config, name, what);
}

json hf_config_from_model(const ModelConfig& c, DType dtype, const json& base) {
  c.validate();
  const std::string torch_dtype = torch_dtype_name(dtype);
  const std::string model_type(model::family_name(c.family));
  const bool same_family =
      base.is_object() && base.contains("model_type") && base.at("model_type") == model_type;
  json j = same_family ? base : json::object();
  auto set_default = [&](const char* key, json value) {
    if (!j.contains(key)) j[key] = std::move(value);
  };
  j["architectures"] = json::array({hf_architecture(c.family)});
  j["model_type"] = model_type;
  j["vocab_size"] = c.vocab_size;
  j["tie_word_embeddings"] = c.tie_embeddings;
  if (c.family == Family::gpt2) {
    TESSEL_CHECK(c.bias, UnsupportedError,
                 "model '{}' is a gpt2 model without biases, which transformers' GPT2LMHeadModel "
                 "cannot represent (it always has biases)",
                 c.name);
    j["n_positions"] = c.max_seq_len;
    if (j.contains("n_ctx")) j["n_ctx"] = c.max_seq_len;  // legacy alias of n_positions
    j["n_embd"] = c.n_embd;
    j["n_layer"] = c.n_layer;
    j["n_head"] = c.n_head;
    j["n_inner"] = c.ffn_hidden == 4 * c.n_embd ? json(nullptr) : json(c.ffn_hidden);
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = json_number(c.norm_eps);
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["add_cross_attention"] = false;
    // tessel trains without dropout; a fresh config says so (a source config keeps its own).
    set_default("resid_pdrop", 0.0);
    set_default("embd_pdrop", 0.0);
    set_default("attn_pdrop", 0.0);
  } else {
    j["hidden_size"] = c.n_embd;
    j["intermediate_size"] = c.ffn_hidden;
    j["num_hidden_layers"] = c.n_layer;
    j["num_attention_heads"] = c.n_head;
    j["num_key_value_heads"] = c.n_kv_head;
    j["head_dim"] = c.head_dim();
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = c.max_seq_len;
    j["rms_norm_eps"] = json_number(c.norm_eps);
    j["rope_theta"] = json_number(c.rope_theta);
    j["rope_scaling"] = nullptr;
    j.erase("rope_parameters");  // rope_theta above is the one setting
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    set_default("attention_dropout", 0.0);
    set_default("pretraining_tp", 1);
  }
  set_default("initializer_range", 0.02);
  set_default("use_cache", true);
  j["torch_dtype"] = torch_dtype;
  if (j.contains("dtype")) j["dtype"] = torch_dtype;  // newer transformers' spelling
  return j;
}

}  // namespace tessel::config
