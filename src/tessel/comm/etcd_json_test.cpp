#include "tessel/comm/etcd_json.h"

#include <gtest/gtest.h>

namespace tessel::comm {
namespace {

using nlohmann::json;

TEST(GatewayInteger, ReadsStringsAndNumbersAndRefusesWhatDoesNotFitInt64) {
  EXPECT_EQ(gateway_integer(json{{"r", "42"}}, "r"), 42);
  EXPECT_EQ(gateway_integer(json{{"r", 42}}, "r"), 42);
  EXPECT_EQ(gateway_integer(json{{"r", -3}}, "r"), -3);
  EXPECT_EQ(gateway_integer(json::object(), "r"), 0);  // etcd omits zero values
  EXPECT_EQ(gateway_integer(json{{"r", INT64_MAX}}, "r"), INT64_MAX);
  // Above 2^63 - 1: refused, not wrapped to a negative revision (2^64 - 1 read as -1).
  EXPECT_EQ(gateway_integer(json::parse(R"({"r": 18446744073709551615})"), "r"), std::nullopt);
  EXPECT_EQ(gateway_integer(json::parse(R"({"r": 9223372036854775808})"), "r"), std::nullopt);
  EXPECT_EQ(gateway_integer(json{{"r", "9223372036854775808"}}, "r"), std::nullopt);
  EXPECT_EQ(gateway_integer(json{{"r", "12x"}}, "r"), std::nullopt);
  EXPECT_EQ(gateway_integer(json{{"r", 1.5}}, "r"), std::nullopt);
}

}  // namespace
}  // namespace tessel::comm
