#include "tessel/runtime/checkpoint.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"

namespace tessel::runtime {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'T', 'S', 'L', 'C', 'K', 'P', 'T', '1'};
constexpr uint32_t kVersion = 1;

// Streams bytes into an atomic file while hashing them with xxh3-64.
class HashingWriter {
 public:
  explicit HashingWriter(const fs::path& dest) : file_(dest.string()), state_(XXH3_createState()) {
    if (!state_) throw std::bad_alloc();
    XXH3_64bits_reset(state_);
  }
  ~HashingWriter() { XXH3_freeState(state_); }
  HashingWriter(const HashingWriter&) = delete;
  HashingWriter& operator=(const HashingWriter&) = delete;
  void write(const void* data, size_t n) {
    XXH3_64bits_update(state_, data, n);
    file_.write(data, n);
  }
  // Appends the digest of everything written so far, then makes the file durable.
  void commit_with_digest() {
    uint64_t digest = XXH3_64bits_digest(state_);
    file_.write(&digest, sizeof(digest));
    file_.commit();
  }

 private:
  AtomicFileWriter file_;
  XXH3_state_t* state_;
};

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld.ckpt", static_cast<long long>(step));
  return buf;
}

}  // namespace

std::string save_checkpoint(const std::string& dir, int64_t step, const nlohmann::json& meta,
                            const std::vector<CheckpointSection>& sections, int keep) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TESSEL_CHECK(!ec, IoError, "cannot create checkpoint directory '{}': {}", dir, ec.message());
  nlohmann::json header = meta;
  header["step"] = step;
  header["sections"] = nlohmann::json::array();
  for (const auto& s : sections)
    header["sections"].push_back({{"name", s.name}, {"count", s.count}});
  std::string text = header.dump();
  fs::path dest = fs::path(dir) / step_name(step);
  {
    HashingWriter f(dest);
    uint32_t version = kVersion, zero = 0;
    uint64_t len = text.size();
    f.write(kMagic, 8);
    f.write(&version, 4);
    f.write(&zero, 4);
    f.write(&len, 8);
    f.write(text.data(), text.size());
    for (const auto& s : sections) f.write(s.data, size_t(s.count) * sizeof(float));
    f.commit_with_digest();
  }
  {
    AtomicFileWriter latest((fs::path(dir) / "latest").string());
    std::string name = dest.filename().string() + "\n";
    latest.write(name.data(), name.size());
    latest.commit();
  }
  // Keep the newest `keep` checkpoints.
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".ckpt" && e.path().filename().string().starts_with("step_"))
      all.push_back(e.path());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + size_t(keep) < all.size(); ++i) fs::remove(all[i], ec);
  return dest.string();
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  fs::path latest = fs::path(dir) / "latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::ifstream in(latest);
  std::string name;
  std::getline(in, name);
  fs::path path = fs::path(dir) / name;
  TESSEL_CHECK(!name.empty() && fs::exists(path), CorruptDataError,
               "'{}' names checkpoint '{}', which does not exist: restore it or delete '{}' to "
               "start fresh",
               latest.string(), name, latest.string());
  return path.string();
}

CheckpointFile CheckpointFile::open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in, IoError, "cannot open checkpoint '{}'", path);
  CheckpointFile p;
  p.path_ = path;
  p.bytes_.assign(std::istreambuf_iterator<char>(in), {});
  const auto& b = p.bytes_;
  constexpr size_t kFixed = 8 + 4 + 4 + 8;
  TESSEL_CHECK(b.size() >= kFixed + 8, CorruptDataError,
               "checkpoint '{}' is truncated ({} bytes): delete it or restore it from a copy", path,
               b.size());
  TESSEL_CHECK(std::memcmp(b.data(), kMagic, 8) == 0, CorruptDataError,
               "'{}' is not a tessel checkpoint (bad magic)", path);
  uint32_t version;
  std::memcpy(&version, b.data() + 8, 4);
  TESSEL_CHECK(version == kVersion, CorruptDataError,
               "checkpoint '{}' has format version {}, this build reads version {}", path, version,
               kVersion);
  uint64_t stored;
  std::memcpy(&stored, b.data() + b.size() - 8, 8);
  uint64_t actual = XXH3_64bits(b.data(), b.size() - 8);
  TESSEL_CHECK(stored == actual, CorruptDataError,
               "checkpoint '{}' fails its checksum (file truncated or modified): delete it to "
               "resume from the previous checkpoint",
               path);
  uint64_t header_len;
  std::memcpy(&header_len, b.data() + 16, 8);
  TESSEL_CHECK(header_len <= b.size() - kFixed - 8, CorruptDataError,
               "checkpoint '{}' has a bad header length", path);
  try {
    p.header_ = nlohmann::json::parse(b.begin() + kFixed, b.begin() + kFixed + long(header_len));
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(CorruptDataError, "checkpoint '{}' has an unreadable header: {}", path, e.what());
  }
  p.payload_offset_ = kFixed + header_len;
  return p;
}

void CheckpointFile::load(const std::vector<CheckpointSection>& sections) const {
  size_t offset = payload_offset_;
  std::map<std::string, std::pair<size_t, int64_t>> where;  // name -> (offset, count)
  for (const auto& s : header_.at("sections")) {
    int64_t count = s.at("count").get<int64_t>();
    where[s.at("name").get<std::string>()] = {offset, count};
    offset += size_t(count) * sizeof(float);
  }
  TESSEL_CHECK(offset + 8 == bytes_.size(), CorruptDataError,
               "checkpoint '{}' sizes do not add up ({} bytes of sections, file has {})", path_,
               offset + 8, bytes_.size());
  for (const auto& s : sections) {
    auto it = where.find(s.name);
    TESSEL_CHECK(it != where.end(), CorruptDataError, "checkpoint '{}' has no section '{}'", path_,
                 s.name);
    TESSEL_CHECK(it->second.second == s.count, CorruptDataError,
                 "checkpoint '{}' section '{}' holds {} values but {} are needed (another model?)",
                 path_, s.name, it->second.second, s.count);
    std::memcpy(s.data, bytes_.data() + it->second.first, size_t(s.count) * sizeof(float));
  }
}

nlohmann::json load_checkpoint(const std::string& path,
                               const std::vector<CheckpointSection>& sections) {
  CheckpointFile file = CheckpointFile::open(path);
  file.load(sections);
  return file.meta();
}

}  // namespace tessel::runtime
