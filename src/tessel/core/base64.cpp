#include "tessel/core/base64.h"

#include <array>
#include <cstdint>

#include "tessel/core/check.h"

namespace tessel {
namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

constexpr std::array<int8_t, 256> make_table() {
  std::array<int8_t, 256> table{};
  for (auto& v : table) v = -1;
  for (int i = 0; i < 64; ++i) table[static_cast<uint8_t>(kAlphabet[i])] = static_cast<int8_t>(i);
  return table;
}
constexpr std::array<int8_t, 256> kTable = make_table();

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t n = static_cast<uint8_t>(bytes[i]) << 16 |
                       static_cast<uint8_t>(bytes[i + 1]) << 8 | static_cast<uint8_t>(bytes[i + 2]);
    out += kAlphabet[n >> 18];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
    if (rest == 2) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    out += kAlphabet[n >> 18];
    out += kAlphabet[(n >> 12) & 63];
    out += rest == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64_decode(std::string_view text) {
  TESSEL_CHECK(text.size() % 4 == 0, CorruptDataError,
               "base64 text of {} characters is not a multiple of 4 long", text.size());
  size_t padding = 0;
  if (!text.empty() && text.back() == '=') ++padding;
  if (text.size() >= 2 && text[text.size() - 2] == '=') ++padding;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const size_t pad_here = last ? padding : 0;
    uint32_t n = 0;
    for (size_t j = 0; j < 4; ++j) {
      const char c = text[i + j];
      int v = 0;
      if (j >= 4 - pad_here) {
        v = 0;  // the '=' padding checked above
      } else {
        v = kTable[static_cast<uint8_t>(c)];
        TESSEL_CHECK(v >= 0, CorruptDataError, "invalid base64 character {:?} at offset {}",
                     std::string(1, c), i + j);
      }
      n = n << 6 | static_cast<uint32_t>(v);
    }
    out += static_cast<char>(n >> 16);
    if (pad_here < 2) out += static_cast<char>((n >> 8) & 0xff);
    if (pad_here < 1) out += static_cast<char>(n & 0xff);
  }
  return out;
}

}  // namespace tessel
