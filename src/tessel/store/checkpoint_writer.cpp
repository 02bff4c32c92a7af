// CheckpointWriter and cleanup_interrupted_saves: writing rank files, building the index,
// committing and publishing a save, and cleaning up after interrupted ones (checkpoint_store.h).
#include "tessel/store/checkpoint_store.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/store/checkpoint_format.h"
#include "tessel/store/checksum.h"
#include "tessel/tensor/allocator.h"

namespace tessel::store {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kRankFileFormat = "tessel-rank-file-1";
constexpr const char* kPiecesKey = "tessel.pieces";
constexpr const char* kFormatKey = "tessel.format";
constexpr const char* kSaveIdKey = "tessel.save_id";

std::string random_id() {
  std::random_device rd;
  uint64_t v = (uint64_t(rd()) << 32) ^ rd();
  return checksum_hex(v);
}

bool valid_save_id(const std::string& s) {
  if (s.empty() || s.size() > 128) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  return true;
}

std::string box_suffix(const Box& b) {
  std::string s = "[";
  for (size_t d = 0; d < b.rank(); ++d) s += fmt::format("{}{}:{}", d ? "," : "", b.lo(d), b.hi(d));
  return s + "]";
}

json box_to_json(const Box& b) {
  json a = json::array();
  for (size_t d = 0; d < b.rank(); ++d) a.push_back({b.lo(d), b.hi(d)});
  return a;
}

void write_json_file(const fs::path& p, const std::string& text) {
  AtomicFileWriter out(p.string());
  out.write(text.data(), text.size());
  out.commit();
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

fs::path parent_of(const std::string& dir) {
  auto p = fs::path(dir).parent_path();
  return p.empty() ? fs::path(".") : p;
}

bool is_checkpoint_dir(const fs::path& d) {
  return fs::exists(d / "manifest.json");
}

void check_replaceable(const std::string& dir) {
  std::error_code ec;
  auto st = fs::status(dir, ec);
  if (!fs::exists(st)) return;
  TESSEL_CHECK(fs::is_directory(st), IoError,
               "cannot save a checkpoint to '{}': it exists and is not a directory", dir);
  TESSEL_CHECK(is_checkpoint_dir(dir) || fs::is_empty(dir), IoError,
               "cannot save a checkpoint to '{}': it is a non-empty directory without "
               "manifest.json, not a checkpoint; refusing to replace it",
               dir);
}

// Deletes a checkpoint directory that a save just replaced: only the files a checkpoint holds,
// then the directory itself if nothing else is left.
void remove_old_checkpoint(const fs::path& old) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(old, ec)) {
    const auto name = e.path().filename().string();
    if (name == "index.json" || name == "manifest.json" || name.starts_with("rank-") ||
        name.find(".tmp.") != std::string::npos)
      fs::remove(e.path(), ec);
  }
  if (!fs::remove(old, ec))
    spdlog::warn(
        "kept '{}' (the replaced checkpoint) because it holds files a checkpoint does "
        "not write",
        old.string());
}

