#include "tessel/checkpoint/hf_tensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>

#include "tessel/checkpoint/hf_convert.h"
#include "tessel/config/hf_model_config.h"
#include "tessel/core/check.h"

namespace tessel::checkpoint {

using model::Family;
using model::ModelConfig;
using json = nlohmann::json;

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

HfWeights open_hf_weights(const fs::path& dir, const std::optional<fs::path>& single_file) {
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
               missing.size(), config::describe_model(cfg), join_first(missing, 5), hint);
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
               weights.what, unexpected.size(), config::describe_model(cfg),
               join_first(unexpected, 5));
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
                   config::describe_model(cfg), cfg.vocab_size);
    }
    TESSEL_CHECK(e.shape == m.hf_shape, ConfigError,
                 "{}: tensor '{}' has shape {} but {} expects {}{}", weights.what, hf_names[i],
                 e.shape.str(), config::describe_model(cfg), m.hf_shape.str(),
                 m.transpose ? " (Conv1D layout [in, out])" : "");
  }
  return dtypes;
}

void read_hf_box(const HfWeights& w, const TensorMap& m, const std::string& hf_name, const Box& box,
                 float* out) {
  const Shape& shape = m.spec->shape;
  TESSEL_CHECK(box.rank() == shape.rank() && Box::of(shape).contains(box), InvalidArgumentError,
               "box {} is outside parameter '{}' of shape {}", box.str(), m.spec->name,
               shape.str());
  const store::SafetensorsEntry& e = *w.find(hf_name);
  const auto& file = w.file_of(hf_name);
  // Reads an HF box (dense, row-major) as f32.
  std::vector<std::byte> raw;
  auto read_f32_box = [&](const Box& hf_box, float* dst) {
    const size_t n = size_t(hf_box.volume());
    if (n == 0) return;
    if (e.dtype == DType::f32) {
      file.read_box(hf_name, hf_box, dst);
      return;
    }
    raw.resize(n * dtype_size(e.dtype));
    file.read_box(hf_name, hf_box, raw.data());
    convert(raw.data(), e.dtype, dst, DType::f32, n);
  };
  if (m.transpose) {
    // tessel [out, in] rows r, cols c are HF [in, out] rows c, cols r.
    const Box hf_box({box.lo()[1], box.lo()[0]}, {box.hi()[1], box.hi()[0]});
    std::vector<float> tmp(size_t(hf_box.volume()));
    read_f32_box(hf_box, tmp.data());
    transpose(tmp.data(), hf_box.extent(0), hf_box.extent(1), out);
    return;
  }
  // Rows at or beyond m.rows are vocabulary padding: zeros.
  const int64_t lo = box.lo()[0], hi = box.hi()[0];
  const int64_t real_hi = std::min(hi, std::max(lo, m.rows));
  const int64_t row_elems = box.volume() / std::max<int64_t>(1, hi - lo);
  if (real_hi > lo) {
    std::vector<int64_t> hlo = box.lo(), hhi = box.hi();
    hhi[0] = real_hi;
    read_f32_box(Box(hlo, hhi), out);
  }
  std::fill(out + (real_hi - lo) * row_elems, out + (hi - lo) * row_elems, 0.0f);
}

}  // namespace tessel::checkpoint
