#include "tessel/tensor/dtype.h"

#include <cmath>

#include "tessel/core/check.h"

namespace tessel {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
    case DType::u16:
      return 2;
  }
  TESSEL_THROW(InvalidArgumentError, "invalid dtype {}", int(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
    case DType::u16:
      return "u16";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
    case DType::u16:
      return "U16";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType t :
       {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::u16}) {
    if (name == dtype_name(t) || name == dtype_safetensors_name(t)) return t;
  }
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "float16") return DType::f16;
  TESSEL_THROW(ConfigError, "unknown dtype '{}' (use f32, bf16, f16, i32, i64, u8 or u16)", name);
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

float f16_to_f32(f16 x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    // Zero or subnormal: value = mant * 2^-24.
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

f16 f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in f16: round abs * 2^24 to the nearest integer, ties to even.
    float v = bits_to_f32(abs) * 16777216.0f;  // exact: scaling by a power of two
    float r = std::nearbyint(v);               // default rounding mode: ties to even
    return f16{uint16_t(sign | uint16_t(r))};
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, ties to even.
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return f16{uint16_t(sign | ((rounded - 0x38000000u) >> 13))};
}

namespace {

template <typename T>
float load_float(const void* p, size_t i) {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16_to_f32(static_cast<const bf16*>(p)[i]);
  else if constexpr (std::is_same_v<T, f16>)
    return f16_to_f32(static_cast<const f16*>(p)[i]);
  else
    return float(static_cast<const T*>(p)[i]);
}

float load_as_float(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::f32:
      return load_float<float>(p, i);
    case DType::bf16:
      return load_float<bf16>(p, i);
    case DType::f16:
      return load_float<f16>(p, i);
    case DType::i32:
      return load_float<int32_t>(p, i);
    case DType::i64:
      return load_float<int64_t>(p, i);
    case DType::u8:
      return load_float<uint8_t>(p, i);
    case DType::u16:
      return load_float<uint16_t>(p, i);
  }
  return 0;
}

int64_t load_as_int(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DType::i64:
      return static_cast<const int64_t*>(p)[i];
    case DType::u8:
      return static_cast<const uint8_t*>(p)[i];
    case DType::u16:
      return static_cast<const uint16_t*>(p)[i];
    default:
      return int64_t(load_as_float(p, t, i));
  }
}

void store(void* p, DType t, size_t i, float fv, int64_t iv, bool from_float) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(p)[i] = from_float ? fv : float(iv);
      break;
    case DType::bf16:
      static_cast<bf16*>(p)[i] = f32_to_bf16(from_float ? fv : float(iv));
      break;
    case DType::f16:
      static_cast<f16*>(p)[i] = f32_to_f16(from_float ? fv : float(iv));
      break;
    case DType::i32:
      static_cast<int32_t*>(p)[i] = int32_t(from_float ? int64_t(fv) : iv);
      break;
    case DType::i64:
      static_cast<int64_t*>(p)[i] = from_float ? int64_t(fv) : iv;
      break;
    case DType::u8:
      static_cast<uint8_t*>(p)[i] = uint8_t(from_float ? int64_t(fv) : iv);
      break;
    case DType::u16:
      static_cast<uint16_t*>(p)[i] = uint16_t(from_float ? int64_t(fv) : iv);
      break;
  }
}

}  // namespace

void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    std::memmove(dst, src, n * dtype_size(src_type));
    return;
  }
  bool from_float = is_floating(src_type);
  if (src_type == DType::f32 && dst_type == DType::bf16) {
    auto* s = static_cast<const float*>(src);
    auto* d = static_cast<bf16*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
    return;
  }
  if (src_type == DType::bf16 && dst_type == DType::f32) {
    auto* s = static_cast<const bf16*>(src);
    auto* d = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (from_float)
      store(dst, dst_type, i, load_as_float(src, src_type, i), 0, true);
    else
      store(dst, dst_type, i, 0, load_as_int(src, src_type, i), false);
  }
}

}  // namespace tessel
