#include "tessel/checkpoint/sharded_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "tessel/config/model_json.h"
#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/model/tp_shard.h"
#include "tessel/store/checksum.h"
#include "tessel/tensor/box_copy.h"

namespace tessel::checkpoint {

using config::TrainConfig;

namespace fs = std::filesystem;

std::string checkpoint_step_name(int64_t step) {
  return fmt::format("step-{:08d}", step);
}

namespace {

// The names of the published step directories in `dir` (not staging, swapped-out or corrupt
// ones, which carry a '.'), oldest first: the names sort by step.
std::vector<std::string> step_dir_names(const std::string& dir) {
  std::vector<std::string> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos)
      steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace

std::optional<std::string> newest_intact_checkpoint(const std::string& dir) {
  auto steps = step_dir_names(dir);
  std::reverse(steps.begin(), steps.end());  // newest first
  std::error_code ec;
  std::optional<std::string> named;
  try {
    named = latest_sharded_checkpoint(dir);
  } catch (const CorruptDataError& e) {
    spdlog::warn("{}", e.what());  // `latest` is rewritten below
  }
  for (const auto& name : steps) {
    const std::string path = (fs::path(dir) / name).string();
    try {
      store::CheckpointReader(path).verify();
    } catch (const CorruptDataError& e) {
      const std::string aside = path + ".corrupt";
      fs::remove_all(aside, ec);
      fs::rename(path, aside, ec);
      spdlog::warn("checkpoint {} is damaged ({}); moved aside to {}, using the one before it",
                   path, e.what(), aside);
      continue;
    }
    if (named != path) write_file_atomically((fs::path(dir) / "latest").string(), name + "\n");
    return path;
  }
  // `latest` would name what is not there: later reads of it must not fail on it.
  fs::remove(fs::path(dir) / "latest", ec);
  return std::nullopt;
}

std::optional<ResumePoint> find_resume_point(const config::TrainConfig& cfg) {
  if (cfg.checkpoint.dir.empty() || !cfg.checkpoint.resume) return std::nullopt;
  const auto& dir = cfg.checkpoint.dir;
  // What shows that a run saved here before: `latest`, a checkpoint, one set aside as damaged.
  std::vector<std::string> seen;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n == "latest" || (n.rfind("step-", 0) == 0 && n.find(".tmp-") == std::string::npos))
      seen.push_back(n);
  }
  auto path = newest_intact_checkpoint(dir);
  if (!path) {
    // Starting from scratch here would silently throw away what the job trained.
    std::sort(seen.begin(), seen.end());
    std::string list;
    for (const auto& n : seen) list += (list.empty() ? "" : ", ") + n;
    TESSEL_CHECK(seen.empty(), CorruptDataError,
                 "checkpoint.dir '{}' has no intact checkpoint to resume from (found: {}; damaged "
                 "ones are set aside as step-N.corrupt): restore a checkpoint there, or set "
                 "checkpoint.resume: false to start from scratch",
                 dir, list);
    return std::nullopt;
  }
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
  point_latest_and_prune(dir, fs::path(writer.dir()).filename().string(), keep);
}

void point_latest_and_prune(const std::string& dir, const std::string& name, int keep) {
  { write_file_atomically((fs::path(dir) / "latest").string(), name + "\n"); }
  // Keep the newest `keep` step directories.
  const auto steps = step_dir_names(dir);
  const size_t kept = size_t(std::max(keep, 1));
  for (size_t i = 0; i + kept < steps.size(); ++i) {
    if (steps[i] == name) continue;
    std::error_code ec;
    fs::remove_all(fs::path(dir) / steps[i], ec);
  }
  // A checkpoint set aside as damaged (step-N.corrupt) is kept for a look until `keep` newer
  // intact ones exist, so that set-aside copies cannot fill the disk the next saves need.
  if (steps.size() < kept) return;
  const std::string oldest_kept = steps[steps.size() - kept];
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step-", 0) == 0 && n.ends_with(".corrupt") &&
        n.substr(0, n.size() - std::string_view(".corrupt").size()) < oldest_kept) {
      std::error_code rm;
      fs::remove_all(e.path(), rm);
    }
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<CheckpointDirLock> lock_checkpoint_dir(const std::string& dir) {
  std::error_code ec;
  TESSEL_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), ConfigError,
               "checkpoint.dir '{}' is a file, not a directory: name a directory", dir);
  fs::create_directories(dir, ec);
  TESSEL_CHECK(!ec, IoError, "cannot create checkpoint.dir '{}': {}", dir, ec.message());
  const std::string lock = (fs::path(dir) / ".lock").string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TESSEL_CHECK(fd >= 0, IoError,
               "cannot write into checkpoint.dir '{}': {} (a read-only file system or directory? "
               "name a writable one)",
               dir, std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    TESSEL_CHECK(err != EWOULDBLOCK, ConfigError,
                 "checkpoint.dir '{}' is in use by another running job (it holds {}): two jobs "
                 "writing one directory would destroy each other's checkpoints; give this one "
                 "another checkpoint.dir",
                 dir, lock);
    TESSEL_THROW(IoError, "cannot lock '{}': {}", lock, std::strerror(err));
  }
  // The lock file may be writable in a directory that is not (a file created before it was made
  // read-only): try what a save does, creating an entry.
  const std::string probe = (fs::path(dir) / fmt::format(".probe-{}", ::getpid())).string();
  const int p = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (p < 0) {
    const int err = errno;
    ::close(fd);
    TESSEL_THROW(IoError,
                 "cannot write into checkpoint.dir '{}': {} (a read-only file system or "
                 "directory? name a writable one)",
                 dir, std::strerror(err));
  }
  ::close(p);
  ::unlink(probe.c_str());
  return std::make_unique<CheckpointDirLock>(fd);
}

