#include "tessel/model/golden_file.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>

#include "tessel/core/check.h"

namespace tessel::model {

namespace {

// The format is little-endian and read with memcpy, which is only right on a little-endian host.
static_assert(std::endian::native == std::endian::little,
              "golden files assume a little-endian host");

constexpr char kMagic[8] = {'T', 'S', 'L', 'G', 'O', 'L', 'D', '\0'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kDTypeF32 = 1;
constexpr uint32_t kDTypeI32 = 2;
// Far above anything golden.py writes; guards against absurd allocations from corrupt headers.
constexpr uint32_t kMaxRank = 8;
constexpr uint32_t kMaxNameLen = 4096;

class Cursor {
 public:
  Cursor(std::span<const char> bytes, const std::string& origin) : bytes_(bytes), origin_(origin) {}

  void take(void* dst, size_t n, const char* what) {
    TESSEL_CHECK(n <= bytes_.size() - pos_, CorruptDataError,
                 "golden file {} is truncated: {} needs {} bytes at offset {} but only {} remain",
                 origin_, what, n, pos_, bytes_.size() - pos_);
    std::memcpy(dst, bytes_.data() + pos_, n);
    pos_ += n;
  }
  template <typename T>
  T get(const char* what) {
    T v;
    take(&v, sizeof(T), what);
    return v;
  }
  size_t remaining() const { return bytes_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  std::span<const char> bytes_;
  const std::string& origin_;
  size_t pos_ = 0;
};

}  // namespace

GoldenFile GoldenFile::read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in.good(), IoError,
               "cannot open golden file {} (regenerate it with tools/make_golden)", path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TESSEL_CHECK(!in.bad(), IoError, "cannot read golden file {}", path.string());
  return parse(bytes, path.string());
}

GoldenFile GoldenFile::parse(std::span<const char> bytes, const std::string& origin) {
  Cursor cur(bytes, origin);
  char magic[8];
  cur.take(magic, sizeof(magic), "the magic");
  TESSEL_CHECK(std::memcmp(magic, kMagic, sizeof(kMagic)) == 0, CorruptDataError,
               "{} is not a golden file (bad magic; expected \"TSLGOLD\\0\")", origin);
  const auto version = cur.get<uint32_t>("the version");
  TESSEL_CHECK(version == kVersion, CorruptDataError,
               "golden file {} has version {}, this reader understands version {}", origin, version,
               kVersion);
  const auto count = cur.get<uint32_t>("the record count");

  GoldenFile file;
  for (uint32_t r = 0; r < count; ++r) {
    const auto name_len = cur.get<uint32_t>("a record name length");
    TESSEL_CHECK(name_len > 0 && name_len <= kMaxNameLen, CorruptDataError,
                 "golden file {}: record {} has a name length of {}", origin, r, name_len);
    std::string name(name_len, '\0');
    cur.take(name.data(), name_len, "a record name");
    const auto dtype_code = cur.get<uint32_t>("a record dtype");
    TESSEL_CHECK(dtype_code == kDTypeF32 || dtype_code == kDTypeI32, CorruptDataError,
                 "golden file {}: record {} has unknown dtype code {}", origin, name, dtype_code);
    const auto rank = cur.get<uint32_t>("a record rank");
    TESSEL_CHECK(rank <= kMaxRank, CorruptDataError, "golden file {}: record {} has rank {}",
                 origin, name, rank);
    std::vector<int64_t> dims(rank);
    int64_t numel = 1;
    for (auto& d : dims) {
      d = cur.get<int64_t>("a record dimension");
      TESSEL_CHECK(d >= 0 && d <= int64_t(bytes.size()), CorruptDataError,
                   "golden file {}: record {} has dimension {}", origin, name, d);
      numel *= d;
      TESSEL_CHECK(numel <= int64_t(bytes.size()), CorruptDataError,
                   "golden file {}: record {} claims more elements than the file holds", origin,
                   name);
    }
    const auto nbytes = cur.get<uint64_t>("a record byte count");
    TESSEL_CHECK(nbytes == uint64_t(numel) * 4, CorruptDataError,
                 "golden file {}: record {} stores {} bytes for {} elements of 4 bytes", origin,
                 name, nbytes, numel);
    TESSEL_CHECK(nbytes <= cur.remaining(), CorruptDataError,
                 "golden file {} is truncated: record {} needs {} bytes at offset {} but only {} "
                 "remain",
                 origin, name, nbytes, cur.pos(), cur.remaining());
    Tensor t = Tensor::empty(Shape(dims), dtype_code == kDTypeF32 ? DType::f32 : DType::i32);
    if (nbytes > 0) cur.take(t.raw(), nbytes, "record data");
    TESSEL_CHECK(file.tensors_.emplace(name, std::move(t)).second, CorruptDataError,
                 "golden file {} holds record {} twice", origin, name);
  }
  TESSEL_CHECK(cur.remaining() == 0, CorruptDataError,
               "golden file {} has {} bytes after its last record", origin, cur.remaining());
  return file;
}

const Tensor& GoldenFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  TESSEL_CHECK(it != tensors_.end(), InvalidArgumentError,
               "golden file has no record {} (regenerate it with tools/make_golden)", name);
  return it->second;
}

double GoldenFile::scalar(const std::string& name) const {
  const Tensor& t = get(name);
  TESSEL_CHECK(t.numel() == 1, InvalidArgumentError, "golden record {} is {}, not a single value",
               name, t.str());
  return t.dtype() == DType::f32 ? double(t.data<float>()[0]) : double(t.data<int32_t>()[0]);
}

std::vector<std::string> GoldenFile::names_under(const std::string& prefix) const {
  std::vector<std::string> out;
  for (auto it = tensors_.lower_bound(prefix); it != tensors_.end(); ++it) {
    if (it->first.compare(0, prefix.size(), prefix) != 0) break;
    out.push_back(it->first.substr(prefix.size()));
  }
  return out;
}

}  // namespace tessel::model
