#include "tessel/net/bearer_token.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>

#include "tessel/core/error.h"
#include "tessel/net/address.h"
#include "tessel/testing/testing.h"

namespace tessel::net {
namespace {

using tessel::testing::TempDir;

std::string write_file(const TempDir& dir, const std::string& name, const std::string& text,
                       mode_t mode) {
  const auto path = (dir / name).string();
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

TEST(ConstantTimeEqual, IsEqualityOfBytes) {
  EXPECT_TRUE(constant_time_equal("", ""));
  EXPECT_TRUE(constant_time_equal("abcdefgh12345678", "abcdefgh12345678"));
  EXPECT_FALSE(constant_time_equal("abcdefgh12345678", "abcdefgh12345679"));
  EXPECT_FALSE(constant_time_equal("xbcdefgh12345678", "abcdefgh12345678"));
  // A prefix, an extension, an empty guess, and bytes that only differ beyond the shorter one.
  EXPECT_FALSE(constant_time_equal("abcdefgh", "abcdefgh12345678"));
  EXPECT_FALSE(constant_time_equal("abcdefgh12345678", "abcdefgh"));
  EXPECT_FALSE(constant_time_equal("", "a"));
  EXPECT_FALSE(constant_time_equal(std::string("ab\0", 3), "ab"));
  EXPECT_TRUE(constant_time_equal(std::string("a\0b", 3), std::string("a\0b", 3)));
  EXPECT_FALSE(constant_time_equal("\xff", "\x7f"));
}

TEST(BearerToken, ReadsTheTokenOfTheBearerScheme) {
  EXPECT_EQ(bearer_token("Bearer abc"), "abc");
  EXPECT_EQ(bearer_token("bearer   abc  "), "abc");
  EXPECT_EQ(bearer_token("BEARER abc"), "abc");
  EXPECT_FALSE(bearer_token("Basic abc"));
  EXPECT_FALSE(bearer_token("Bearer "));
  EXPECT_FALSE(bearer_token("Bearer"));
  EXPECT_FALSE(bearer_token("abc"));
}

TEST(ReadTokenFile, ReadsAPrivateFile) {
  TempDir dir;
  const auto path = write_file(dir, "t", "  0123456789abcdef0123\n", 0600);
  EXPECT_EQ(read_token_file(path, "test"), "0123456789abcdef0123");
  EXPECT_EQ(read_token_file(write_file(dir, "r", "0123456789abcdef", 0400), "test"),
            "0123456789abcdef");
}

TEST(ReadTokenFile, RefusesFilesOthersCanReadAndTokensThatAreNone) {
  TempDir dir;
  for (mode_t mode : {0644, 0640, 0604, 0660, 0606}) {
    const auto path = write_file(dir, "open" + std::to_string(mode), "0123456789abcdef0123", mode);
    try {
      read_token_file(path, "the test endpoint");
      FAIL() << "mode " << mode;
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("chmod 600 " + path), std::string::npos) << what;
      EXPECT_NE(what.find("the test endpoint"), std::string::npos) << what;
    }
  }
  EXPECT_THROW(read_token_file((dir / "missing").string(), "t"), ConfigError);
  EXPECT_THROW(read_token_file(dir.path().string(), "t"), ConfigError);  // a directory
  EXPECT_THROW(read_token_file(write_file(dir, "empty", "\n", 0600), "t"), ConfigError);
  EXPECT_THROW(read_token_file(write_file(dir, "short", "abc", 0600), "t"), ConfigError);
  EXPECT_THROW(read_token_file(write_file(dir, "space", "0123456789 abcdef0123", 0600), "t"),
               ConfigError);
  EXPECT_THROW(read_token_file(write_file(dir, "ctl",
                                          "0123456789\x01"
                                          "abcdef0123",
                                          0600),
                               "t"),
               ConfigError);
}

TEST(IsLoopbackHost, OnlyLiteralLoopbackAddresses) {
  for (const char* host : {"127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "localhost"})
    EXPECT_TRUE(is_loopback_host(host)) << host;
  for (const char* host : {"0.0.0.0", "::", "10.0.0.1", "128.0.0.1", "example.com", "127.1", "",
                           "127.0.0.1.evil", "localhost.example.com"})
    EXPECT_FALSE(is_loopback_host(host)) << host;
}

}  // namespace
}  // namespace tessel::net