int remove_interrupted_saves(const std::string& dir) {
  std::set<std::string> bases;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step-", 0) != 0) continue;
    for (const char* mark : {".tmp-", ".old-"})
      if (const auto at = n.find(mark); at != std::string::npos) bases.insert(n.substr(0, at));
  }
  int removed = 0;
  for (const auto& base : bases)
    removed += store::cleanup_interrupted_saves((fs::path(dir) / base).string());
  if (removed > 0)
    spdlog::info("removed {} director{} left by interrupted saves in {}", removed,
                 removed == 1 ? "y" : "ies", dir);
  return removed;
}

nlohmann::json data_fingerprint(const std::string& path) {
  std::string file = path;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) {
    // A Megatron prefix: its .bin holds the tokens.
    const std::string prefix =
        path.ends_with(".idx") || path.ends_with(".bin") ? path.substr(0, path.size() - 4) : path;
    file = prefix + ".bin";
  }
  std::ifstream in(file, std::ios::binary);
  const auto size = fs::file_size(file, ec);
  if (!in || ec) return nlohmann::json::object();
  std::vector<char> head(size_t(std::min<uintmax_t>(size, 1 << 20)));
  in.read(head.data(), std::streamsize(head.size()));
  if (!in) return nlohmann::json::object();
  return {{"bytes", size},
          {"head_xxh3", store::checksum_hex(store::xxh3(head.data(), head.size()))}};
}

nlohmann::json checkpoint_meta(const TrainConfig& cfg, const layout::Plan& plan, int64_t step,
                               int64_t cursor) {
  return {{"model", config::to_json(cfg.model)},
          {"data", {{"path", cfg.data.path}, {"fingerprint", data_fingerprint(cfg.data.path)}}},
          {"plan", layout::to_json(plan)},
          {"step", step},
          {"lr_step", step},
          {"cursor", cursor},
          {"init_seed", cfg.training.seed},
          {"data_seed", cfg.data.seed},
          {"seq_len", cfg.data.seq_len},
          {"global_batch", cfg.training.global_batch}};
}

namespace {

void check_resumable_meta(const TrainConfig& cfg, const nlohmann::json& meta,
                          const std::string& path) {
  auto saved = meta.at("model");
  auto wanted = config::to_json(cfg.model);
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
  // Checkpoints from before the fingerprint carry none: nothing to compare.
  if (!meta.contains("data")) return;
  const auto& saved_data = meta.at("data");
  const auto saved_print = saved_data.value("fingerprint", nlohmann::json::object());
  const auto print = data_fingerprint(cfg.data.path);
  if (saved_print.empty() || print.empty()) return;
  TESSEL_CHECK(saved_print == print, ConfigError,
               "checkpoint '{}' was trained on other data ({}: {}) than data.path '{}' ({}): "
               "resuming would apply its data cursor to different tokens; use the same data, or "
               "set checkpoint.resume: false (or another checkpoint.dir) to start afresh",
               path, saved_data.value("path", std::string("?")), saved_print.dump(), cfg.data.path,
               print.dump());
  if (saved_data.value("path", cfg.data.path) != cfg.data.path)
    spdlog::info("checkpoint '{}' was trained on '{}'; data.path '{}' holds the same tokens", path,
                 saved_data.value("path", std::string()), cfg.data.path);
}

}  // namespace

void check_resumable(const TrainConfig& cfg, const nlohmann::json& meta, const std::string& path) {
  try {
    check_resumable_meta(cfg, meta, path);
  } catch (const nlohmann::json::exception& e) {
    // A field missing or of the wrong type: a damaged manifest, or a checkpoint that `tessel
    // train` did not write (a conversion holds weights only).
    // An import (`tessel convert`) holds weights only: no cursor, seeds or optimizer state.
    const bool weights_only =
        meta.is_object() && meta.contains("model") && !meta.contains("cursor");
    TESSEL_CHECK(!weights_only, ConfigError,
                 "checkpoint '{}' holds weights only (no optimizer state, data cursor or seeds: "
                 "an import or conversion), so a run cannot resume from it; to fine-tune from "
                 "it, write `init_from: {}` in the config and point checkpoint.dir at a "
                 "directory of its own",
                 path, path);
    TESSEL_THROW(CorruptDataError,
                 "checkpoint '{}' cannot be resumed from: the meta in its manifest.json is not "
                 "what `tessel train` writes ({}); point checkpoint.dir at a training checkpoint "
                 "or set checkpoint.resume: false",
                 path, e.what());
  }
}

void load_rank_state(const store::CheckpointReader& reader, const layout::StateLayout& layout,
                     int rank, const std::vector<std::span<float>>& buffers,
                     const store::PieceFetcher& fetch) {
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
        reader.read_box(name, box, out, fetch);
      },
      buffers);
}

}  // namespace tessel::checkpoint
