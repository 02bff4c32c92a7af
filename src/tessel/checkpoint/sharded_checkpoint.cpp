#include "tessel/checkpoint/sharded_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "tessel/checkpoint/model_json.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/model/tp_shard.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::checkpoint {

using config::TrainConfig;

namespace fs = std::filesystem;

std::string checkpoint_step_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

std::optional<ResumePoint> find_resume_point(const config::TrainConfig& cfg) {
  if (cfg.checkpoint.dir.empty() || !cfg.checkpoint.resume) return std::nullopt;
  auto path = latest_sharded_checkpoint(cfg.checkpoint.dir);
  if (!path) return std::nullopt;
  return ResumePoint{*path, store::CheckpointReader(*path).meta().at("step").get<int64_t>()};
}

std::optional<std::string> latest_sharded_checkpoint(const std::string& dir) {
  const fs::path latest = fs::path(dir) / "latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::ifstream in(latest);
  std::string name;
  std::getline(in, name);
  const fs::path path = fs::path(dir) / name;
  TESSEL_CHECK(
      !name.empty() && name.find('/') == std::string::npos && fs::exists(path / "manifest.json"),
      CorruptDataError,
      "{} names checkpoint '{}', which is not a complete checkpoint in {}; remove "
      "'latest' to start from scratch or restore the directory",
      latest.string(), name, dir);
  return path.string();
}

namespace {

// Whether this rank writes `piece` (each element of the state exactly once; see the header).
bool writes(const layout::StateLayout& layout, const layout::StatePiece& piece) {
  const auto& plan = layout.plan();
  const auto& config = layout.spec().config();
  const auto& spec = layout.spec()[size_t(piece.tensor)];
  const auto coord = plan.coord_of(piece.rank);
  const auto& buffer = layout.buffers(piece.rank)[size_t(piece.buffer)];
  // The head stage's copy of a tied embedding: the embedding stage writes it.
  if (config.tie_embeddings && plan.num_stages() > 1 &&
      spec.name == model::global_param_name(config.family, model::GlobalParam::token_embedding)) {
    const auto ranges = plan.stage_ranges(config);
    if (!ranges[size_t(buffer.stage)].has_embedding) return false;
  }
  if (!model::tp_is_primary(spec, config, coord.tp, plan.tp)) return false;
  const bool sharded_over_dp = plan.zero_stage == 1 && layout::is_optimizer_state(piece.kind);
  return sharded_over_dp || coord.dp == 0;
}

}  // namespace

void add_rank_state(store::CheckpointWriter& writer, const layout::StateLayout& layout, int rank,
                    const std::vector<std::span<const float>>& buffers) {
  const auto& spec = layout.spec();
  std::vector<const layout::StatePiece*> mine;
  int64_t total = 0;
  for (const auto& piece : layout.pieces(rank)) {
    if (!writes(layout, piece) || piece.global.empty()) continue;
    mine.push_back(&piece);
    total += piece.global.volume();
  }
  // Gathered back to back, added, then copied once into memory the writer owns (snapshot), so
  // the caller's buffers and this staging vector may change as soon as this returns.
  std::vector<float> packed(static_cast<size_t>(total));
  int64_t at = 0;
  for (const auto* piece : mine) {
    const auto& b = buffers.at(size_t(piece->buffer));
    gather(b, piece->region(),
           std::span(packed).subspan(size_t(at), size_t(piece->global.volume())));
    const auto& p = spec[size_t(piece->tensor)];
    writer.add(layout::state_name(p.name, piece->kind), DType::f32, p.shape, piece->global,
               packed.data() + at);
    at += piece->global.volume();
  }
  writer.snapshot();
}

void publish_checkpoint(store::CheckpointWriter& writer, int num_ranks, const nlohmann::json& meta,
                        const std::string& dir, int keep) {
  writer.commit(num_ranks, meta);
  const std::string name = fs::path(writer.dir()).filename().string();
  { write_file_atomically((fs::path(dir) / "latest").string(), name + "\n"); }
  // Keep the newest `keep` step directories (names sort by step).
  std::vector<std::string> steps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos)
      steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + size_t(std::max(keep, 1)) < steps.size(); ++i) {
    if (steps[i] == name) continue;
    std::error_code ec;
    fs::remove_all(fs::path(dir) / steps[i], ec);
  }
}

nlohmann::json checkpoint_meta(const TrainConfig& cfg, const layout::Plan& plan, int64_t step,
                               int64_t cursor) {
  return {{"model", to_json(cfg.model)},
          {"plan", layout::to_json(plan)},
          {"step", step},
          {"lr_step", step},
          {"cursor", cursor},
          {"init_seed", cfg.training.seed},
          {"data_seed", cfg.data.seed},
          {"seq_len", cfg.data.seq_len},
          {"global_batch", cfg.training.global_batch}};
}

void check_resumable(const TrainConfig& cfg, const nlohmann::json& meta, const std::string& path) {
  auto saved = meta.at("model");
  auto wanted = to_json(cfg.model);
  saved.erase("name");
  wanted.erase("name");
  TESSEL_CHECK(saved == wanted, ConfigError,
               "checkpoint '{}' holds a different model ({}) than the config asks for ({}): "
               "point checkpoint.dir elsewhere or set checkpoint.resume: false",
               path, saved.dump(), wanted.dump());
  TESSEL_CHECK(meta.at("data_seed").get<uint64_t>() == cfg.data.seed &&
                   meta.at("seq_len").get<int64_t>() == cfg.data.seq_len &&
                   meta.at("global_batch").get<int64_t>() == cfg.training.global_batch,
               ConfigError,
               "checkpoint '{}' was trained with data.seed {}, data.seq_len {} and "
               "training.global_batch {}; resuming with other values would repeat or skip "
               "samples",
               path, meta.at("data_seed").get<uint64_t>(), meta.at("seq_len").get<int64_t>(),
               meta.at("global_batch").get<int64_t>());
}

void load_rank_state(const store::CheckpointReader& reader, const layout::StateLayout& layout,
                     int rank, const std::vector<std::span<float>>& buffers) {
  layout.fill(
      rank,
      [&](const model::ParamSpec& p, layout::StateKind kind, const Box& box, float* out) {
        const std::string name = layout::state_name(p.name, kind);
        const auto* t = reader.find(name);
        TESSEL_CHECK(t != nullptr, CorruptDataError,
                     "checkpoint {} has no tensor '{}' (a checkpoint of another model, or saved "
                     "without optimizer state?)",
                     reader.dir(), name);
        TESSEL_CHECK(t->shape == p.shape && t->dtype == DType::f32, CorruptDataError,
                     "checkpoint {}: tensor '{}' is {} {} but this model needs f32 {}",
                     reader.dir(), name, dtype_name(t->dtype), t->shape.str(), p.shape.str());
        reader.read_box(name, box, out);
      },
      buffers);
}

}  // namespace tessel::checkpoint
