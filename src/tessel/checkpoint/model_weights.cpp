#include "tessel/checkpoint/model_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <vector>

#include "tessel/checkpoint/hf_tensors.h"
#include "tessel/checkpoint/sharded_checkpoint.h"
#include "tessel/config/hf_model_config.h"
#include "tessel/config/model_json.h"
#include "tessel/core/check.h"
#include "tessel/core/json_file.h"
#include "tessel/store/checkpoint_store.h"

namespace tessel::checkpoint {

namespace {

using json = nlohmann::json;

class TesselWeights final : public ModelWeights {
 public:
  TesselWeights(model::ModelConfig model, std::unique_ptr<store::CheckpointReader> reader,
                std::string describe)
      : ModelWeights(std::move(model), reader->dir(), std::move(describe)),
        reader_(std::move(reader)) {
    for (const auto& p : spec()) {
      const store::CheckpointTensor* t = reader_->find(p.name);
      TESSEL_CHECK(t != nullptr, CorruptDataError,
                   "checkpoint '{}' has no tensor '{}', a parameter of {}", path(), p.name,
                   config::describe_model(this->model()));
      TESSEL_CHECK(t->shape == p.shape, CorruptDataError,
                   "checkpoint '{}': tensor '{}' has shape {} but {} expects {}", path(), p.name,
                   t->shape.str(), config::describe_model(this->model()), p.shape.str());
      TESSEL_CHECK(is_float_weight(t->dtype), CorruptDataError,
                   "checkpoint '{}': tensor '{}' has dtype {}; parameters are f32, bf16 or f16",
                   path(), p.name, dtype_name(t->dtype));
    }
    const auto& meta = reader_->meta();
    has_optimizer_state_ = meta.contains("cursor") && !spec().params().empty() &&
                           reader_->find(spec()[0].name + "/adam_m") != nullptr;
  }

  bool has_optimizer_state() const override { return has_optimizer_state_; }

  void read(const model::ParamSpec& p, const Box& box, float* out) const override {
    const store::CheckpointTensor& t = reader_->at(p.name);
    if (t.dtype == DType::f32) {
      reader_->read_box(p.name, box, out);
      return;
    }
    const size_t n = size_t(box.volume());
    std::vector<std::byte> raw(n * dtype_size(t.dtype));
    reader_->read_box(p.name, box, raw.data());
    convert(raw.data(), t.dtype, out, DType::f32, n);
  }

 private:
  std::unique_ptr<store::CheckpointReader> reader_;
  bool has_optimizer_state_ = false;
};

class HuggingFaceWeights final : public ModelWeights {
 public:
  HuggingFaceWeights(model::ModelConfig model, const fs::path& dir, std::string describe)
      : ModelWeights(std::move(model), dir.string(), std::move(describe)),
        weights_(open_hf_weights(dir, std::nullopt)),
        maps_(tensor_maps(spec())) {
    const MatchedNames names = match_names(weights_, maps_, this->model());
    hf_names_ = names.hf_names;
    check_tensors(weights_, maps_, hf_names_, this->model());
  }

  bool has_optimizer_state() const override { return false; }

  void read(const model::ParamSpec& p, const Box& box, float* out) const override {
    const int i = spec().index_of(p.name);
    TESSEL_CHECK(i >= 0, InvalidArgumentError, "{} has no parameter '{}'", describe(), p.name);
    read_hf_box(weights_, maps_[size_t(i)], hf_names_[size_t(i)], box, out);
  }

 private:
  HfWeights weights_;
  std::vector<TensorMap> maps_;  // point into spec(), which lives as long as this
  std::vector<std::string> hf_names_;
};

}  // namespace

ModelWeights::ModelWeights(model::ModelConfig model, std::string path, std::string describe)
    : model_(std::move(model)),
      spec_(model::ModelSpec::from(model_)),
      path_(std::move(path)),
      describe_(std::move(describe)) {}

std::unique_ptr<ModelWeights> ModelWeights::open(const std::string& path) {
  const fs::path dir = path;
  TESSEL_CHECK(fs::exists(dir), IoError, "'{}' does not exist", path);
  if (fs::exists(dir / "config.json")) {
    const json hf_config = read_json_file((dir / "config.json").string());
    std::string name = hf_config.is_object() && hf_config.contains("_name_or_path") &&
                               hf_config.at("_name_or_path").is_string()
                           ? hf_config.at("_name_or_path").get<std::string>()
                           : fs::absolute(dir).lexically_normal().filename().string();
    if (name.empty()) name = "hf-model";
    auto model = config::model_config_from_hf(hf_config, name,
                                              fmt::format("'{}'", (dir / "config.json").string()));
    const std::string arch = config::hf_architecture(model.family);
    auto w = std::make_unique<HuggingFaceWeights>(
        model, dir, fmt::format("Hugging Face model in '{}' ({})", path, arch));
    return w;
  }
  std::string step_dir = path;
  if (!fs::exists(dir / "manifest.json")) {
    // A training run's checkpoint.dir: its newest checkpoint.
    auto latest = fs::exists(dir / "latest") ? latest_sharded_checkpoint(path) : std::nullopt;
    TESSEL_CHECK(latest.has_value(), IoError,
                 "'{}' is neither a Hugging Face model (config.json with model.safetensors) nor a "
                 "tessel checkpoint (manifest.json, or a checkpoint.dir naming its newest "
                 "checkpoint in 'latest')",
                 path);
    step_dir = *latest;
  }
  auto reader = std::make_unique<store::CheckpointReader>(step_dir);
  const json& meta = reader->meta();
  TESSEL_CHECK(meta.is_object() && meta.contains("model"), CorruptDataError,
               "checkpoint '{}' has no model description (manifest meta \"model\"); it was not "
               "written by tessel's training or import",
               step_dir);
  auto model = config::model_config_from_json(meta.at("model"));
  const std::string describe =
      fmt::format("tessel checkpoint '{}' (step {})", step_dir, meta.value("step", int64_t(0)));
  return std::make_unique<TesselWeights>(std::move(model), std::move(reader), describe);
}

void load_rank_weights(const ModelWeights& weights, const layout::StateLayout& layout, int rank,
                       const std::vector<std::span<float>>& buffers) {
  auto a = config::to_json(layout.config()), b = config::to_json(weights.model());
  a.erase("name");
  b.erase("name");
  TESSEL_CHECK(a == b, InvalidArgumentError, "{} holds model {}, not the run's {}",
               weights.describe(), b.dump(), a.dump());
  layout.fill(
      rank,
      [&](const model::ParamSpec& p, layout::StateKind kind, const Box& box, float* out) {
        if (kind == layout::StateKind::param || kind == layout::StateKind::master) {
          weights.read(weights.spec().at(p.name), box, out);
        } else {
          std::fill(out, out + box.volume(), 0.0f);
        }
      },
      buffers);
}

}  // namespace tessel::checkpoint
