#include "tessel/layout/training_state.h"

#include "tessel/core/check.h"

namespace tessel::layout {

std::string_view state_kind_name(StateKind k) {
  switch (k) {
    case StateKind::param:
      return "param";
    case StateKind::master:
      return "master";
    case StateKind::adam_m:
      return "adam_m";
    case StateKind::adam_v:
      return "adam_v";
  }
  return "?";
}

StateKind parse_state_kind(std::string_view name) {
  for (StateKind k : kAllStateKinds) {
    if (state_kind_name(k) == name) return k;
  }
  TESSEL_THROW(ConfigError, "unknown state kind '{}' (known: param, master, adam_m, adam_v)", name);
}

std::string state_name(std::string_view tensor, StateKind kind) {
  std::string s(tensor);
  if (kind != StateKind::param) {
    s += '/';
    s += state_kind_name(kind);
  }
  return s;
}

namespace {

constexpr uint32_t kMagic = 0x54535353;  // "SSST"
constexpr uint32_t kVersion = 1;

void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

struct Reader {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  uint64_t u64(const char* what) {
    TESSEL_CHECK(size - pos >= 8, CorruptDataError,
                 "scalar state blob of {} bytes is truncated at '{}' (offset {})", size, what, pos);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(data[pos + size_t(i)]) << (8 * i);
    pos += 8;
    return v;
  }
};

}  // namespace

std::vector<uint8_t> encode(const ScalarState& s) {
  std::vector<uint8_t> out;
  put_u64(out, (uint64_t(kVersion) << 32) | kMagic);
  put_u64(out, uint64_t(s.step));
  put_u64(out, uint64_t(s.lr_step));
  put_u64(out, uint64_t(s.data_cursor));
  put_u64(out, s.rng.size());
  out.insert(out.end(), s.rng.begin(), s.rng.end());
  return out;
}

ScalarState decode_scalar_state(const uint8_t* data, size_t size) {
  Reader r{data, size};
  const uint64_t head = r.u64("header");
  TESSEL_CHECK(uint32_t(head) == kMagic && (head >> 32) == kVersion, CorruptDataError,
               "scalar state blob has header {:#x}; expected magic {:#x} version {}", head, kMagic,
               kVersion);
  ScalarState s;
  s.step = int64_t(r.u64("step"));
  s.lr_step = int64_t(r.u64("lr_step"));
  s.data_cursor = int64_t(r.u64("data_cursor"));
  const uint64_t n = r.u64("rng size");
  TESSEL_CHECK(n == size - r.pos, CorruptDataError,
               "scalar state blob: rng state of {} bytes but {} bytes follow", n, size - r.pos);
  s.rng.assign(data + r.pos, data + size);
  return s;
}

}  // namespace tessel::layout
