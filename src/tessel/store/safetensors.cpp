#include "tessel/store/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <set>

#include "tessel/core/atomic_file.h"
#include "tessel/core/check.h"
#include "tessel/store/checksum.h"
#include "tessel/tensor/region_runs.h"

namespace tessel::store {

namespace {

// Hugging Face rejects headers above 100 MB; so do we, before allocating anything.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

constexpr DType kDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32,
                             DType::i64, DType::u8,   DType::u16};

// Position in Hugging Face's Dtype enum; its writer stores tensors by this, descending, which
// orders them by decreasing element size and so keeps every tensor aligned.
int hf_dtype_order(DType t) {
  switch (t) {
    case DType::u8:
      return 1;
    case DType::u16:
      return 6;
    case DType::f16:
      return 7;
    case DType::bf16:
      return 8;
    case DType::i32:
      return 9;
    case DType::f32:
      return 11;
    case DType::i64:
      return 13;
  }
  return 0;
}

bool is_hf_dtype_tessel_lacks(std::string_view s) {
  for (auto n : {"BOOL", "I8", "I16", "U32", "U64", "F64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4",
                 "F6_E2M3", "F6_E3M2", "C64"})
    if (s == n) return true;
  return false;
}

uint64_t checked_nbytes(const Shape& shape, DType dtype, bool* overflow) {
  uint64_t n = dtype_size(dtype);
  *overflow = false;
  for (int64_t d : shape.dims()) {
    if (d < 0 || __builtin_mul_overflow(n, uint64_t(d), &n)) *overflow = true;
  }
  if (n > (uint64_t(1) << 62)) *overflow = true;
  return n;
}

}  // namespace

namespace {

// The header text (padded to a multiple of 8) and the tensors' sizes and file order.
struct Header {
  std::string text;
  std::vector<size_t> order;
  std::vector<uint64_t> sizes;
};

Header make_header(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                   const std::map<std::string, std::string>& metadata, bool need_data) {
  Header h;
  h.order.resize(tensors.size());
  std::iota(h.order.begin(), h.order.end(), size_t(0));
  std::sort(h.order.begin(), h.order.end(), [&](size_t a, size_t b) {
    int oa = hf_dtype_order(tensors[a].dtype), ob = hf_dtype_order(tensors[b].dtype);
    if (oa != ob) return oa > ob;
    return tensors[a].name < tensors[b].name;
  });
  // The header is assembled as text: keys in data order like Hugging Face's writer, in linear
  // time (ordered_json looks keys up linearly).
  std::string& text = h.text;
  text = "{";
  h.sizes.resize(tensors.size());
  try {
    if (!metadata.empty()) text += "\"__metadata__\":" + nlohmann::json(metadata).dump();
    std::set<std::string_view> names;
    uint64_t offset = 0;
    for (size_t k = 0; k < h.order.size(); ++k) {
      const auto& t = tensors[h.order[k]];
      TESSEL_CHECK(!t.name.empty() && t.name != "__metadata__", InvalidArgumentError,
                   "safetensors '{}': invalid tensor name '{}'", path, t.name);
      TESSEL_CHECK(names.insert(t.name).second, InvalidArgumentError,
                   "safetensors '{}': tensor '{}' added twice", path, t.name);
      bool overflow;
      uint64_t n = checked_nbytes(t.shape, t.dtype, &overflow);
      TESSEL_CHECK(!overflow, InvalidArgumentError,
                   "safetensors '{}': tensor '{}' shape {} invalid", path, t.name, t.shape.str());
      TESSEL_CHECK(!need_data || t.data != nullptr || n == 0, InvalidArgumentError,
                   "safetensors '{}': tensor '{}' has no data", path, t.name);
      h.sizes[h.order[k]] = n;
      nlohmann::ordered_json entry = {{"dtype", std::string(dtype_safetensors_name(t.dtype))},
                                      {"shape", t.shape.dims()},
                                      {"data_offsets", {offset, offset + n}}};
      if (text.size() > 1) text += ',';
      text += nlohmann::json(t.name).dump() + ":" + entry.dump();
      offset += n;
    }
    text += '}';
  } catch (const nlohmann::json::exception& e) {
    TESSEL_THROW(InvalidArgumentError, "safetensors '{}': cannot encode the header: {}", path,
                 e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return h;
}

void write_length(AtomicFileWriter& out, uint64_t n) {
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(n >> (8 * i));
  out.write(len, 8);
}

}  // namespace

uint64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  const Header h = make_header(path, tensors, metadata, true);
  AtomicFileWriter out(path);
  write_length(out, h.text.size());
  out.write(h.text.data(), h.text.size());
  for (size_t i : h.order) out.write(tensors[i].data, h.sizes[i]);
  const uint64_t total = out.size();
  out.commit();
  return total;
}

uint64_t write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                           const std::map<std::string, std::string>& metadata,
                           const SafetensorsStream& stream) {
  const Header h = make_header(path, tensors, metadata, false);
  AtomicFileWriter out(path);
  write_length(out, h.text.size());
  out.write(h.text.data(), h.text.size());
  for (size_t i : h.order) {
    uint64_t written = 0;
    const uint64_t want = h.sizes[i];
    stream.produce(i, [&](const void* data, size_t n) {
      TESSEL_CHECK(written + n <= want, IoError,
                   "safetensors '{}': tensor '{}' was given more than its {} bytes", path,
                   tensors[i].name, want);
      out.write(data, n);
      written += n;
    });
    TESSEL_CHECK(written == want, IoError,
                 "safetensors '{}': tensor '{}' was given {} of its {} bytes", path,
                 tensors[i].name, written, want);
  }
  if (stream.final_metadata) {
    const Header final = make_header(path, tensors, stream.final_metadata(), false);
    TESSEL_CHECK(final.text.size() == h.text.size(), InvalidArgumentError,
                 "safetensors '{}': the final metadata changes the header's length ({} -> {} "
                 "bytes)",
                 path, h.text.size(), final.text.size());
    out.write_at(8, final.text.data(), final.text.size());
  }
  const uint64_t total = out.size();
  out.commit();
  return total;
}

