#include "tessel/checkpoint/hf_convert.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "tessel/checkpoint/model_json.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/json_file.h"
#include "tessel/model/model_spec.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/store/safetensors.h"

namespace tessel::checkpoint {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using model::Family;
using model::ModelConfig;

constexpr std::string_view kGpt2Architecture = "GPT2LMHeadModel";
constexpr std::string_view kLlamaArchitecture = "LlamaForCausalLM";
constexpr std::string_view kGpt2Prefix = "transformer.";

std::string architecture_of(Family f) {
  return std::string(f == Family::gpt2 ? kGpt2Architecture : kLlamaArchitecture);
}

// "gpt2 model 'x' (n_layer 12, n_embd 768, ...)": what error messages say a tensor must fit.
std::string describe(const ModelConfig& c) {
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

bool is_float_weight(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

// dst [cols, rows] = src [rows, cols] transposed; 32x32 tiles keep both sides in cache.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
    }
}

// One parameter and how it looks on the Hugging Face side.
struct TensorMap {
  const model::ParamSpec* spec;
  Shape hf_shape;
  bool transpose = false;  // GPT-2 Conv1D: HF [in, out] is tessel's [out, in] transposed
  bool vocab = false;      // embedding / head: only the first vocab_size rows exist in HF
  int64_t rows = 0;        // rows of the tessel tensor present in HF (all but vocab padding)
  int64_t hf_numel() const { return hf_shape.numel(); }
};

std::vector<TensorMap> tensor_maps(const model::ModelSpec& spec) {
  const ModelConfig& c = spec.config();
  std::set<std::string> conv1d;
  if (c.family == Family::gpt2) {
    using LP = model::LayerParam;
    for (int l = 0; l < c.n_layer; ++l)
      for (LP p : {LP::qkv_weight, LP::attn_out_weight, LP::mlp_in_weight, LP::mlp_out_weight})
        conv1d.insert(model::layer_param_name(c.family, l, p));
  }
  const std::string wte = model::global_param_name(c.family, model::GlobalParam::token_embedding);
  const std::string head = model::global_param_name(c.family, model::GlobalParam::lm_head);
  std::vector<TensorMap> maps;
  for (const auto& p : spec) {
    TensorMap m;
    m.spec = &p;
    m.hf_shape = p.shape;
    m.rows = p.shape[0];
    m.vocab = p.name == wte || p.name == head;
    if (m.vocab) {
      m.rows = c.vocab_size;
      m.hf_shape[0] = c.vocab_size;
    }
    if (conv1d.contains(p.name)) {
      m.transpose = true;
      m.hf_shape = Shape{p.shape[1], p.shape[0]};
    }
    maps.push_back(std::move(m));
  }
  return maps;
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

// ---- the Hugging Face weights ---------------------------------------------------------------

// The tensors of a Hugging Face model: model.safetensors, or the shards an index names.
struct HfWeights {
  std::string what;  // "Hugging Face model in 'DIR'"
  std::vector<store::SafetensorsReader> files;
  std::map<std::string, size_t> where;  // tensor name -> index into files

  const store::SafetensorsEntry* find(const std::string& name) const {
    auto it = where.find(name);
    return it == where.end() ? nullptr : files[it->second].find(name);
  }
  const store::SafetensorsReader& file_of(const std::string& name) const {
    return files[where.at(name)];
  }
};

HfWeights open_weights(const fs::path& dir, const std::optional<fs::path>& single_file) {
  HfWeights w;
  w.what = fmt::format("Hugging Face model in '{}'", dir.string());
  auto add_file = [&](const fs::path& path) {
    w.files.push_back(store::SafetensorsReader::open(path.string()));
    return w.files.size() - 1;
  };
  const fs::path single = single_file.value_or(dir / "model.safetensors");
  const fs::path index = dir / "model.safetensors.index.json";
  if (single_file || fs::exists(single)) {
    const size_t f = add_file(single);
    for (const auto& e : w.files[f].tensors()) w.where.emplace(e.name, f);
    return w;
  }
  TESSEL_CHECK(fs::exists(index), IoError,
               "no model.safetensors or model.safetensors.index.json in '{}' (weights in "
               "PyTorch .bin files must be saved as safetensors first)",
               dir.string());
  std::ifstream in(index, std::ios::binary);
  TESSEL_CHECK(in.good(), IoError, "cannot read '{}'", index.string());
  const auto weight_map = hf_index_weight_map(std::string(std::istreambuf_iterator<char>(in), {}),
                                              fmt::format("'{}'", index.string()));
  std::map<std::string, size_t> file_index;
  for (const auto& [name, f] : weight_map) {
    auto it = file_index.find(f);
    if (it == file_index.end()) it = file_index.emplace(f, add_file(dir / f)).first;
    TESSEL_CHECK(w.files[it->second].find(name) != nullptr, CorruptDataError,
                 "'{}' places tensor '{}' in '{}', which lacks it", index.string(), name, f);
    w.where.emplace(name, it->second);
  }
  return w;
}

// Buffers some exports saved beside the parameters; they are recomputed, not learned.
// (Matched by hand rather than with <regex>, which GCC 12 warns about under the sanitizers.)
bool is_ignorable_buffer(const std::string& name) {
  // "<prefix><digits><suffix>" for one of the known prefix/suffix pairs.
  auto matches = [&](std::string_view prefix, std::string_view suffix) {
    if (!std::string_view(name).starts_with(prefix) || !std::string_view(name).ends_with(suffix))
      return false;
    if (name.size() <= prefix.size() + suffix.size()) return false;
    const std::string_view digits =
        std::string_view(name).substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    return std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  for (std::string_view prefix : {"transformer.h.", "h."})
    for (std::string_view suffix : {".attn.bias", ".attn.masked_bias"})
      if (matches(prefix, suffix)) return true;
  return matches("model.layers.", ".self_attn.rotary_emb.inv_freq");
}

// The HF tensor for parameter `m`: its own name, or for GPT-2 also without "transformer.".
// Returns "" when absent; throws ConfigError when both spellings are present.
std::string find_hf_name(const HfWeights& w, const TensorMap& m) {
  const std::string& name = m.spec->name;
  const bool has_full = w.find(name) != nullptr;
  if (name.starts_with(kGpt2Prefix)) {
    const std::string bare = name.substr(kGpt2Prefix.size());
    const bool has_bare = w.find(bare) != nullptr;
    TESSEL_CHECK(!(has_full && has_bare), ConfigError,
                 "{} holds both '{}' and '{}': which one is the parameter is ambiguous; remove "
                 "one",
                 w.what, name, bare);
    if (has_bare) return bare;
  }
  return has_full ? name : "";
}

// Reads HF tensor `hf_name` as f32 in HF layout ([rows, cols] as stored).
std::vector<float> read_f32(const HfWeights& w, const std::string& hf_name) {
  const store::SafetensorsEntry& e = *w.find(hf_name);
  const auto& file = w.file_of(hf_name);
  const size_t n = size_t(e.shape.numel());
  std::vector<float> out(n);
  if (e.dtype == DType::f32) {
    file.read(hf_name, out.data());
  } else {
    std::vector<std::byte> raw(n * dtype_size(e.dtype));
    file.read(hf_name, raw.data());
    convert(raw.data(), e.dtype, out.data(), DType::f32, n);
  }
  return out;
}

std::string join_first(const std::vector<std::string>& names, size_t limit) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < limit; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > limit) s += fmt::format(", ... ({} in all)", names.size());
  return s;
}

}  // namespace

