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

// Rows of at most this many bytes are converted at a time: a conversion's memory does not grow
// with the model.
constexpr uint64_t kBlockBytes = uint64_t(16) << 20;

int64_t rows_per_block(int64_t row_bytes) {
  return std::max<int64_t>(1, int64_t(kBlockBytes) / std::max<int64_t>(1, row_bytes));
}

bool weight_map_has_file(const json& weight_map, const std::string& file) {
  for (const auto& [name, f] : weight_map.items())
    if (f == file) return true;
  return false;
}

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

  // Padding rows are dropped; say so when that loses anything (training keeps them zero).
  for (const auto& m : maps) {
    if (!m.vocab || m.rows >= m.spec->shape[0]) continue;
    const store::CheckpointTensor& t = reader.at(m.spec->name);
    std::vector<int64_t> plo(m.spec->shape.rank(), 0), phi = m.spec->shape.dims();
    plo[0] = m.rows;
    Tensor pad = reader.read(t.name, Box(plo, phi)).to(DType::f32);
    const auto values = pad.span<float>();
    if (std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; }))
      spdlog::warn(
          "checkpoint '{}': vocabulary padding rows {}..{} of '{}' are not zero; they are not "
          "part of the exported model",
          result.checkpoint, m.rows, m.spec->shape[0] - 1, t.name);
  }
  std::set<std::string> names;
  for (const auto& m : maps) names.insert(m.spec->name);
  for (const auto& t : reader.tensors()) result.skipped += names.contains(t.name) ? 0 : 1;
  result.tensors = maps.size();

  // Shards in parameter order, as transformers' save_pretrained cuts them: a tensor that would
  // take a shard past the limit starts the next one (a tensor larger than the limit is a shard of
  // its own).
  const uint64_t esize = dtype_size(options.dtype);
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < maps.size(); ++i) {
    const uint64_t bytes = uint64_t(maps[i].hf_numel()) * esize;
    if (shards.empty() || (in_shard > 0 && in_shard + bytes > options.max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }
  const size_t n_shards = shards.size();
  auto shard_name = [&](size_t k) {
    return n_shards == 1 ? std::string("model.safetensors")
                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n_shards);
  };

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TESSEL_CHECK(!ec, IoError, "cannot create directory '{}': {}", out_dir, ec.message());
  // Each tensor is read, transposed where GPT-2's Conv1D wants it and narrowed to the export's
  // dtype a block of rows at a time, straight into its shard: memory stays bounded whatever the
  // model (the limit is kBlockBytes of f32 and its conversions).
  std::vector<float> f32, transposed;
  std::vector<std::byte> narrow;
  auto read_f32_box = [&](const store::CheckpointTensor& t, const Box& box, float* out) {
    const size_t n = size_t(box.volume());
    if (t.dtype == DType::f32) {
      reader.read_box(t.name, box, out);
      return;
    }
    narrow.resize(n * dtype_size(t.dtype));
    reader.read_box(t.name, box, narrow.data());
    convert(narrow.data(), t.dtype, out, DType::f32, n);
  };
  json weight_map = json::object();
  std::vector<std::byte> block;
  for (size_t k = 0; k < n_shards; ++k) {
    std::vector<store::SafetensorsTensor> tensors;
    for (size_t i : shards[k]) {
      tensors.push_back({maps[i].spec->name, options.dtype, maps[i].hf_shape, nullptr});
      weight_map[maps[i].spec->name] = shard_name(k);
    }
    store::SafetensorsStream stream;
    stream.produce = [&](size_t j, const store::SafetensorsStream::Write& write) {
      const TensorMap& m = maps[shards[k][j]];
      const store::CheckpointTensor& t = reader.at(m.spec->name);
      const Shape& hf = m.hf_shape;
      const int64_t hf_rows = hf.rank() == 0 ? 1 : hf[0];
      const int64_t row = hf.rank() == 0 ? 1 : hf.numel() / std::max<int64_t>(1, hf_rows);
      const int64_t step = rows_per_block(row * int64_t(sizeof(float)));
      for (int64_t r = 0; r < hf_rows; r += step) {
        const int64_t r1 = std::min(hf_rows, r + step);
        const size_t n = size_t((r1 - r) * row);
        f32.resize(n);
        const float* src = f32.data();
        if (m.transpose) {
          // HF rows [r, r1) of [in, out] are tessel's columns [r, r1) of [out, in].
          const int64_t out_dim = m.spec->shape[0];
          read_f32_box(t, Box({0, r}, {out_dim, r1}), f32.data());
          transposed.resize(n);
          transpose(f32.data(), out_dim, r1 - r, transposed.data());
          src = transposed.data();
        } else {
          std::vector<int64_t> lo(hf.rank(), 0), hi = hf.dims();
          if (!lo.empty()) lo[0] = r, hi[0] = r1;
          read_f32_box(t, Box(lo, hi), f32.data());
        }
        block.resize(n * esize);
        convert(src, DType::f32, block.data(), options.dtype, n);
        write(block.data(), block.size());
      }
    };
    // transformers rejects safetensors files whose metadata lacks format "pt".
    result.bytes += store::write_safetensors((fs::path(out_dir) / shard_name(k)).string(), tensors,
                                             {{"format", "pt"}}, stream);
  }
  result.shards = n_shards;
  const fs::path index = fs::path(out_dir) / "model.safetensors.index.json";
  if (n_shards > 1) {
    const json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically(index.string(), j.dump(2) + "\n");
  }
  write_file_atomically((fs::path(out_dir) / "config.json").string(), config.dump(2) + "\n");
  // What an earlier export of another sharding left would be read instead of (or beside) this
  // one: removed once this export is complete.
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    const bool ours =
        n_shards == 1 ? name == "model.safetensors"
                      : name == index.filename().string() || weight_map_has_file(weight_map, name);
    const bool model_file = name == "model.safetensors" || name == index.filename().string() ||
                            (name.starts_with("model-") && name.ends_with(".safetensors"));
    if (model_file && !ours) fs::remove(entry.path(), ec);
  }
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

