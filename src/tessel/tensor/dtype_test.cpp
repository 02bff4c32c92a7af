#include "tessel/tensor/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tessel/core/error.h"

namespace tessel {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  for (DType t :
       {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::u16}) {
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
    EXPECT_EQ(parse_dtype(dtype_safetensors_name(t)), t);
  }
  EXPECT_THROW(parse_dtype("f8"), ConfigError);
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between bf16 neighbours 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, f32_to_bf16(1.0f).bits);
  // 1 + 3*2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes to 1 + 2^-6.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  // Just above the midpoint rounds up.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(INFINITY))));
  // Largest finite float rounds up to infinity in bf16 (as torch does).
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::max()))));
}

TEST(DType, Bf16RoundTripOfRepresentableValuesIsExact) {
  for (uint32_t bits = 0; bits < 0x10000; bits += 7) {
    bf16 x{uint16_t(bits)};
    float f = bf16_to_f32(x);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f).bits, x.bits) << bits;
  }
}

TEST(DType, F16AllValuesRoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    f16 x{uint16_t(bits)};
    float f = f16_to_f32(x);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f).bits, x.bits) << bits;
  }
}

TEST(DType, F16Rounding) {
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f)), 1.0f);
  EXPECT_EQ(f16_to_f32(f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(70000.0f))));
  // Halfway between 1 and 1 + 2^-10 ties to even (1).
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  // Smallest subnormal and half of it (ties to even: 0).
  EXPECT_EQ(f16_to_f32(f32_to_f16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(f32_to_f16(std::ldexp(1.0f, -25))), 0.0f);
  EXPECT_EQ(f16_to_f32(f32_to_f16(std::ldexp(3.0f, -25))), std::ldexp(2.0f, -24));
}

TEST(DType, ConvertBetweenTypes) {
  std::vector<float> src = {1.5f, -2.25f, 3.0f};
  std::vector<int32_t> i(3);
  convert(src.data(), DType::f32, i.data(), DType::i32, 3);
  EXPECT_EQ(i, (std::vector<int32_t>{1, -2, 3}));
  std::vector<uint16_t> h(3);
  convert(src.data(), DType::f32, h.data(), DType::bf16, 3);
  std::vector<float> back(3);
  convert(h.data(), DType::bf16, back.data(), DType::f32, 3);
  EXPECT_EQ(back, src);
  std::vector<int64_t> big = {1ll << 40, -5};
  std::vector<int64_t> copy(2);
  convert(big.data(), DType::i64, copy.data(), DType::i64, 2);
  EXPECT_EQ(copy, big);
}

}  // namespace
}  // namespace tessel