ModelConfig model_config_from_hf(const json& config, const std::string& name) {
  return config_from_hf(config, name, "config.json");
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
  j["architectures"] = json::array({architecture_of(c.family)});
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

HfExportResult export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
                         const HfExportOptions& options) {
  HfExportResult result;
  result.checkpoint = checkpoint_dir;
  // A training run's checkpoint.dir: its newest checkpoint.
  if (!fs::exists(fs::path(checkpoint_dir) / "manifest.json"))
    if (auto latest = latest_sharded_checkpoint(checkpoint_dir)) result.checkpoint = *latest;
  store::CheckpointReader reader(result.checkpoint);
  const json& meta = reader.meta();
  TESSEL_CHECK(meta.is_object() && meta.contains("model"), CorruptDataError,
               "checkpoint '{}' has no model description (manifest meta \"model\"); it was not "
               "written by tessel's training or import",
               result.checkpoint);
  result.model = model_config_from_json(meta.at("model"));
  result.architecture = architecture_of(result.model.family);
  const model::ModelSpec spec = model::ModelSpec::from(result.model);
  const json base = meta.contains("hf_config") ? meta.at("hf_config") : json::object();
  const json config = hf_config_from_model(result.model, options.dtype, base);
  const auto maps = tensor_maps(spec);

  // Check every parameter before reading any data.
  for (const auto& m : maps) {
    const store::CheckpointTensor* t = reader.find(m.spec->name);
    TESSEL_CHECK(t != nullptr, CorruptDataError,
                 "checkpoint '{}' has no tensor '{}', a parameter of {}", result.checkpoint,
                 m.spec->name, describe(result.model));
    TESSEL_CHECK(t->shape == m.spec->shape, CorruptDataError,
                 "checkpoint '{}': tensor '{}' has shape {} but {} expects {}", result.checkpoint,
                 m.spec->name, t->shape.str(), describe(result.model), m.spec->shape.str());
    TESSEL_CHECK(is_float_weight(t->dtype), CorruptDataError,
                 "checkpoint '{}': tensor '{}' has dtype {}; parameters are f32, bf16 or f16",
                 result.checkpoint, m.spec->name, dtype_name(t->dtype));
  }

  std::vector<std::vector<std::byte>> data(maps.size());
  std::vector<store::SafetensorsTensor> tensors;
  std::vector<float> f32, transposed;
  for (size_t i = 0; i < maps.size(); ++i) {
    const TensorMap& m = maps[i];
    const store::CheckpointTensor& t = reader.at(m.spec->name);
    // The rows HF has (no vocabulary padding), all columns.
    std::vector<int64_t> lo(m.spec->shape.rank(), 0), hi = m.spec->shape.dims();
    hi[0] = m.rows;
    const Box box(lo, hi);
    const size_t n = size_t(box.volume());
    f32.resize(n);
    if (t.dtype == DType::f32) {
      reader.read_box(t.name, box, f32.data());
    } else {
      std::vector<std::byte> raw(n * dtype_size(t.dtype));
      reader.read_box(t.name, box, raw.data());
      convert(raw.data(), t.dtype, f32.data(), DType::f32, n);
    }
    const float* src = f32.data();
    if (m.transpose) {
      transposed.resize(n);
      transpose(f32.data(), m.spec->shape[0], m.spec->shape[1], transposed.data());
      src = transposed.data();
    }
    data[i].resize(n * dtype_size(options.dtype));
    convert(src, DType::f32, data[i].data(), options.dtype, n);
    tensors.push_back({m.spec->name, options.dtype, m.hf_shape, data[i].data()});

    if (m.vocab && m.rows < m.spec->shape[0]) {
      // Padding rows are dropped; say so when that loses anything (training keeps them zero).
      std::vector<int64_t> plo = lo, phi = m.spec->shape.dims();
      plo[0] = m.rows;
      Tensor pad = reader.read(t.name, Box(plo, phi)).to(DType::f32);
      const auto values = pad.span<float>();
      if (std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; }))
        spdlog::warn(
            "checkpoint '{}': vocabulary padding rows {}..{} of '{}' are not zero; they are not "
            "part of the exported model",
            result.checkpoint, m.rows, m.spec->shape[0] - 1, t.name);
    }
  }
  std::set<std::string> names;
  for (const auto& m : maps) names.insert(m.spec->name);
  for (const auto& t : reader.tensors()) result.skipped += names.contains(t.name) ? 0 : 1;
  result.tensors = tensors.size();

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TESSEL_CHECK(!ec, IoError, "cannot create directory '{}': {}", out_dir, ec.message());
  // transformers rejects safetensors files whose metadata lacks format "pt".
  result.bytes = store::write_safetensors((fs::path(out_dir) / "model.safetensors").string(),
                                          tensors, {{"format", "pt"}});
  write_file_atomically((fs::path(out_dir) / "config.json").string(), config.dump(2) + "\n");
  return result;
}

