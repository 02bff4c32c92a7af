#include "tessel/store/checkpoint_store.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/core/log.h"
#include "tessel/store/checksum.h"
#include "tessel/tensor/allocator.h"
#include "tessel/tensor/region_runs.h"

namespace tessel::store {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kIndexFormat = "tessel-checkpoint-index";
constexpr std::string_view kRankFileFormat = "tessel-rank-file-1";
constexpr const char* kPiecesKey = "tessel.pieces";
constexpr const char* kFormatKey = "tessel.format";
constexpr const char* kSaveIdKey = "tessel.save_id";
constexpr uint64_t kMaxJsonFile = uint64_t(1) << 30;
// Largest single pread of a box read; reads go through a scratch buffer of this size when the
// chunks read hold more than the needed bytes.
constexpr uint64_t kWindowBytes = uint64_t(64) << 20;

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

// A name from index.json that may be joined to the checkpoint directory: no separators, no
// "." or "..", printable ASCII only.
bool plain_file_name(const std::string& s) {
  if (s.empty() || s == "." || s == ".." || s.size() > 255) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
      return false;
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

// Why `boxes` do not tile `shape` exactly, or "" when they do.
std::string tiling_problem(const Shape& shape, const std::vector<Box>& boxes) {
  const Box whole = Box::of(shape);
  int64_t volume = 0;
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (boxes[i].rank() != shape.rank() || !whole.contains(boxes[i]))
      return fmt::format("piece {} lies outside the shape {}", boxes[i].str(), shape.str());
    volume += boxes[i].volume();
    for (size_t j = 0; j < i; ++j)
      if (!boxes[i].intersect(boxes[j]).empty())
        return fmt::format("pieces {} and {} overlap", boxes[j].str(), boxes[i].str());
  }
  if (volume != shape.numel())
    return fmt::format("its pieces cover {} of its {} elements", volume, shape.numel());
  return "";
}

std::string read_small_file(const fs::path& p, const std::string& what_for) {
  std::error_code ec;
  auto size = fs::file_size(p, ec);
  if (ec) TESSEL_THROW(IoError, "cannot read {} '{}': {}", what_for, p.string(), ec.message());
  if (size > kMaxJsonFile)
    TESSEL_THROW(CorruptDataError, "{} '{}' is {} bytes, implausibly large", what_for, p.string(),
                 size);
  std::ifstream in(p, std::ios::binary);
  std::string s(size, '\0');
  if (!in.read(s.data(), std::streamsize(size)))
    TESSEL_THROW(IoError, "cannot read {} '{}'", what_for, p.string());
  return s;
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

// DIR as given but without trailing separators, so "ckpt/" and "ckpt" stage beside each other.
std::string normalize_dir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  TESSEL_CHECK(!dir.empty(), InvalidArgumentError, "checkpoint directory name is empty");
  return dir;
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

uint64_t json_u64(const json& v, const std::string& what) {
  if (!v.is_number_unsigned())
    TESSEL_THROW(CorruptDataError, "{} is not a non-negative integer", what);
  return v.get<uint64_t>();
}

std::string json_str(const json& obj, const char* key, const std::string& what) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string())
    TESSEL_THROW(CorruptDataError, "{}: \"{}\" is missing or not a string", what, key);
  return it->get<std::string>();
}

const json& json_field(const json& obj, const char* key, const std::string& what) {
  auto it = obj.find(key);
  if (it == obj.end()) TESSEL_THROW(CorruptDataError, "{}: \"{}\" is missing", what, key);
  return *it;
}

uint64_t json_hash(const json& obj, const char* key, const std::string& what) {
  auto h = parse_checksum_hex(json_str(obj, key, what));
  if (!h) TESSEL_THROW(CorruptDataError, "{}: \"{}\" is not 16 hex digits", what, key);
  return *h;
}