// The index of a save: reads the headers of rank files 0..num_ranks-1 in `staging` and checks
// that the pieces they list tile their tensors.
json build_index(const std::string& dir, const fs::path& staging, const std::string& save_id,
                 int num_ranks) {
  struct Entry {
    DType dtype;
    Shape shape;
    json pieces = json::array();
    std::vector<Box> boxes;
    std::string first_file;
  };
  std::map<std::string, Entry> entries;
  json files = json::object();
  for (int r = 0; r < num_ranks; ++r) {
    const auto name = rank_file_name(r);
    const auto path = staging / name;
    TESSEL_CHECK(fs::exists(path), IoError,
                 "cannot commit checkpoint '{}': {} is missing from '{}'; every rank must finish "
                 "write_rank_file() before one rank commits",
                 dir, name, staging.string());
    auto file = SafetensorsReader::open(path.string());
    const auto& md = file.metadata();
    auto fmt_it = md.find(kFormatKey), id_it = md.find(kSaveIdKey), pc_it = md.find(kPiecesKey);
    TESSEL_CHECK(fmt_it != md.end() && fmt_it->second == kRankFileFormat && pc_it != md.end(),
                 CorruptDataError, "'{}' is not a tessel rank file", path.string());
    TESSEL_CHECK(id_it != md.end() && id_it->second == save_id, IoError,
                 "'{}' belongs to save '{}', not to this save '{}'", path.string(),
                 id_it == md.end() ? "?" : id_it->second, save_id);
    json pieces;
    try {
      pieces = json::parse(pc_it->second);
    } catch (const json::exception& e) {
      TESSEL_THROW(CorruptDataError, "'{}': piece list is not JSON: {}", path.string(), e.what());
    }
    try {
      for (const auto& pc : pieces) {
        const std::string what = fmt::format("'{}'", path.string());
        const auto tname = detail::json_str(pc, "tensor", what);
        const auto in_file = detail::json_str(pc, "name", what);
        const DType dtype = parse_dtype(detail::json_str(pc, "dtype", what));
        Shape shape(detail::json_field(pc, "shape", what).get<std::vector<int64_t>>());
        Box box = detail::json_box(detail::json_field(pc, "box", what), what);
        const auto* st = file.find(in_file);
        TESSEL_CHECK(st && st->dtype == dtype && st->shape == box.shape(), CorruptDataError,
                     "'{}' does not hold tensor '{}' as {} {}", path.string(), in_file,
                     dtype_name(dtype), box.shape().str());
        auto it = entries.try_emplace(tname, Entry{dtype, shape, json::array(), {}, name}).first;
        auto& e = it->second;
        TESSEL_CHECK(e.dtype == dtype && e.shape == shape, InvalidArgumentError,
                     "tensor '{}' is {} {} in {} but {} {} in {}", tname, dtype_name(e.dtype),
                     e.shape.str(), e.first_file, dtype_name(dtype), shape.str(), name);
        json piece = {{"file", name},          {"tensor", in_file},
                      {"box", pc.at("box")},   {"bytes", pc.at("bytes")},
                      {"xxh3", pc.at("xxh3")}, {"chunk_bytes", pc.at("chunk_bytes")}};
        if (pc.contains("chunks")) piece["chunks"] = pc.at("chunks");
        e.pieces.push_back(std::move(piece));
        e.boxes.push_back(std::move(box));
      }
    } catch (const json::exception& e) {
      TESSEL_THROW(CorruptDataError, "'{}': bad piece list: {}", path.string(), e.what());
    }
    files[name] = {{"bytes", file.file_size()}, {"header_xxh3", checksum_hex(file.header_xxh3())}};
  }
  json tensors = json::object();
  for (auto& [name, e] : entries) {
    const auto problem = detail::tiling_problem(e.shape, e.boxes);
    TESSEL_CHECK(problem.empty(), InvalidArgumentError,
                 "cannot commit checkpoint '{}': tensor '{}' {} is not covered exactly once: {}",
                 dir, name, e.shape.str(), problem);
    tensors[name] = {{"dtype", std::string(dtype_name(e.dtype))},
                     {"shape", e.shape.dims()},
                     {"pieces", std::move(e.pieces)}};
  }
  return {{"format", std::string(detail::kIndexFormat)},
          {"version", kCheckpointVersion},
          {"files", std::move(files)},
          {"tensors", std::move(tensors)}};
}

// Makes `staging` the directory `dir` in one atomic step (see the header) and returns where the
// replaced checkpoint now is (empty when there was none).
fs::path publish(const std::string& staging, const std::string& dir, const std::string& save_id) {
  fs::path old;
  if (!fs::exists(dir)) {
    if (std::rename(staging.c_str(), dir.c_str()) != 0)
      TESSEL_THROW(IoError, "cannot rename '{}' to '{}': {}", staging, dir, std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    old = staging;
  } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
    old = dir + ".old-" + save_id;
    if (std::rename(dir.c_str(), old.c_str()) != 0)
      TESSEL_THROW(IoError, "cannot rename '{}' to '{}': {}", dir, old.string(),
                   std::strerror(errno));
    if (std::rename(staging.c_str(), dir.c_str()) != 0) {
      int err = errno;
      std::rename(old.c_str(), dir.c_str());
      TESSEL_THROW(IoError, "cannot rename '{}' to '{}': {}", staging, dir, std::strerror(err));
    }
  } else {
    TESSEL_THROW(IoError, "cannot swap '{}' into '{}': {}", staging, dir, std::strerror(errno));
  }
  fsync_dir(parent_of(dir));
  return old;
}

}  // namespace