namespace {

// The model to import: the given one (which must agree with config.json, when there is one), or
// config.json's under options.name, its _name_or_path or the folder's name.
ModelConfig import_model(const fs::path& dir, const std::optional<json>& hf_config,
                         const std::string& config_what, const HfImportOptions& options) {
  if (options.model) {
    ModelConfig model = *options.model;
    model.validate();
    if (hf_config) {
      // Both describe the model: they must agree on everything but the name.
      json given = to_json(model);
      json theirs = to_json(config_from_hf(*hf_config, model.name, config_what));
      std::vector<std::string> diffs;
      for (const auto& [key, value] : given.items())
        if (key != "name" && theirs.at(key) != value)
          diffs.push_back(fmt::format("{}: {} says {}, model '{}' has {}", key, config_what,
                                      theirs.at(key).dump(), model.name, value.dump()));
      TESSEL_CHECK(diffs.empty(), ConfigError,
                   "the given model and the Hugging Face config disagree ({}); import without a "
                   "model to use config.json, or fix one of them",
                   join_first(diffs, 8));
    }
    return model;
  }
  TESSEL_CHECK(hf_config.has_value(), IoError,
               "no config.json in '{}': add the model's config.json or name the model (e.g. "
               "--model gpt2-124m)",
               dir.string());
  std::string name = options.name;
  if (name.empty() && hf_config->is_object() && hf_config->contains("_name_or_path") &&
      hf_config->at("_name_or_path").is_string())
    name = hf_config->at("_name_or_path").get<std::string>();
  if (name.empty()) name = fs::absolute(dir).lexically_normal().filename().string();
  if (name.empty()) name = "hf-model";
  return config_from_hf(*hf_config, name, config_what);
}

// The HF tensors of the model's parameters, matched by name.
struct MatchedNames {
  std::vector<std::string> hf_names;  // per parameter (per TensorMap)
  size_t ignored = 0;                 // recomputed buffers beside the parameters
  bool tied_head_present = false;     // an lm_head beside a tied embedding
};

// Names first: all missing tensors in one message, then all unexpected ones.
MatchedNames match_names(const HfWeights& weights, const std::vector<TensorMap>& maps,
                         const ModelConfig& cfg) {
  MatchedNames out;
  std::vector<std::string> missing;
  for (const auto& m : maps) {
    out.hf_names.push_back(find_hf_name(weights, m));
    if (out.hf_names.back().empty()) missing.push_back(m.spec->name);
  }
  const std::string head = model::global_param_name(cfg.family, model::GlobalParam::lm_head);
  std::string hint;
  if (std::find(missing.begin(), missing.end(), head) != missing.end())
    hint =
        " (the model has an untied head; if the weights tie it to the embedding, set "
        "\"tie_word_embeddings\": true)";
  else if (cfg.family == Family::gpt2)
    hint = " (GPT-2 names are accepted with or without the 'transformer.' prefix)";
  TESSEL_CHECK(missing.empty(), ConfigError, "{} lacks {} tensor(s) of {}: {}{}", weights.what,
               missing.size(), describe(cfg), join_first(missing, 5), hint);
  std::set<std::string> used(out.hf_names.begin(), out.hf_names.end());
  std::vector<std::string> unexpected;
  for (const auto& [name, file] : weights.where) {
    if (used.contains(name)) continue;
    if (is_ignorable_buffer(name)) {
      ++out.ignored;
    } else if (cfg.tie_embeddings && name == head) {
      out.tied_head_present = true;  // checked against the embedding after the conversion
    } else {
      unexpected.push_back(name);
    }
  }
  TESSEL_CHECK(unexpected.empty(), ConfigError,
               "{} holds {} tensor(s) that are not parameters of {}: {}; check config.json (or "
               "the model given)",
               weights.what, unexpected.size(), describe(cfg), join_first(unexpected, 5));
  return out;
}

// Checks every matched tensor's dtype and shape; returns the dtypes found.
std::set<DType> check_tensors(const HfWeights& weights, const std::vector<TensorMap>& maps,
                              const std::vector<std::string>& hf_names, const ModelConfig& cfg) {
  std::set<DType> dtypes;
  for (size_t i = 0; i < maps.size(); ++i) {
    const TensorMap& m = maps[i];
    const store::SafetensorsEntry& e = *weights.find(hf_names[i]);
    TESSEL_CHECK(is_float_weight(e.dtype), ConfigError,
                 "{}: tensor '{}' has dtype {}; parameters must be F32, BF16 or F16", weights.what,
                 hf_names[i], dtype_name(e.dtype));
    dtypes.insert(e.dtype);
    if (m.vocab) {
      TESSEL_CHECK(e.shape.rank() == 2 && e.shape[0] == cfg.vocab_size, ConfigError,
                   "vocabulary mismatch: {}: tensor '{}' has shape {} ({} rows) but {} has "
                   "vocab_size {}",
                   weights.what, hf_names[i], e.shape.str(), e.shape.rank() ? e.shape[0] : 0,
                   describe(cfg), cfg.vocab_size);
    }
    TESSEL_CHECK(e.shape == m.hf_shape, ConfigError,
                 "{}: tensor '{}' has shape {} but {} expects {}{}", weights.what, hf_names[i],
                 e.shape.str(), describe(cfg), m.hf_shape.str(),
                 m.transpose ? " (Conv1D layout [in, out])" : "");
  }
  return dtypes;
}

// Every parameter in f32, tessel's [out, in], vocabulary padding rows zero.
std::vector<std::vector<float>> convert_params(const HfWeights& weights,
                                               const std::vector<TensorMap>& maps,
                                               const std::vector<std::string>& hf_names) {
  std::vector<std::vector<float>> params(maps.size());
  for (size_t i = 0; i < maps.size(); ++i) {
    const TensorMap& m = maps[i];
    std::vector<float> hf = read_f32(weights, hf_names[i]);
    if (m.transpose) {
      params[i].resize(hf.size());
      transpose(hf.data(), m.hf_shape[0], m.hf_shape[1], params[i].data());
    } else {
      hf.resize(size_t(m.spec->numel()), 0.0f);  // zero padding rows after the real ones
      params[i] = std::move(hf);
    }
  }
  return params;
}

// A head saved beside a tied embedding must equal it (it is then dropped).
void check_tied_head(const HfWeights& weights, const model::ModelSpec& spec,
                     const std::vector<TensorMap>& maps, const std::vector<std::string>& hf_names,
                     const std::vector<std::vector<float>>& params) {
  const ModelConfig& cfg = spec.config();
  const std::string head = model::global_param_name(cfg.family, model::GlobalParam::lm_head);
  const std::string wte = model::global_param_name(cfg.family, model::GlobalParam::token_embedding);
  const size_t e = size_t(spec.index_of(wte));
  const std::vector<float> lm = read_f32(weights, head);
  const bool same = lm.size() == size_t(maps[e].hf_numel()) &&
                    std::memcmp(lm.data(), params[e].data(), lm.size() * sizeof(float)) == 0;
  TESSEL_CHECK(same, ConfigError,
               "{} holds an '{}' that differs from the token embedding '{}' although "
               "tie_word_embeddings is true: set \"tie_word_embeddings\": false in config.json "
               "to keep it as a separate head",
               weights.what, head, hf_names[e]);
}

// Step 0's checkpoint of the converted parameters, with the source in its metadata.
void write_imported(const std::string& out_checkpoint_dir, const std::string& hf_dir,
                    const std::optional<json>& hf_config, const HfImportResult& result,
                    const std::vector<TensorMap>& maps,
                    const std::vector<std::vector<float>>& params) {
  store::CheckpointWriter writer(out_checkpoint_dir, 0);
  for (size_t i = 0; i < maps.size(); ++i)
    writer.add(maps[i].spec->name, DType::f32, maps[i].spec->shape, Box::of(maps[i].spec->shape),
               params[i].data());
  writer.write_rank_file();
  json meta = {{"model", to_json(result.model)},
               {"step", 0},
               {"source",
                {{"format", "huggingface"},
                 {"path", fs::absolute(hf_dir).lexically_normal().string()},
                 {"architecture", result.architecture},
                 {"dtypes", result.source_dtypes}}}};
  if (hf_config) meta["hf_config"] = *hf_config;
  writer.commit(1, meta);
}

}  // namespace

