// The tensors of a Hugging Face model and how each maps onto a tessel parameter: shared by the
// conversions (hf_convert.h) and by reading a Hugging Face directory in place (model_weights.h).
// Internal to the checkpoint subsystem.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "tessel/model/model_config.h"
#include "tessel/model/model_spec.h"
#include "tessel/store/safetensors.h"
#include "tessel/tensor/box.h"
#include "tessel/tensor/dtype.h"

namespace tessel::checkpoint {

namespace fs = std::filesystem;

// GPT-2's names carry it in transformers' current files, not in the hub's original ones.
inline constexpr std::string_view kGpt2Prefix = "transformer.";

bool is_float_weight(DType t);

// dst [cols, rows] = src [rows, cols] transposed.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst);

// One parameter and how it looks on the Hugging Face side.
struct TensorMap {
  const model::ParamSpec* spec;
  Shape hf_shape;
  bool transpose = false;  // GPT-2 Conv1D: HF [in, out] is tessel's [out, in] transposed
  bool vocab = false;      // embedding / head: only the first vocab_size rows exist in HF
  int64_t rows = 0;        // rows of the tessel tensor present in HF (all but vocab padding)
  int64_t hf_numel() const { return hf_shape.numel(); }
};

// One map per parameter of `spec`, in its order (pointing into it).
std::vector<TensorMap> tensor_maps(const model::ModelSpec& spec);

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

// Opens DIR/model.safetensors (or `single_file`), else the shards DIR's index names. Throws
// IoError when neither exists, CorruptDataError for a bad index or file.
HfWeights open_hf_weights(const fs::path& dir, const std::optional<fs::path>& single_file);

// Buffers some exports saved beside the parameters; they are recomputed, not learned.
bool is_ignorable_buffer(const std::string& name);

// The HF tensor for parameter `m`: its own name, or for GPT-2 also without "transformer.".
// Returns "" when absent; throws ConfigError when both spellings are present.
std::string find_hf_name(const HfWeights& w, const TensorMap& m);

// Reads HF tensor `hf_name` as f32 in HF layout ([rows, cols] as stored).
std::vector<float> read_f32(const HfWeights& w, const std::string& hf_name);

// "a, b, c, ... (N in all)".
std::string join_first(const std::vector<std::string>& names, size_t limit);

// The HF tensors of the model's parameters, matched by name.
struct MatchedNames {
  std::vector<std::string> hf_names;  // per parameter (per TensorMap)
  size_t ignored = 0;                 // recomputed buffers beside the parameters
  bool tied_head_present = false;     // an lm_head beside a tied embedding
};
// Names first: all missing tensors in one ConfigError, then all unexpected ones.
MatchedNames match_names(const HfWeights& weights, const std::vector<TensorMap>& maps,
                         const model::ModelConfig& cfg);
// Checks every matched tensor's dtype and shape (ConfigError naming it); returns the dtypes.
std::set<DType> check_tensors(const HfWeights& weights, const std::vector<TensorMap>& maps,
                              const std::vector<std::string>& hf_names,
                              const model::ModelConfig& cfg);

// Reads `box` (in tessel's layout of m.spec) of HF tensor `hf_name` as f32 into `out`: a Conv1D
// weight's transposed box, vocabulary padding rows as zeros. Reads only the bytes the box needs.
void read_hf_box(const HfWeights& w, const TensorMap& m, const std::string& hf_name, const Box& box,
                 float* out);

}  // namespace tessel::checkpoint
