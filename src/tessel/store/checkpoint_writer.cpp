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
#include <optional>
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

// The entry of a rank file, checked: the fields index.json copies, with their types.
struct ParsedEntry {
  std::string file;
  int rank = -1;
  std::string save_id;
  uint64_t bytes = 0;
  std::string header_xxh3;
  const json* pieces = nullptr;
};

ParsedEntry parse_entry(const json& e, size_t position) {
  const std::string what = fmt::format("checkpoint entry #{}", position);
  TESSEL_CHECK(e.is_object(), CorruptDataError, "{} is not a JSON object", what);
  ParsedEntry p;
  p.file = detail::json_str(e, "file", what);
  const auto& rank = detail::json_field(e, "rank", what);
  TESSEL_CHECK(rank.is_number_integer() && rank.get<int64_t>() >= 0 && rank.get<int64_t>() <= 99999,
               CorruptDataError, "{}: rank {} is not in 0..99999", what, rank.dump());
  p.rank = int(rank.get<int64_t>());
  TESSEL_CHECK(p.file == rank_file_name(p.rank), InvalidArgumentError,
               "{} is for file '{}' but rank {}, whose file is {}", what, p.file, p.rank,
               rank_file_name(p.rank));
  p.save_id = detail::json_str(e, "save_id", what);
  p.bytes = detail::json_u64(detail::json_field(e, "bytes", what), what + " bytes");
  p.header_xxh3 = checksum_hex(detail::json_hash(e, "header_xxh3", what));
  p.pieces = &detail::json_field(e, "pieces", what);
  TESSEL_CHECK(p.pieces->is_array(), CorruptDataError, "{}: \"pieces\" is not a list", what);
  return p;
}

// A tensor's shape in an entry: sizes whose product stays far from overflowing.
Shape entry_shape(const json& v, const std::string& what) {
  TESSEL_CHECK(v.is_array(), CorruptDataError, "{}: shape is not a list", what);
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (const auto& d : v) {
    const uint64_t n = detail::json_u64(d, what + " shape");
    TESSEL_CHECK(!__builtin_mul_overflow(numel, n, &numel) && numel < (uint64_t(1) << 60),
                 CorruptDataError, "{}: shape {} is implausibly large", what, v.dump());
    dims.push_back(int64_t(n));
  }
  return Shape(std::move(dims));
}