struct SafetensorsReader::Impl {
  std::string path;
  int fd = -1;
  uint64_t size = 0;
  uint64_t header_bytes = 0;
  uint64_t header_xxh3 = 0;
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, size_t, std::less<>> by_name;
  std::map<std::string, std::string> metadata;
  mutable std::atomic<uint64_t> bytes_read{0};
  mutable std::atomic<uint64_t> read_calls{0};

  ~Impl() {
    if (fd >= 0) ::close(fd);
  }

  void pread(uint64_t offset, void* out, uint64_t n) const {
    read_calls.fetch_add(1, std::memory_order_relaxed);
    bytes_read.fetch_add(n, std::memory_order_relaxed);
    auto* p = static_cast<char*>(out);
    while (n > 0) {
      ssize_t r = ::pread(fd, p, n, off_t(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) TESSEL_THROW(IoError, "cannot read '{}': {}", path, std::strerror(errno));
      if (r == 0) {
        TESSEL_THROW(CorruptDataError,
                     "'{}' ends at byte {} but {} more bytes were expected there; the file was "
                     "truncated",
                     path, offset, n);
      }
      p += r;
      offset += uint64_t(r);
      n -= uint64_t(r);
    }
  }

  [[noreturn]] void corrupt(const std::string& what) const {
    TESSEL_THROW(CorruptDataError, "safetensors file '{}': {}", path, what);
  }

  void parse_entry(const std::string& name, const nlohmann::json& v) {
    if (!v.is_object()) corrupt(fmt::format("tensor '{}': entry is not a JSON object", name));
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string() || sh == v.end() || !sh->is_array() || off == v.end() ||
        !off->is_array() || off->size() != 2)
      corrupt(
          fmt::format("tensor '{}': needs string dtype, array shape and two data_offsets", name));
    const std::string dts = dt->get<std::string>();
    std::optional<DType> dtype;
    for (DType t : kDTypes)
      if (dts == dtype_safetensors_name(t)) dtype = t;
    if (!dtype && is_hf_dtype_tessel_lacks(dts)) {
      TESSEL_THROW(UnsupportedError,
                   "safetensors file '{}': tensor '{}' has dtype {}, which tessel does not "
                   "support (F32, BF16, F16, I32, I64, U8, U16)",
                   path, name, dts);
    }
    if (!dtype) corrupt(fmt::format("tensor '{}': unknown dtype '{}'", name, dts));
    std::vector<int64_t> dims;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned())
        corrupt(fmt::format("tensor '{}': shape {} is not a list of sizes", name, sh->dump()));
      dims.push_back(int64_t(std::min<uint64_t>(d.get<uint64_t>(), uint64_t(1) << 62)));
    }
    for (const auto& o : *off)
      if (!o.is_number_unsigned())
        corrupt(
            fmt::format("tensor '{}': data_offsets {} are not byte offsets", name, off->dump()));
    const uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    bool overflow;
    Shape shape(std::move(dims));
    const uint64_t need = checked_nbytes(shape, *dtype, &overflow);
    if (overflow) corrupt(fmt::format("tensor '{}': shape {} is too large", name, shape.str()));
    if (e < b || e - b != need)
      corrupt(fmt::format("tensor '{}': data_offsets [{}, {}] hold {} bytes but {} {} needs {}",
                          name, b, e, e >= b ? e - b : 0, dts, shape.str(), need));
    tensors.push_back({name, *dtype, std::move(shape), b, need});
  }

  void load() {
    uint8_t len[8];
    if (size < 8)
      corrupt(
          fmt::format("{} bytes is too short for the 8-byte header length; the file is "
                      "truncated or not safetensors",
                      size));
    pread(0, len, 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    if (n > kMaxHeaderBytes)
      corrupt(
          fmt::format("header length {} exceeds the 100 MB limit; not a safetensors file, "
                      "or its first 8 bytes are damaged",
                      n));
    if (8 + n > size)
      corrupt(
          fmt::format("header of {} bytes runs past the end of the {}-byte file; the file is "
                      "truncated",
                      n, size));
    std::string text(n, '\0');
    pread(8, text.data(), n);
    header_bytes = 8 + n;
    {
      Xxh3Stream h;
      h.update(len, 8);
      h.update(text.data(), text.size());
      header_xxh3 = h.digest();
    }
    if (n == 0 || text[0] != '{') corrupt("header does not start with '{'");
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      corrupt(fmt::format("header is not valid JSON ({})", e.what()));
    }
    if (!header.is_object()) corrupt("header is not a JSON object");
    for (const auto& [name, v] : header.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) corrupt("__metadata__ is not an object");
        for (const auto& [k, s] : v.items()) {
          if (!s.is_string()) corrupt(fmt::format("__metadata__ value '{}' is not a string", k));
          metadata[k] = s.get<std::string>();
        }
        continue;
      }
      parse_entry(name, v);
    }
    std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
      return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
    });
    uint64_t expect = 0;
    for (const auto& t : tensors) {
      if (t.offset < expect)
        corrupt(
            fmt::format("tensor '{}' at data offset {} overlaps the previous tensor (ending "
                        "at {})",
                        t.name, t.offset, expect));
      if (t.offset > expect)
        corrupt(fmt::format("tensor '{}' starts at data offset {}, leaving a gap after {}", t.name,
                            t.offset, expect));
      expect = t.offset + t.nbytes;
    }
    const uint64_t promised = header_bytes + expect;
    if (promised > size)
      corrupt(
          fmt::format("the file has {} bytes but its header promises {}; the file is "
                      "truncated",
                      size, promised));
    if (promised < size)
      corrupt(
          fmt::format("the file has {} bytes but its header accounts for only {}", size, promised));
    for (size_t i = 0; i < tensors.size(); ++i) {
      tensors[i].offset += header_bytes;
      by_name.emplace(tensors[i].name, i);
    }
  }
};

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (impl->fd < 0)
    TESSEL_THROW(IoError, "cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st;
  if (::fstat(impl->fd, &st) != 0 || !S_ISREG(st.st_mode))
    TESSEL_THROW(IoError, "'{}' is not a regular file", path);
  impl->size = uint64_t(st.st_size);
  impl->load();
  SafetensorsReader r;
  r.impl_ = std::move(impl);
  return r;
}

