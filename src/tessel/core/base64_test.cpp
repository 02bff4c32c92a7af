#include "tessel/core/base64.h"

#include <gtest/gtest.h>

#include <string>

#include "tessel/core/error.h"

namespace tessel {
namespace {

TEST(Base64, EncodesTheRfc4648Vectors) {
  EXPECT_EQ(base64_encode(""), "");
  EXPECT_EQ(base64_encode("f"), "Zg==");
  EXPECT_EQ(base64_encode("fo"), "Zm8=");
  EXPECT_EQ(base64_encode("foo"), "Zm9v");
  EXPECT_EQ(base64_encode("foob"), "Zm9vYg==");
  EXPECT_EQ(base64_encode("fooba"), "Zm9vYmE=");
  EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(base64_decode("Zm9vYmE="), "fooba");
  EXPECT_EQ(base64_decode("Zm9vYg=="), "foob");
  EXPECT_EQ(base64_decode(""), "");
}

TEST(Base64, RoundTripsEveryByte) {
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes += static_cast<char>(i);
  for (size_t n = 0; n <= bytes.size(); n += 37) {
    const std::string part = bytes.substr(0, n);
    EXPECT_EQ(base64_decode(base64_encode(part)), part) << n;
  }
  EXPECT_EQ(base64_encode(std::string("\0\xff\n{}", 5)), "AP8Ke30=");
}

TEST(Base64, RefusesMalformedText) {
  EXPECT_THROW(base64_decode("Zm9"), CorruptDataError);       // length
  EXPECT_THROW(base64_decode("Zm9v!A=="), CorruptDataError);  // alphabet
  EXPECT_THROW(base64_decode("Z=9v"), CorruptDataError);      // padding inside
  EXPECT_THROW(base64_decode("Zm9v\nA=="), CorruptDataError);
  EXPECT_THROW(base64_decode("===="), CorruptDataError);
}

}  // namespace
}  // namespace tessel