// The index of a save from the entries of its rank files, taken in rank order so that every host
// builds the same bytes: checks that every rank 0..num_ranks-1 has exactly one entry and that the
// pieces they list tile their tensors.
json build_index(const std::string& dir, const std::string& save_id,
                 const std::vector<json>& entries, int num_ranks) {
  std::vector<std::optional<ParsedEntry>> by_rank(static_cast<size_t>(num_ranks));
  for (size_t i = 0; i < entries.size(); ++i) {
    ParsedEntry p = parse_entry(entries[i], i);
    TESSEL_CHECK(p.rank < num_ranks, InvalidArgumentError,
                 "cannot commit checkpoint '{}': an entry is for rank {} but the save has {} ranks",
                 dir, p.rank, num_ranks);
    TESSEL_CHECK(p.save_id == save_id, IoError,
                 "cannot commit checkpoint '{}': the entry of {} belongs to save '{}', not to this "
                 "save '{}'",
                 dir, p.file, p.save_id, save_id);
    TESSEL_CHECK(!by_rank[size_t(p.rank)], InvalidArgumentError,
                 "cannot commit checkpoint '{}': two entries for {}", dir, p.file);
    by_rank[size_t(p.rank)] = std::move(p);
  }
  for (int r = 0; r < num_ranks; ++r)
    TESSEL_CHECK(by_rank[size_t(r)].has_value(), InvalidArgumentError,
                 "cannot commit checkpoint '{}': no entry for rank {} ({}); every rank must have "
                 "written its file",
                 dir, r, rank_file_name(r));

  struct TensorSeen {
    DType dtype;
    Shape shape;
    json pieces = json::array();
    std::vector<Box> boxes;
    std::string first_file;
  };
  std::map<std::string, TensorSeen> tensors_seen;
  json files = json::object();
  for (const auto& entry : by_rank) {
    const auto& name = entry->file;
    const std::string what = fmt::format("checkpoint '{}': the entry of {}", dir, name);
    try {
      for (const auto& pc : *entry->pieces) {
        const auto tname = detail::json_str(pc, "tensor", what);
        const auto in_file = detail::json_str(pc, "name", what);
        const DType dtype = detail::json_dtype(pc, "dtype", what);
        const Shape shape = entry_shape(detail::json_field(pc, "shape", what), what);
        Box box = detail::json_box(detail::json_field(pc, "box", what), what);
        // Inside the shape first: the volume of a box from the wire could overflow otherwise.
        TESSEL_CHECK(box.rank() == shape.rank() && Box::of(shape).contains(box), CorruptDataError,
                     "{}: piece '{}' {} lies outside the shape {}", what, in_file, box.str(),
                     shape.str());
        const uint64_t nbytes = detail::json_u64(detail::json_field(pc, "bytes", what), what);
        TESSEL_CHECK(nbytes == uint64_t(box.volume()) * dtype_size(dtype), CorruptDataError,
                     "{}: piece '{}' of {} {} holds {} bytes", what, in_file, dtype_name(dtype),
                     box.str(), nbytes);
        detail::json_hash(pc, "xxh3", what);
        TESSEL_CHECK(detail::json_u64(detail::json_field(pc, "chunk_bytes", what), what) > 0,
                     CorruptDataError, "{}: piece '{}' has chunk_bytes 0", what, in_file);
        auto it = tensors_seen.try_emplace(tname, TensorSeen{dtype, shape, json::array(), {}, name})
                      .first;
        auto& t = it->second;
        TESSEL_CHECK(t.dtype == dtype && t.shape == shape, InvalidArgumentError,
                     "tensor '{}' is {} {} in {} but {} {} in {}", tname, dtype_name(t.dtype),
                     t.shape.str(), t.first_file, dtype_name(dtype), shape.str(), name);
        json piece = {{"file", name},          {"tensor", in_file},
                      {"box", pc.at("box")},   {"bytes", pc.at("bytes")},
                      {"xxh3", pc.at("xxh3")}, {"chunk_bytes", pc.at("chunk_bytes")}};
        if (pc.contains("chunks")) piece["chunks"] = pc.at("chunks");
        t.pieces.push_back(std::move(piece));
        t.boxes.push_back(std::move(box));
      }
    } catch (const json::exception& e) {
      TESSEL_THROW(CorruptDataError, "{}: bad piece list: {}", what, e.what());
    }
    files[name] = {{"bytes", entry->bytes}, {"header_xxh3", entry->header_xxh3}};
  }
  json tensors = json::object();
  for (auto& [name, t] : tensors_seen) {
    const auto problem = detail::tiling_problem(t.shape, t.boxes);
    TESSEL_CHECK(problem.empty(), InvalidArgumentError,
                 "cannot commit checkpoint '{}': tensor '{}' {} is not covered exactly once: {}",
                 dir, name, t.shape.str(), problem);
    tensors[name] = {{"dtype", std::string(dtype_name(t.dtype))},
                     {"shape", t.shape.dims()},
                     {"pieces", std::move(t.pieces)}};
  }
  return {{"format", std::string(detail::kIndexFormat)},
          {"version", kCheckpointVersion},
          {"files", std::move(files)},
          {"tensors", std::move(tensors)}};
}

// Each rank file the staging directory holds must be the file its entry describes: it is about
// to be published under the index built from the entries.
void check_held_files(const fs::path& staging, const std::string& save_id,
                      const std::vector<json>& entries) {
  for (const auto& e : entries) {
    const auto name = e.at("file").get<std::string>();
    const auto path = staging / name;
    std::error_code ec;
    if (!fs::exists(path, ec)) continue;
    const json held = read_rank_file_entry(path.string(), save_id);
    TESSEL_CHECK(held.at("bytes") == e.at("bytes"), CorruptDataError,
                 "'{}' has {} bytes but its entry records {}; the file is not the one committed",
                 path.string(), held.at("bytes").dump(), e.at("bytes").dump());
    TESSEL_CHECK(held.at("header_xxh3") == e.at("header_xxh3"), CorruptDataError,
                 "the header of '{}' has checksum {} but its entry records {}; the file is not "
                 "the one committed",
                 path.string(), held.at("header_xxh3").dump(), e.at("header_xxh3").dump());
    TESSEL_CHECK(held.at("pieces") == e.at("pieces"), CorruptDataError,
                 "the piece list of '{}' differs from its entry", path.string());
  }
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
  pieces_.push_back({name, dtype, global_shape, box, data, nbytes, {}});
}

void CheckpointWriter::add_streamed(const std::string& name, DType dtype, const Shape& global_shape,
                                    const Box& box, PieceProducer produce) {
  TESSEL_CHECK(produce != nullptr, InvalidArgumentError, "piece {} of '{}' has no producer",
               box.str(), name);
  // add() checks the name and box; a dummy pointer passes its data check and is replaced.
  static const char kNone = 0;
  add(name, dtype, global_shape, box, &kNone);
  pieces_.back().data = nullptr;
  pieces_.back().produce = std::move(produce);
}

