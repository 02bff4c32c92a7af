// Element types and conversions between them.
//
// bf16 and f16 are stored as raw 16-bit patterns; conversions from f32 round to nearest, ties to
// even, and keep NaN a NaN (quiet) and infinities infinite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace tessel {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8, u16 };

size_t dtype_size(DType t);
// Lower-case name ("f32", "bf16", ...).
std::string_view dtype_name(DType t);
// Parses a name; also accepts the safetensors spellings ("F32", "BF16", "I64", ...).
// Throws ConfigError naming the unknown spelling.
DType parse_dtype(std::string_view name);
// The safetensors spelling ("F32", "BF16", ...).
std::string_view dtype_safetensors_name(DType t);
bool is_floating(DType t);

// Raw 16-bit float formats.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(bf16 x) {
  return bits_to_f32(uint32_t(x.bits) << 16);
}
inline bf16 f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x0040u)};  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);                                   // ties to even
  return bf16{uint16_t((u + rounding) >> 16)};
}

float f16_to_f32(f16 x);
f16 f32_to_f16(float f);

// Converts n elements between any two dtypes (through f32 for floats, through int64 for integers;
// float -> integer truncates toward zero). src and dst must not overlap unless equal dtypes.
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace tessel