const std::string& SafetensorsReader::path() const {
  return impl_->path;
}
uint64_t SafetensorsReader::file_size() const {
  return impl_->size;
}
uint64_t SafetensorsReader::header_bytes() const {
  return impl_->header_bytes;
}
uint64_t SafetensorsReader::header_xxh3() const {
  return impl_->header_xxh3;
}
const std::vector<SafetensorsEntry>& SafetensorsReader::tensors() const {
  return impl_->tensors;
}
const std::map<std::string, std::string>& SafetensorsReader::metadata() const {
  return impl_->metadata;
}

const SafetensorsEntry* SafetensorsReader::find(std::string_view name) const {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->tensors[it->second];
}

const SafetensorsEntry& SafetensorsReader::at(std::string_view name) const {
  const auto* e = find(name);
  TESSEL_CHECK(e != nullptr, InvalidArgumentError, "safetensors file '{}' has no tensor '{}'",
               impl_->path, name);
  return *e;
}

void SafetensorsReader::pread(uint64_t offset, void* out, uint64_t n) const {
  impl_->pread(offset, out, n);
}

void SafetensorsReader::read_box(std::string_view name, const Box& box, void* out) const {
  const auto& e = at(name);
  const Box whole = Box::of(e.shape);
  TESSEL_CHECK(box.rank() == whole.rank() && whole.contains(box), InvalidArgumentError,
               "box {} is outside tensor '{}' {} in '{}'", box.str(), name, e.shape.str(),
               impl_->path);
  auto* dst = static_cast<char*>(out);
  const uint64_t es = dtype_size(e.dtype);
  for_each_run(StridedRegion::of_box(box, whole), StridedRegion::of_box(box, box),
               [&](int64_t so, int64_t dof, int64_t n) {
                 impl_->pread(e.offset + uint64_t(so) * es, dst + uint64_t(dof) * es,
                              uint64_t(n) * es);
               });
}

void SafetensorsReader::read(std::string_view name, void* out) const {
  const auto& e = at(name);
  impl_->pread(e.offset, out, e.nbytes);
}

uint64_t SafetensorsReader::bytes_read() const {
  return impl_->bytes_read.load();
}
uint64_t SafetensorsReader::read_calls() const {
  return impl_->read_calls.load();
}

}  // namespace tessel::store