void CheckpointWriter::add(const std::string& name, const Tensor& tensor) {
  add(name, tensor.dtype(), tensor.shape(), Box::of(tensor.shape()), tensor.raw());
}

void CheckpointWriter::snapshot() {
  for (const auto& p : pieces_)
    TESSEL_CHECK(!p.produce, InvalidArgumentError,
                 "piece {} of '{}' is streamed: it cannot be snapshotted", p.box.str(), p.name);
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
  if (std::any_of(pieces_.begin(), pieces_.end(), [](const Piece& p) { return bool(p.produce); }))
    return write_streamed_rank_file((fs::path(staging_) / rank_file_name(rank_)).string());
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
  entry_ = nullptr;
  write_safetensors(path, tensors, metadata);
  // From the file as written, so that the entry and the file cannot disagree.
  entry_ = read_rank_file_entry(path, options_.save_id);
  stage("rank_file");
  return path;
}

// The rank file with streamed pieces: their bytes go to the file as they are produced, one chunk
// at a time, hashed on the way; the header is written first with placeholder checksums of the
// same width and rewritten once they are known.
std::string CheckpointWriter::write_streamed_rank_file(const std::string& path) {
  const uint64_t chunk = options_.chunk_bytes;
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::string> whole(pieces_.size(), checksum_hex(0));
  std::vector<std::vector<std::string>> chunks(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& p = pieces_[i];
    chunks[i].assign(size_t((p.nbytes + chunk - 1) / chunk), checksum_hex(0));
    const bool whole_box = p.box == Box::of(p.global_shape);
    tensors.push_back(
        {whole_box ? p.name : p.name + box_suffix(p.box), p.dtype, p.box.shape(), nullptr});
  }
  auto metadata = [&] {
    json pieces = json::array();
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const auto& p = pieces_[i];
      json e = {{"tensor", p.name},
                {"name", tensors[i].name},
                {"dtype", std::string(dtype_name(p.dtype))},
                {"shape", p.global_shape.dims()},
                {"box", box_to_json(p.box)},
                {"bytes", p.nbytes},
                {"xxh3", whole[i]},
                {"chunk_bytes", chunk}};
      if (chunks[i].size() > 1) e["chunks"] = chunks[i];
      pieces.push_back(std::move(e));
    }
    return std::map<std::string, std::string>{{kFormatKey, std::string(kRankFileFormat)},
                                              {kSaveIdKey, options_.save_id},
                                              {kPiecesKey, pieces.dump()}};
  };
  std::vector<char> buf;
  SafetensorsStream stream;
  stream.produce = [&](size_t i, const SafetensorsStream::Write& write) {
    const auto& p = pieces_[i];
    Xxh3Stream whole_hash;
    for (uint64_t off = 0, k = 0; off < p.nbytes; off += chunk, ++k) {
      const uint64_t n = std::min(chunk, p.nbytes - off);
      const char* bytes = static_cast<const char*>(p.data) + off;
      if (p.produce) {
        buf.resize(size_t(n));
        p.produce(off, n, buf.data());
        bytes = buf.data();
      }
      chunks[i][size_t(k)] = checksum_hex(xxh3(bytes, n));
      whole_hash.update(bytes, n);
      write(bytes, size_t(n));
    }
    whole[i] = checksum_hex(whole_hash.digest());
  };
  stream.final_metadata = metadata;
  entry_ = nullptr;
  write_safetensors(path, tensors, metadata(), stream);
  entry_ = read_rank_file_entry(path, options_.save_id);
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

const nlohmann::json& CheckpointWriter::rank_file_entry() const {
  TESSEL_CHECK(!entry_.is_null(), InvalidArgumentError,
               "rank {} of checkpoint '{}' has no rank file entry before write_rank_file()", rank_,
               dir_);
  return entry_;
}

void CheckpointWriter::commit(int num_ranks, const nlohmann::json& meta) {
  TESSEL_CHECK(num_ranks >= 1, InvalidArgumentError, "commit needs num_ranks >= 1, got {}",
               num_ranks);
  std::vector<json> entries;
  for (int r = 0; r < num_ranks; ++r) {
    const auto name = rank_file_name(r);
    const auto path = fs::path(staging_) / name;
    TESSEL_CHECK(fs::exists(path), IoError,
                 "cannot commit checkpoint '{}': {} is missing from '{}'; every rank must finish "
                 "write_rank_file() before one rank commits",
                 dir_, name, staging_);
    entries.push_back(read_rank_file_entry(path.string(), options_.save_id));
  }
  commit_checkpoint(dir_, options_.save_id, entries, meta, num_ranks, options_.on_stage);
}

