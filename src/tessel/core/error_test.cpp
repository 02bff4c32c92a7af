#include <gtest/gtest.h>

#include "tessel/core/check.h"
#include "tessel/core/log.h"

namespace tessel {
namespace {

TEST(Check, ThrowsTypedErrorWithMessageAndLocation) {
  try {
    int heads = 3;
    TESSEL_CHECK(64 % heads == 0, ConfigError, "n_embd {} is not divisible by n_head {}", 64,
                 heads);
    FAIL() << "check did not throw";
  } catch (const ConfigError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("n_embd 64 is not divisible by n_head 3"), std::string::npos) << what;
    EXPECT_NE(what.find("core/error_test.cpp:"), std::string::npos) << what;
    EXPECT_STREQ(e.kind(), "config error");
  }
}

TEST(Check, PassingCheckEvaluatesConditionOnce) {
  int calls = 0;
  auto cond = [&] { return ++calls > 0; };
  TESSEL_CHECK(cond(), IoError, "never");
  EXPECT_EQ(calls, 1);
}

TEST(Check, ErrorsShareTheBaseClass) {
  EXPECT_THROW(TESSEL_THROW(CorruptDataError, "bad {}", 1), Error);
  EXPECT_THROW(TESSEL_THROW(PeerLostError, "rank {} gone", 2), Error);
  EXPECT_THROW(TESSEL_THROW(TimeoutError, "slow"), Error);
}

TEST(Log, RejectsUnknownLevel) {
  EXPECT_NO_THROW(set_log_level("warn"));
  EXPECT_THROW(set_log_level("loud"), ConfigError);
  set_log_level("info");
}

}  // namespace
}  // namespace tessel