CheckpointWriter::CheckpointWriter(std::string dir, int rank, CheckpointWriterOptions options)
    : dir_(detail::normalize_dir(std::move(dir))), rank_(rank), options_(std::move(options)) {
  TESSEL_CHECK(rank >= 0 && rank <= 99999, InvalidArgumentError,
               "checkpoint rank {} is outside 0..99999", rank);
  TESSEL_CHECK(options_.chunk_bytes > 0, InvalidArgumentError, "chunk_bytes must be positive");
  if (options_.save_id.empty()) options_.save_id = random_id();
  TESSEL_CHECK(valid_save_id(options_.save_id), InvalidArgumentError,
               "save id '{}' may hold only letters, digits, '-' and '_'", options_.save_id);
  staging_ = staging_dir_for(dir_, options_.save_id);
  check_replaceable(dir_);
}

void CheckpointWriter::add(const std::string& name, DType dtype, const Shape& global_shape,
                           const Box& box, const void* data) {
  TESSEL_CHECK(!name.empty() && name.find('[') == std::string::npos && name != "__metadata__",
               InvalidArgumentError, "invalid checkpoint tensor name '{}'", name);
  TESSEL_CHECK(box.rank() == global_shape.rank() && Box::of(global_shape).contains(box),
               InvalidArgumentError, "piece {} of '{}' lies outside its shape {}", box.str(), name,
               global_shape.str());
  const uint64_t nbytes = uint64_t(box.volume()) * dtype_size(dtype);
  TESSEL_CHECK(data != nullptr || nbytes == 0, InvalidArgumentError, "piece {} of '{}' has no data",
               box.str(), name);
  for (const auto& p : pieces_)
    TESSEL_CHECK(p.name != name || p.box != box, InvalidArgumentError,
                 "piece {} of '{}' added twice", box.str(), name);
  pieces_.push_back({name, dtype, global_shape, box, data, nbytes});
}

void CheckpointWriter::add(const std::string& name, const Tensor& tensor) {
  add(name, tensor.dtype(), tensor.shape(), Box::of(tensor.shape()), tensor.raw());
}

void CheckpointWriter::snapshot() {
  // From the caching host allocator: periodic saves of the same state reuse one block, so after
  // the first save a snapshot is a plain memcpy with no page faults (and big blocks get huge
  // pages).
  auto& alloc = HostAllocator::instance();
  std::shared_ptr<std::byte> buf(
      static_cast<std::byte*>(alloc.allocate(std::max<uint64_t>(bytes(), 1))),
      [](std::byte* p) { HostAllocator::instance().deallocate(p); });
  uint64_t off = 0;
  for (auto& p : pieces_) {
    if (p.nbytes) std::memcpy(buf.get() + off, p.data, p.nbytes);
    p.data = buf.get() + off;
    off += p.nbytes;
  }
  snapshot_ = std::move(buf);
}

uint64_t CheckpointWriter::bytes() const {
  uint64_t n = 0;
  for (const auto& p : pieces_) n += p.nbytes;
  return n;
}

void CheckpointWriter::stage(std::string_view name) const {
  if (options_.on_stage) options_.on_stage(name);
}