json read_rank_file_entry(const std::string& path, const std::string& save_id) {
  const auto name = fs::path(path).filename().string();
  auto file = SafetensorsReader::open(path);
  const auto& md = file.metadata();
  auto fmt_it = md.find(kFormatKey), id_it = md.find(kSaveIdKey), pc_it = md.find(kPiecesKey);
  TESSEL_CHECK(fmt_it != md.end() && fmt_it->second == kRankFileFormat && pc_it != md.end(),
               CorruptDataError, "'{}' is not a tessel rank file", path);
  TESSEL_CHECK(id_it != md.end() && id_it->second == save_id, IoError,
               "'{}' belongs to save '{}', not to this save '{}'", path,
               id_it == md.end() ? "?" : id_it->second, save_id);
  const auto rank = rank_of_file_name(name);
  TESSEL_CHECK(rank.has_value(), InvalidArgumentError, "'{}' is not named as a rank file ({})",
               path, rank_file_name(0));
  json pieces;
  try {
    pieces = json::parse(pc_it->second);
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "'{}': piece list is not JSON: {}", path, e.what());
  }
  TESSEL_CHECK(pieces.is_array(), CorruptDataError, "'{}': piece list is not a list", path);
  const std::string what = fmt::format("'{}'", path);
  try {
    for (const auto& pc : pieces) {
      const auto in_file = detail::json_str(pc, "name", what);
      const DType dtype = detail::json_dtype(pc, "dtype", what);
      Box box = detail::json_box(detail::json_field(pc, "box", what), what);
      const auto* st = file.find(in_file);
      TESSEL_CHECK(st && st->dtype == dtype && st->shape == box.shape(), CorruptDataError,
                   "'{}' does not hold tensor '{}' as {} {}", path, in_file, dtype_name(dtype),
                   box.shape().str());
    }
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "'{}': bad piece list: {}", path, e.what());
  }
  return {{"file", name},
          {"rank", *rank},
          {"save_id", save_id},
          {"bytes", file.file_size()},
          {"header_xxh3", checksum_hex(file.header_xxh3())},
          {"pieces", std::move(pieces)}};
}

void commit_checkpoint(const std::string& dir_in, const std::string& save_id,
                       const std::vector<nlohmann::json>& entries, const nlohmann::json& meta,
                       int num_ranks, const std::function<void(std::string_view)>& on_stage) {
  const std::string dir = detail::normalize_dir(dir_in);
  TESSEL_CHECK(num_ranks >= 1 && num_ranks <= 100000, InvalidArgumentError,
               "commit needs num_ranks in 1..100000, got {}", num_ranks);
  TESSEL_CHECK(valid_save_id(save_id), InvalidArgumentError,
               "save id '{}' may hold only letters, digits, '-' and '_'", save_id);
  TESSEL_CHECK(meta.is_object() || meta.is_null(), InvalidArgumentError,
               "checkpoint meta must be a JSON object");
  auto stage = [&](std::string_view s) {
    if (on_stage) on_stage(s);
  };
  check_replaceable(dir);
  const json index = build_index(dir, save_id, entries, num_ranks);
  const std::string staging = staging_dir_for(dir, save_id);
  std::error_code ec;
  fs::create_directories(staging, ec);
  TESSEL_CHECK(fs::is_directory(staging), IoError,
               "cannot create checkpoint staging directory '{}': {}", staging, ec.message());
  check_held_files(staging, save_id, entries);

  const std::string index_text = index.dump();
  write_json_file(fs::path(staging) / "index.json", index_text);
  stage("index");

  json manifest = {{"format", std::string(kCheckpointFormat)},
                   {"version", kCheckpointVersion},
                   {"save_id", save_id},
                   {"rank_files", num_ranks},
                   {"index",
                    {{"file", "index.json"},
                     {"bytes", index_text.size()},
                     {"xxh3", checksum_hex(xxh3(index_text.data(), index_text.size()))}}},
                   {"meta", meta.is_null() ? json::object() : meta}};
  manifest["checksum"] = checksum_hex(detail::manifest_checksum(manifest));
  write_json_file(fs::path(staging) / "manifest.json", manifest.dump(2) + "\n");
  stage("manifest");

  const fs::path old = publish(staging, dir, save_id);
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