std::map<std::string, std::string> hf_index_weight_map(const std::string& text,
                                                       const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not valid JSON: {}", what, e.what());
  }
  TESSEL_CHECK(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(),
               CorruptDataError, "{} has no weight_map object", what);
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    TESSEL_CHECK(file.is_string(), CorruptDataError, "{}: weight_map['{}'] is not a file name",
                 what, name);
    const std::string f = file.get<std::string>();
    // Shards live beside the index: a name with a directory part could point anywhere.
    TESSEL_CHECK(!f.empty() && fs::path(f).filename().string() == f && f != "." && f != "..",
                 CorruptDataError,
                 "{}: weight_map['{}'] names '{}', not a file in the index's directory", what, name,
                 f);
    out.emplace(name, f);
  }
  return out;
}

HfImportResult import_hf(const std::string& hf_dir, const std::string& out_checkpoint_dir,
                         const HfImportOptions& options) {
  fs::path dir = hf_dir;
  std::optional<fs::path> single_file;
  if (fs::is_regular_file(dir)) {
    single_file = dir;
    dir = dir.has_parent_path() ? dir.parent_path() : fs::path(".");
  }
  TESSEL_CHECK(fs::is_directory(dir), IoError,
               "'{}' is not a directory holding a Hugging Face model", hf_dir);
  const fs::path config_path = dir / "config.json";
  std::optional<json> hf_config;
  if (fs::exists(config_path)) hf_config = read_json_file(config_path.string());

  HfImportResult result;
  result.model = import_model(dir, hf_config, fmt::format("'{}'", config_path.string()), options);
  const ModelConfig& cfg = result.model;
  result.architecture = architecture_of(cfg.family);

  const HfWeights weights = open_weights(dir, single_file);
  const model::ModelSpec spec = model::ModelSpec::from(cfg);
  const auto maps = tensor_maps(spec);
  const MatchedNames names = match_names(weights, maps, cfg);
  result.ignored += names.ignored;
  const std::set<DType> dtypes = check_tensors(weights, maps, names.hf_names, cfg);
  const std::vector<std::vector<float>> params = convert_params(weights, maps, names.hf_names);
  if (names.tied_head_present) {
    check_tied_head(weights, spec, maps, names.hf_names, params);
    ++result.ignored;
  }
  for (DType t : dtypes)
    result.source_dtypes += (result.source_dtypes.empty() ? "" : ",") + std::string(dtype_name(t));
  write_imported(out_checkpoint_dir, hf_dir, hf_config, result, maps, params);
  result.tensors = maps.size();
  return result;
}

}  // namespace tessel::checkpoint
