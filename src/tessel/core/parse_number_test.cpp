// The one strict number reader: whole text, range, and an error naming what was read.
#include "tessel/core/parse_number.h"

#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel {
namespace {

using tessel::testing::error_of;

TEST(ParseInteger, ReadsOnlyAWholeNumberInRange) {
  EXPECT_EQ(parse_integer("3", "scale N", 1, 100), 3);
  EXPECT_EQ(parse_integer("-5", "x", -10, 10), -5);
  EXPECT_EQ(parse_integer("9223372036854775807", "x", 0, INT64_MAX), INT64_MAX);
  for (const char* bad : {"2.5", "2abc", "1 2", " 2", "2 ", "+2", "", "0x10", "1e3", "two"}) {
    const auto what = error_of<ConfigError>([&] { parse_integer(bad, "scale N", 1, 100); });
    EXPECT_NE(what.find("scale N is '" + std::string(bad) + "', not a whole number"),
              std::string::npos)
        << bad << ": " << what;
  }
  EXPECT_NE(error_of<ConfigError>([] {
              parse_integer("0", "--steps", 1, 1000);
            }).find("--steps is 0; it must be from 1 to 1000"),
            std::string::npos);
  EXPECT_NE(error_of<ConfigError>([] {
              parse_integer("99999999999999999999", "x", 0, 9);
            }).find("out of range"),
            std::string::npos);
}

}  // namespace
}  // namespace tessel