std::string CheckpointWriter::write_rank_file() {
  std::error_code ec;
  fs::create_directories(staging_, ec);
  TESSEL_CHECK(fs::is_directory(staging_), IoError,
               "cannot create checkpoint staging directory '{}': {}", staging_, ec.message());
  std::vector<SafetensorsTensor> tensors;
  json pieces = json::array();
  const uint64_t chunk = options_.chunk_bytes;
  for (const auto& p : pieces_) {
    const bool whole = p.box == Box::of(p.global_shape);
    std::string in_file = whole ? p.name : p.name + box_suffix(p.box);
    // The whole-piece and chunk hashes in one pass: each chunk is still in cache when it is
    // added to the whole-piece stream.
    Xxh3Stream whole_hash;
    json chunks = json::array();
    const auto* bytes = static_cast<const char*>(p.data);
    for (uint64_t off = 0; off < p.nbytes; off += chunk) {
      const uint64_t n = std::min(chunk, p.nbytes - off);
      chunks.push_back(checksum_hex(xxh3(bytes + off, n)));
      whole_hash.update(bytes + off, n);
    }
    json e = {{"tensor", p.name},
              {"name", in_file},
              {"dtype", std::string(dtype_name(p.dtype))},
              {"shape", p.global_shape.dims()},
              {"box", box_to_json(p.box)},
              {"bytes", p.nbytes},
              {"xxh3", checksum_hex(whole_hash.digest())},
              {"chunk_bytes", chunk}};
    if (chunks.size() > 1) e["chunks"] = std::move(chunks);
    pieces.push_back(std::move(e));
    tensors.push_back({in_file, p.dtype, p.box.shape(), p.data});
  }
  std::map<std::string, std::string> metadata = {{kFormatKey, std::string(kRankFileFormat)},
                                                 {kSaveIdKey, options_.save_id},
                                                 {kPiecesKey, pieces.dump()}};
  const std::string path = (fs::path(staging_) / rank_file_name(rank_)).string();
  write_safetensors(path, tensors, metadata);
  stage("rank_file");
  return path;
}

bool CheckpointWriter::mark_failed() noexcept {
  // Only inside a staging directory that exists: creating it again here could leave one behind
  // after the committer has cleaned up.
  const std::string path = (fs::path(staging_) / rank_failed_name(rank_)).string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

void CheckpointWriter::commit(int num_ranks, const nlohmann::json& meta) {
  TESSEL_CHECK(num_ranks >= 1, InvalidArgumentError, "commit needs num_ranks >= 1, got {}",
               num_ranks);
  TESSEL_CHECK(meta.is_object() || meta.is_null(), InvalidArgumentError,
               "checkpoint meta must be a JSON object");
  check_replaceable(dir_);
  const json index = build_index(dir_, staging_, options_.save_id, num_ranks);
  const std::string index_text = index.dump();
  write_json_file(fs::path(staging_) / "index.json", index_text);
  stage("index");

  json manifest = {{"format", std::string(kCheckpointFormat)},
                   {"version", kCheckpointVersion},
                   {"save_id", options_.save_id},
                   {"rank_files", num_ranks},
                   {"index",
                    {{"file", "index.json"},
                     {"bytes", index_text.size()},
                     {"xxh3", checksum_hex(xxh3(index_text.data(), index_text.size()))}}},
                   {"meta", meta.is_null() ? json::object() : meta}};
  manifest["checksum"] = checksum_hex(detail::manifest_checksum(manifest));
  write_json_file(fs::path(staging_) / "manifest.json", manifest.dump(2) + "\n");
  stage("manifest");

  const fs::path old = publish(staging_, dir_, options_.save_id);
  stage("publish");
  if (!old.empty()) remove_old_checkpoint(old);
}

int cleanup_interrupted_saves(const std::string& dir_in) {
  const std::string dir = detail::normalize_dir(dir_in);
  const fs::path parent = parent_of(dir);
  const std::string base = fs::path(dir).filename().string();
  std::error_code ec;
  std::vector<fs::path> tmp, old;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const auto name = e.path().filename().string();
    if (!e.is_directory()) continue;
    if (name.starts_with(base + ".tmp-")) tmp.push_back(e.path());
    if (name.starts_with(base + ".old-")) old.push_back(e.path());
  }
  if (!fs::exists(dir)) {
    for (auto it = old.begin(); it != old.end(); ++it) {
      if (is_checkpoint_dir(*it) && std::rename(it->c_str(), dir.c_str()) == 0) {
        spdlog::info("restored checkpoint '{}' from '{}'", dir, it->string());
        old.erase(it);
        break;
      }
    }
  }
  int removed = 0;
  for (const auto& v : {tmp, old})
    for (const auto& p : v)
      if (fs::remove_all(p, ec) > 0) ++removed;
  if (removed) fsync_dir(parent);
  return removed;
}
}  // namespace tessel::store