// A head saved beside a tied embedding must equal it (it is then dropped). Compared block by
// block, in the file's bytes.
void check_tied_head(const HfWeights& weights, const model::ModelSpec& spec,
                     const std::vector<std::string>& hf_names) {
  const ModelConfig& cfg = spec.config();
  const std::string head = model::global_param_name(cfg.family, model::GlobalParam::lm_head);
  const std::string wte = model::global_param_name(cfg.family, model::GlobalParam::token_embedding);
  const std::string& emb = hf_names[size_t(spec.index_of(wte))];
  const store::SafetensorsEntry& a = *weights.find(head);
  const store::SafetensorsEntry& b = *weights.find(emb);
  bool same = a.shape == b.shape && a.dtype == b.dtype;
  if (same && a.shape.rank() == 2) {
    const int64_t rows = a.shape[0], cols = a.shape[1];
    const int64_t block = rows_per_block(cols * int64_t(dtype_size(a.dtype)));
    std::vector<std::byte> x, y;
    for (int64_t r = 0; same && r < rows; r += block) {
      const Box box({r, 0}, {std::min(rows, r + block), cols});
      x.resize(size_t(box.volume()) * dtype_size(a.dtype));
      y.resize(x.size());
      weights.file_of(head).read_box(head, box, x.data());
      weights.file_of(emb).read_box(emb, box, y.data());
      same = std::memcmp(x.data(), y.data(), x.size()) == 0;
    }
  }
  TESSEL_CHECK(same, ConfigError,
               "{} holds an '{}' that differs from the token embedding '{}' although "
               "tie_word_embeddings is true: set \"tie_word_embeddings\": false in config.json "
               "to keep it as a separate head",
               weights.what, head, emb);
}

// Step 0's checkpoint of the converted parameters, with the source in its metadata. Each
// parameter is read from the Hugging Face files while the rank file is written, one chunk of
// rows at a time (CheckpointWriter::add_streamed): memory stays bounded whatever the model.
void write_imported(const std::string& out_checkpoint_dir, const std::string& hf_dir,
                    const std::optional<json>& hf_config, const HfImportResult& result,
                    const HfWeights& weights, const std::vector<TensorMap>& maps,
                    const std::vector<std::string>& hf_names) {
  store::CheckpointWriter writer(out_checkpoint_dir, 0);
  // One scratch buffer for all parameters (produced one after another; see initialised_checkpoint).
  std::vector<float> buf;
  for (size_t i = 0; i < maps.size(); ++i) {
    const TensorMap& m = maps[i];
    const Shape& shape = m.spec->shape;
    const int64_t row = shape.rank() == 0 ? 1 : shape.numel() / std::max<int64_t>(1, shape[0]);
    writer.add_streamed(
        m.spec->name, DType::f32, shape, Box::of(shape),
        [&weights, &m, &name = hf_names[i], row, &buf](uint64_t offset, uint64_t n, void* out) {
          // The rows holding elements [e0, e1), read whole, then the range copied out.
          const int64_t e0 = int64_t(offset / sizeof(float)), e1 = e0 + int64_t(n / sizeof(float));
          const int64_t r0 = e0 / row, r1 = (e1 + row - 1) / row;
          std::vector<int64_t> lo(m.spec->shape.rank(), 0), hi = m.spec->shape.dims();
          if (!lo.empty()) lo[0] = r0, hi[0] = r1;
          buf.resize(size_t((r1 - r0) * row));
          read_hf_box(weights, m, name, Box(lo, hi), buf.data());
          std::memcpy(out, buf.data() + (e0 - r0 * row), n);
        });
  }
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
  if (names.tied_head_present) {
    check_tied_head(weights, spec, names.hf_names);
    ++result.ignored;
  }
  for (DType t : dtypes)
    result.source_dtypes += (result.source_dtypes.empty() ? "" : ",") + std::string(dtype_name(t));
  write_imported(out_checkpoint_dir, hf_dir, hf_config, result, weights, maps, names.hf_names);
  result.tensors = maps.size();
  return result;
}

}  // namespace tessel::checkpoint
