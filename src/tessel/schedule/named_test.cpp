#include "tessel/schedule/named.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/validate.h"
#include "tessel/schedule/zero_bubble.h"

namespace tessel::schedule {
namespace {

std::string message_of(auto&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(NamedSchedule, ListsTheFiveSchedules) {
  const auto names = schedule_names();
  EXPECT_EQ(std::vector<std::string_view>(names.begin(), names.end()),
            (std::vector<std::string_view>{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"}));
  for (std::string_view n : names) EXPECT_TRUE(is_schedule_name(n)) << n;
  EXPECT_FALSE(is_schedule_name("greedy"));
  EXPECT_FALSE(is_schedule_name("1F1B"));
}

TEST(NamedSchedule, MakesTheGeneratorsLists) {
  for (int p : {1, 2, 4}) {
    for (int m : {1, 3, 8}) {
      EXPECT_EQ(make_schedule("gpipe", p, m), gpipe(p, m));
      EXPECT_EQ(make_schedule("1f1b", p, m), one_f_one_b(p, m));
      EXPECT_EQ(make_schedule("interleaved-1f1b", p, m), interleaved_one_f_one_b(p, m, 1));
      EXPECT_EQ(make_schedule("zb-h1", p, m), zb_h1(p, m));
      EXPECT_EQ(make_schedule("zb-v", p, m, 2), zb_v(p, m));
      for (std::string_view n : schedule_names())
        validate(make_schedule(n, p, m, n == "zb-v" ? 2 : 1));
    }
  }
  EXPECT_EQ(make_schedule("interleaved-1f1b", 2, 4, 3), interleaved_one_f_one_b(2, 4, 3));
  validate(make_schedule("interleaved-1f1b", 2, 4, 3));
}

TEST(NamedSchedule, AnalyticBubbles) {
  EXPECT_DOUBLE_EQ(analytic_bubble("gpipe", 4, 8), bubble_fraction(4, 8));
  EXPECT_DOUBLE_EQ(analytic_bubble("1f1b", 4, 8), bubble_fraction(4, 8));
  EXPECT_DOUBLE_EQ(analytic_bubble("interleaved-1f1b", 4, 8, 2), bubble_fraction(4, 8, 2));
  EXPECT_DOUBLE_EQ(analytic_bubble("interleaved-1f1b", 4, 8), bubble_fraction(4, 8));
  EXPECT_DOUBLE_EQ(analytic_bubble("zb-h1", 4, 8), zb_h1_bubble_fraction(4, 8));
  EXPECT_DOUBLE_EQ(analytic_bubble("zb-h1", 4, 2), zb_h1_bubble_fraction(4, 2));
  EXPECT_DOUBLE_EQ(analytic_bubble("zb-v", 4, 8, 2), zb_v_bubble_fraction(4, 8));
  EXPECT_DOUBLE_EQ(zb_v_bubble_fraction(4, 8), 3.0 / 51);
  EXPECT_THROW(analytic_bubble("1f1b", 0, 8), ConfigError);
}

TEST(NamedSchedule, RejectsUnknownNamesAndChunksItCannotRun) {
  const std::string unknown = message_of([] { make_schedule("pipedream", 2, 4); });
  EXPECT_NE(unknown.find("unknown schedule 'pipedream' (known: gpipe, 1f1b, interleaved-1f1b, "
                         "zb-h1, zb-v)"),
            std::string::npos)
      << unknown;
  EXPECT_THROW(analytic_bubble("greedy", 2, 4), ConfigError);
  for (std::string_view n : {"gpipe", "1f1b", "zb-h1"}) {
    const std::string chunks = message_of([&] { make_schedule(n, 2, 4, 2); });
    EXPECT_NE(chunks.find("schedule " + std::string(n) +
                          " runs one model chunk per rank, but the plan has virtual_stages 2; use "
                          "--schedule interleaved-1f1b or greedy"),
              std::string::npos)
        << chunks;
    EXPECT_THROW(analytic_bubble(n, 2, 4, 2), ConfigError);
  }
  for (int v : {1, 3}) {
    const std::string v_shape = message_of([&] { make_schedule("zb-v", 2, 4, v); });
    EXPECT_NE(v_shape.find("zb-v places two model chunks per rank as a V"), std::string::npos)
        << v_shape;
  }
  EXPECT_THROW(make_schedule("interleaved-1f1b", 2, 4, 0), ConfigError);
  EXPECT_THROW(make_schedule("interleaved-1f1b", 2, 3, 2), ConfigError);  // m % p != 0
  EXPECT_THROW(make_schedule("1f1b", 0, 4), ConfigError);
}

}  // namespace
}  // namespace tessel::schedule
