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

#include "tessel/checkpoint/hf_tensors.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/hf_model_config.h"
#include "tessel/config/model_json.h"
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

}  // namespace

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
  result.model = config::model_config_from_json(meta.at("model"));
  result.architecture = config::hf_architecture(result.model.family);
  const model::ModelSpec spec = model::ModelSpec::from(result.model);
  const json base = meta.contains("hf_config") ? meta.at("hf_config") : json::object();
  const json config = config::hf_config_from_model(result.model, options.dtype, base);
  const auto maps = tensor_maps(spec);

  // Check every parameter before reading any data.
  for (const auto& m : maps) {
    const store::CheckpointTensor* t = reader.find(m.spec->name);
    TESSEL_CHECK(t != nullptr, CorruptDataError,
                 "checkpoint '{}' has no tensor '{}', a parameter of {}", result.checkpoint,
                 m.spec->name, config::describe_model(result.model));
    TESSEL_CHECK(t->shape == m.spec->shape, CorruptDataError,
                 "checkpoint '{}': tensor '{}' has shape {} but {} expects {}", result.checkpoint,
                 m.spec->name, t->shape.str(), config::describe_model(result.model),
                 m.spec->shape.str());
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
      json given = config::to_json(model);
      json theirs =
          config::to_json(config::model_config_from_hf(*hf_config, model.name, config_what));
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
  return config::model_config_from_hf(*hf_config, name, config_what);
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
  json meta = {{"model", config::to_json(result.model)},
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
  result.architecture = config::hf_architecture(cfg.family);

  const HfWeights weights = open_hf_weights(dir, single_file);
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
