// CheckpointReader: opening and validating a checkpoint, box reads that verify the chunks they
// touch, and whole-checkpoint verification (checkpoint_store.h).
#include "tessel/store/checkpoint_store.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "tessel/core/check.h"
#include "tessel/store/checkpoint_format.h"
#include "tessel/store/checksum.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/tensor/region_runs.h"

namespace tessel::store {

namespace fs = std::filesystem;
using detail::json_box;
using detail::json_dtype;
using detail::json_field;
using detail::json_hash;
using detail::json_str;
using detail::json_u64;
using detail::kIndexFormat;
using detail::manifest_checksum;
using detail::normalize_dir;
using detail::tiling_problem;
using nlohmann::json;

namespace {

constexpr uint64_t kMaxJsonFile = uint64_t(1) << 30;
// Largest single pread of a box read; reads go through a scratch buffer of this size when the
// chunks read hold more than the needed bytes.
constexpr uint64_t kWindowBytes = uint64_t(64) << 20;

// A name from index.json that may be joined to the checkpoint directory: no separators, no
// "." or "..", printable ASCII only.
bool plain_file_name(const std::string& s) {
  if (s.empty() || s == "." || s == ".." || s.size() > 255) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
      return false;
  return true;
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

uint64_t chunk_count(uint64_t nbytes, uint64_t chunk) {
  return nbytes == 0 ? 0 : (nbytes + chunk - 1) / chunk;
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& dir, CheckpointReaderOptions options)
    : dir_(normalize_dir(dir)), options_(options) {
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
    all_files_.push_back(fname);
    if (!fs::exists(fpath) && options_.allow_missing_files) {
      missing_.push_back(fname);
      continue;
    }
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

  std::sort(all_files_.begin(), all_files_.end());
  std::sort(missing_.begin(), missing_.end());
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
  ct.dtype = json_dtype(t, "dtype", twhat);
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
    TESSEL_CHECK(std::binary_search(all_files_.begin(), all_files_.end(), cp.file),
                 CorruptDataError, "{}: {} lists no such file", pwhat, index_name);
    TESSEL_CHECK(cp.box.rank() == ct.shape.rank(), CorruptDataError,
                 "{}: box rank differs from the tensor's {}", pwhat, ct.shape.str());
    if (holds(cp.file)) {
      const auto* st = files_.at(cp.file).find(cp.tensor);
      TESSEL_CHECK(st != nullptr, CorruptDataError, "{}: the file has no tensor '{}'", pwhat,
                   cp.tensor);
      TESSEL_CHECK(st->dtype == ct.dtype && st->shape == cp.box.shape() && st->nbytes == cp.nbytes,
                   CorruptDataError, "{}: the file holds it as {} {}, the index says {} {}", pwhat,
                   dtype_name(st->dtype), st->shape.str(), dtype_name(ct.dtype),
                   cp.box.shape().str());
    } else {
      // Nothing on this host to compare with: at least the recorded size must fit the box (inside
      // the shape first, so that the volume cannot overflow).
      TESSEL_CHECK(Box::of(ct.shape).contains(cp.box) &&
                       cp.nbytes == uint64_t(cp.box.volume()) * dtype_size(ct.dtype),
                   CorruptDataError, "{}: {} bytes cannot hold {} {} inside {}", pwhat, cp.nbytes,
                   dtype_name(ct.dtype), cp.box.shape().str(), ct.shape.str());
    }
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
  return all_files_;
}

bool CheckpointReader::holds(std::string_view file) const {
  return files_.find(file) != files_.end();
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
  read_box(name, box, out, PieceFetcher{});
}

void CheckpointReader::read_box(std::string_view name, const Box& box, void* out,
                                const PieceFetcher& fetch) const {
  const auto& t = at(name);
  TESSEL_CHECK(box.rank() == t.shape.rank() && Box::of(t.shape).contains(box), InvalidArgumentError,
               "box {} is outside tensor '{}' {} of checkpoint '{}'", box.str(), name,
               t.shape.str(), dir_);
  if (box.empty()) return;
  // Refused before anything is read, so a failed read leaves no half-filled output behind.
  if (!fetch) {
    for (const auto& p : t.pieces) {
      TESSEL_CHECK(holds(p.file) || box.intersect(p.box).empty(), CorruptDataError,
                   "checkpoint '{}': tensor '{}' box {} needs piece {} in {}, which is not on this "
                   "host; read it from a host that holds it (read_box with a PieceFetcher)",
                   dir_, t.name, box.str(), p.box.str(), p.file);
    }
  }
  auto* dst = static_cast<char*>(out);
  const size_t esize = dtype_size(t.dtype);
  std::vector<char> scratch;
  for (const auto& p : t.pieces) {
    const Box region = box.intersect(p.box);
    if (region.empty()) continue;
    if (holds(p.file)) {
      read_piece(t, p, region, box, dst);
    } else if (region == box) {
      fetch(t, p, region, dst);
    } else {
      scratch.resize(size_t(region.volume()) * esize);
      fetch(t, p, region, scratch.data());
      unpack_box(scratch.data(), region.relative_to(box), dst, box.shape(), esize);
    }
  }
}

Tensor CheckpointReader::read(std::string_view name, const std::optional<Box>& box,
                              const PieceFetcher& fetch) const {
  const auto& t = at(name);
  const Box b = box ? *box : Box::of(t.shape);
  Tensor out = Tensor::empty(b.shape(), t.dtype);
  read_box(name, b, out.raw(), fetch);
  return out;
}

VerifyReport CheckpointReader::verify() const {
  VerifyReport report;
  report.files = files_.size();
  report.missing_files = missing_;
  for (const auto& t : tensors_) {
    ++report.tensors;
    for (const auto& p : t.pieces) {
      if (!holds(p.file)) {
        ++report.pieces_not_held;
        continue;
      }
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