Box json_box(const json& v, const std::string& what) {
  if (!v.is_array()) TESSEL_THROW(CorruptDataError, "{}: box is not a list", what);
  std::vector<int64_t> lo, hi;
  for (const auto& r : v) {
    if (!r.is_array() || r.size() != 2 || !r[0].is_number_unsigned() || !r[1].is_number_unsigned())
      TESSEL_THROW(CorruptDataError, "{}: box {} is not a list of [lo, hi] pairs", what, v.dump());
    lo.push_back(int64_t(std::min<uint64_t>(r[0].get<uint64_t>(), uint64_t(1) << 62)));
    hi.push_back(int64_t(std::min<uint64_t>(r[1].get<uint64_t>(), uint64_t(1) << 62)));
  }
  return Box(std::move(lo), std::move(hi));
}

// The manifest's own checksum covers its compact dump without the "checksum" key; nlohmann
// sorts keys and prints numbers in shortest round-trip form, so re-dumping a parsed manifest
// reproduces the hashed text exactly.
uint64_t manifest_checksum(json m) {
  m.erase("checksum");
  const std::string text = m.dump();
  return xxh3(text.data(), text.size());
}

uint64_t chunk_count(uint64_t nbytes, uint64_t chunk) {
  return nbytes == 0 ? 0 : (nbytes + chunk - 1) / chunk;
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
        const auto tname = json_str(pc, "tensor", what);
        const auto in_file = json_str(pc, "name", what);
        const DType dtype = parse_dtype(json_str(pc, "dtype", what));
        Shape shape(json_field(pc, "shape", what).get<std::vector<int64_t>>());
        Box box = json_box(json_field(pc, "box", what), what);
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
    const auto problem = tiling_problem(e.shape, e.boxes);
    TESSEL_CHECK(problem.empty(), InvalidArgumentError,
                 "cannot commit checkpoint '{}': tensor '{}' {} is not covered exactly once: {}",
                 dir, name, e.shape.str(), problem);
    tensors[name] = {{"dtype", std::string(dtype_name(e.dtype))},
                     {"shape", e.shape.dims()},
                     {"pieces", std::move(e.pieces)}};
  }
  return {{"format", std::string(kIndexFormat)},
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

std::string rank_file_name(int rank) {
  return fmt::format("rank-{:05d}.safetensors", rank);
}

std::string staging_dir_for(const std::string& dir, const std::string& save_id) {
  return normalize_dir(dir) + ".tmp-" + save_id;
}

// ---------------------------------------------------------------------------------------------
// Writer

CheckpointWriter::CheckpointWriter(std::string dir, int rank, CheckpointWriterOptions options)
    : dir_(normalize_dir(std::move(dir))), rank_(rank), options_(std::move(options)) {
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
  manifest["checksum"] = checksum_hex(manifest_checksum(manifest));
  write_json_file(fs::path(staging_) / "manifest.json", manifest.dump(2) + "\n");
  stage("manifest");

  const fs::path old = publish(staging_, dir_, options_.save_id);
  stage("publish");
  if (!old.empty()) remove_old_checkpoint(old);
}

int cleanup_interrupted_saves(const std::string& dir_in) {
  const std::string dir = normalize_dir(dir_in);
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

// ---------------------------------------------------------------------------------------------
// Reader

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(normalize_dir(dir)) {
  std::error_code ec;
  TESSEL_CHECK(fs::is_directory(dir_, ec), IoError, "checkpoint directory '{}' does not exist",
               dir_);
  TESSEL_CHECK(fs::exists(fs::path(dir_) / "manifest.json"), CorruptDataError,
               "'{}' is not a checkpoint: it has no manifest.json (an interrupted save leaves "
               "none; a complete one may be in '{}.tmp-*')",
               dir_, dir_);
  load_manifest();
  load_index();
}

void CheckpointReader::load_manifest() {
  const auto path = fs::path(dir_) / "manifest.json";
  const std::string what = fmt::format("checkpoint '{}': manifest.json", dir_);
  const auto text = read_small_file(path, "manifest");
  try {
    manifest_ = json::parse(text);
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not valid JSON ({}); the file is damaged", what,
                 e.what());
  }
  TESSEL_CHECK(manifest_.is_object(), CorruptDataError, "{} is not a JSON object", what);
  const auto format = json_str(manifest_, "format", what);
  TESSEL_CHECK(format == kCheckpointFormat, CorruptDataError,
               "{} has format '{}', not '{}'; this is not a tessel checkpoint", what, format,
               kCheckpointFormat);
  const auto& version = json_field(manifest_, "version", what);
  TESSEL_CHECK(version.is_number_integer() && version.get<int64_t>() == kCheckpointVersion,
               CorruptDataError,
               "{} has format version {}; this tessel reads version {} (was it written by a "
               "newer tessel?)",
               what, version.dump(), kCheckpointVersion);
  const uint64_t sum = json_hash(manifest_, "checksum", what);
  TESSEL_CHECK(sum == manifest_checksum(manifest_), CorruptDataError,
               "{} fails its checksum; the file is damaged", what);
  TESSEL_CHECK(manifest_.contains("meta") && manifest_["meta"].is_object(), CorruptDataError,
               "{} has no \"meta\" object", what);
}

void CheckpointReader::load_index() {
  const auto& ref = json_field(manifest_, "index", "manifest.json");
  const std::string mwhat = fmt::format("checkpoint '{}': manifest.json index", dir_);
  const auto index_name = json_str(ref, "file", mwhat);
  TESSEL_CHECK(plain_file_name(index_name), CorruptDataError, "{} names '{}', not a plain file",
               mwhat, index_name);
  const auto path = fs::path(dir_) / index_name;
  TESSEL_CHECK(fs::exists(path), CorruptDataError,
               "checkpoint '{}' is missing {} (listed in manifest.json); the file was deleted",
               dir_, index_name);
  const auto text = read_small_file(path, "checkpoint index");
  const std::string what = fmt::format("checkpoint '{}': {}", dir_, index_name);
  TESSEL_CHECK(text.size() == json_u64(json_field(ref, "bytes", mwhat), mwhat) &&
                   xxh3(text.data(), text.size()) == json_hash(ref, "xxh3", mwhat),
               CorruptDataError,
               "{} does not match the size and checksum manifest.json records; the file is "
               "damaged or truncated",
               what);
  json index;
  try {
    index = json::parse(text);
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "{} is not valid JSON ({})", what, e.what());
  }
  TESSEL_CHECK(index.is_object() && json_str(index, "format", what) == kIndexFormat,
               CorruptDataError, "{} is not a tessel checkpoint index", what);
  const auto& version = json_field(index, "version", what);
  TESSEL_CHECK(version.is_number_integer() && version.get<int64_t>() == kCheckpointVersion,
               CorruptDataError, "{} has format version {}; this tessel reads version {}", what,
               version.dump(), kCheckpointVersion);
  const auto& files = json_field(index, "files", what);
  const auto& tensors = json_field(index, "tensors", what);
  TESSEL_CHECK(files.is_object() && tensors.is_object(), CorruptDataError,
               "{}: \"files\" and \"tensors\" must be objects", what);

  // The first tensor that names each file, for messages about a missing file.
  std::map<std::string, std::string> first_user;
  for (const auto& [tname, t] : tensors.items()) {
    if (!t.is_object() || !t.contains("pieces") || !t["pieces"].is_array()) continue;
    for (const auto& p : t["pieces"])
      if (p.is_object() && p.contains("file") && p["file"].is_string())
        first_user.try_emplace(p["file"].get<std::string>(), tname);
  }
  for (const auto& [fname, f] : files.items()) {
    TESSEL_CHECK(plain_file_name(fname), CorruptDataError,
                 "{} lists file '{}', which is not a plain file name in the checkpoint", what,
                 fname);
    const auto fpath = fs::path(dir_) / fname;
    if (!fs::exists(fpath)) {
      auto u = first_user.find(fname);
      TESSEL_THROW(CorruptDataError,
                   "checkpoint '{}' is missing {} (listed in {} for tensor '{}'); the save was "
                   "interrupted or the file was deleted",
                   dir_, fname, index_name, u == first_user.end() ? "?" : u->second);
    }
    const std::string fwhat = fmt::format("{}: file '{}'", what, fname);
    const uint64_t want = json_u64(json_field(f, "bytes", fwhat), fwhat);
    const uint64_t have = fs::file_size(fpath);
    TESSEL_CHECK(have == want, CorruptDataError,
                 "checkpoint '{}': {} has {} bytes but {} records {}; the file was truncated or "
                 "replaced",
                 dir_, fname, have, index_name, want);
    auto reader = SafetensorsReader::open(fpath.string());
    TESSEL_CHECK(reader.header_xxh3() == json_hash(f, "header_xxh3", fwhat), CorruptDataError,
                 "checkpoint '{}': the header of {} fails its checksum; the file is damaged", dir_,
                 fname);
    files_.emplace(fname, std::move(reader));
  }

  for (const auto& [tname, t] : tensors.items())
    tensors_.push_back(
        load_tensor(tname, t, fmt::format("{}: tensor '{}'", what, tname), index_name));
  std::sort(tensors_.begin(), tensors_.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
}

CheckpointTensor CheckpointReader::load_tensor(const std::string& tname, const json& t,
                                               const std::string& twhat,
                                               const std::string& index_name) const {
  TESSEL_CHECK(t.is_object(), CorruptDataError, "{} is not an object", twhat);
  CheckpointTensor ct;
  ct.name = tname;
  try {
    ct.dtype = parse_dtype(json_str(t, "dtype", twhat));
  } catch (const ConfigError& e) {
    TESSEL_THROW(CorruptDataError, "{}: {}", twhat, e.what());
  }
  const auto& shape = json_field(t, "shape", twhat);
  TESSEL_CHECK(shape.is_array(), CorruptDataError, "{}: shape is not a list", twhat);
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (const auto& d : shape) {
    const uint64_t n = json_u64(d, twhat + " shape");
    TESSEL_CHECK(!__builtin_mul_overflow(numel, n, &numel) && numel < (uint64_t(1) << 60),
                 CorruptDataError, "{}: shape {} is implausibly large", twhat, shape.dump());
    dims.push_back(int64_t(n));
  }
  ct.shape = Shape(std::move(dims));
  const auto& pieces = json_field(t, "pieces", twhat);
  TESSEL_CHECK(pieces.is_array(), CorruptDataError, "{}: pieces is not a list", twhat);
  std::vector<Box> boxes;
  for (const auto& p : pieces) {
    CheckpointPiece cp;
    cp.file = json_str(p, "file", twhat);
    cp.tensor = json_str(p, "tensor", twhat);
    cp.box = json_box(json_field(p, "box", twhat), twhat);
    cp.nbytes = json_u64(json_field(p, "bytes", twhat), twhat);
    cp.xxh3 = json_hash(p, "xxh3", twhat);
    cp.chunk_bytes = json_u64(json_field(p, "chunk_bytes", twhat), twhat);
    const std::string pwhat = fmt::format("checkpoint '{}': tensor '{}' piece {} in {}", dir_,
                                          tname, cp.box.str(), cp.file);
    TESSEL_CHECK(files_.count(cp.file), CorruptDataError, "{}: {} lists no such file", pwhat,
                 index_name);
    TESSEL_CHECK(cp.box.rank() == ct.shape.rank(), CorruptDataError,
                 "{}: box rank differs from the tensor's {}", pwhat, ct.shape.str());
    const auto* st = files_.at(cp.file).find(cp.tensor);
    TESSEL_CHECK(st != nullptr, CorruptDataError, "{}: the file has no tensor '{}'", pwhat,
                 cp.tensor);
    TESSEL_CHECK(st->dtype == ct.dtype && st->shape == cp.box.shape() && st->nbytes == cp.nbytes,
                 CorruptDataError, "{}: the file holds it as {} {}, the index says {} {}", pwhat,
                 dtype_name(st->dtype), st->shape.str(), dtype_name(ct.dtype),
                 cp.box.shape().str());
    TESSEL_CHECK(cp.chunk_bytes > 0, CorruptDataError, "{}: chunk_bytes is 0", pwhat);
    const uint64_t nchunks = chunk_count(cp.nbytes, cp.chunk_bytes);
    if (p.contains("chunks")) {
      const auto& chunks = p["chunks"];
      TESSEL_CHECK(chunks.is_array() && chunks.size() == nchunks, CorruptDataError,
                   "{}: needs {} chunk checksums", pwhat, nchunks);
      for (const auto& c : chunks) {
        auto h = c.is_string() ? parse_checksum_hex(c.get<std::string>()) : std::nullopt;
        TESSEL_CHECK(h.has_value(), CorruptDataError, "{}: bad chunk checksum", pwhat);
        cp.chunk_xxh3.push_back(*h);
      }
    } else {
      TESSEL_CHECK(nchunks <= 1, CorruptDataError, "{}: chunk checksums are missing", pwhat);
      if (nchunks == 1) cp.chunk_xxh3.push_back(cp.xxh3);
    }
    boxes.push_back(cp.box);
    ct.pieces.push_back(std::move(cp));
  }
  const auto problem = tiling_problem(ct.shape, boxes);
  TESSEL_CHECK(problem.empty(), CorruptDataError,
               "checkpoint '{}': tensor '{}' {} is not covered exactly once: {}", dir_, tname,
               ct.shape.str(), problem);
  return ct;
}

const CheckpointTensor* CheckpointReader::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const auto& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const CheckpointTensor& CheckpointReader::at(std::string_view name) const {
  const auto* t = find(name);
  TESSEL_CHECK(t != nullptr, InvalidArgumentError, "checkpoint '{}' has no tensor '{}'", dir_,
               name);
  return *t;
}

std::vector<std::string> CheckpointReader::files() const {
  std::vector<std::string> v;
  for (const auto& [name, r] : files_) v.push_back(name);
  return v;
}

const SafetensorsReader& CheckpointReader::file(const std::string& name) const {
  return files_.at(name);
}

void CheckpointReader::read_piece(const CheckpointTensor& t, const CheckpointPiece& p,
                                  const Box& region, const Box& out_frame, char* out) const {
  const auto& f = file(p.file);
  const auto& entry = f.at(p.tensor);
  const uint64_t C = p.chunk_bytes;
  const auto runs = byte_runs(StridedRegion::of_box(region, p.box),
                              StridedRegion::of_box(region, out_frame), dtype_size(t.dtype));
  // Chunk-aligned windows covering every run, merged where they touch, at most W bytes each.
  const uint64_t W = std::max(C, kWindowBytes / C * C);
  std::vector<std::pair<uint64_t, uint64_t>> windows;
  for (const auto& r : runs) {
    uint64_t a = r.src / C * C;
    const uint64_t b = std::min(p.nbytes, (r.src + r.len + C - 1) / C * C);
    if (!windows.empty() && windows.back().second >= a) a = windows.back().second;
    while (a < b) {
      if (!windows.empty() && windows.back().second == a &&
          windows.back().second - windows.back().first < W) {
        auto& w = windows.back();
        w.second = std::min(b, w.first + W);
        a = w.second;
      } else {
        windows.push_back({a, std::min(b, a + W)});
        a = windows.back().second;
      }
    }
  }
  uint64_t largest = 0;
  for (const auto& [wb, we] : windows) largest = std::max(largest, we - wb);
  std::unique_ptr<char[]> scratch;
  size_t j = 0;  // first run that may overlap the current window
  for (const auto& [wb, we] : windows) {
    while (j < runs.size() && runs[j].src + runs[j].len <= wb) ++j;
    TESSEL_CHECK(j < runs.size(), InvalidArgumentError, "internal: window {} without a run", wb);
    char* buf;
    const bool direct = runs[j].src <= wb && we <= runs[j].src + runs[j].len;
    if (direct) {
      buf = out + runs[j].dst + (wb - runs[j].src);
    } else {
      if (!scratch) scratch.reset(new char[largest]);
      buf = scratch.get();
    }
    f.pread(entry.offset + wb, buf, we - wb);
    for (uint64_t c = wb / C; c * C < we; ++c) {
      const uint64_t cb = c * C, n = std::min(C, p.nbytes - cb);
      if (xxh3(buf + (cb - wb), n) != p.chunk_xxh3[c]) {
        TESSEL_THROW(CorruptDataError,
                     "checkpoint '{}': tensor '{}' piece {} in {} fails its checksum (piece bytes "
                     "{}..{}); the file is damaged: restore it or load another checkpoint",
                     dir_, t.name, p.box.str(), p.file, cb, cb + n);
      }
    }
    if (!direct) {
      for (size_t k = j; k < runs.size() && runs[k].src < we; ++k) {
        const uint64_t s = std::max(runs[k].src, wb);
        const uint64_t e = std::min(runs[k].src + runs[k].len, we);
        if (s < e) std::memcpy(out + runs[k].dst + (s - runs[k].src), buf + (s - wb), e - s);
      }
    }
  }
}

void CheckpointReader::read_box(std::string_view name, const Box& box, void* out) const {
  const auto& t = at(name);
  TESSEL_CHECK(box.rank() == t.shape.rank() && Box::of(t.shape).contains(box), InvalidArgumentError,
               "box {} is outside tensor '{}' {} of checkpoint '{}'", box.str(), name,
               t.shape.str(), dir_);
  if (box.empty()) return;
  for (const auto& p : t.pieces) {
    const Box region = box.intersect(p.box);
    if (!region.empty()) read_piece(t, p, region, box, static_cast<char*>(out));
  }
}

Tensor CheckpointReader::read(std::string_view name, const std::optional<Box>& box) const {
  const auto& t = at(name);
  const Box b = box ? *box : Box::of(t.shape);
  Tensor out = Tensor::empty(b.shape(), t.dtype);
  read_box(name, b, out.raw());
  return out;
}

VerifyReport CheckpointReader::verify() const {
  VerifyReport report;
  report.files = files_.size();
  for (const auto& t : tensors_) {
    ++report.tensors;
    for (const auto& p : t.pieces) {
      ++report.pieces;
      const auto& f = file(p.file);
      const auto& entry = f.at(p.tensor);
      const uint64_t C = p.chunk_bytes;
      const uint64_t W = std::min(p.nbytes, std::max(C, kWindowBytes / C * C));
      std::unique_ptr<char[]> buf(new char[std::max<uint64_t>(W, 1)]);
      Xxh3Stream whole;
      for (uint64_t wb = 0; wb < p.nbytes; wb += W) {
        const uint64_t we = std::min(p.nbytes, wb + W);
        f.pread(entry.offset + wb, buf.get(), we - wb);
        whole.update(buf.get(), we - wb);
        for (uint64_t c = wb / C; c * C < we; ++c) {
          const uint64_t cb = c * C, n = std::min(C, p.nbytes - cb);
          TESSEL_CHECK(xxh3(buf.get() + (cb - wb), n) == p.chunk_xxh3[c], CorruptDataError,
                       "checkpoint '{}': tensor '{}' piece {} in {} fails its checksum (piece "
                       "bytes {}..{}); the file is damaged",
                       dir_, t.name, p.box.str(), p.file, cb, cb + n);
        }
      }
      TESSEL_CHECK(whole.digest() == p.xxh3, CorruptDataError,
                   "checkpoint '{}': tensor '{}' piece {} in {} fails its checksum; the file is "
                   "damaged",
                   dir_, t.name, p.box.str(), p.file);
      report.bytes += p.nbytes;
    }
  }
  return report;
}

uint64_t CheckpointReader::bytes_read() const {
  uint64_t n = 0;
  for (const auto& [name, f] : files_) n += f.bytes_read();
  return n;
}

}  // namespace tessel::store
