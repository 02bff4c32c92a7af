#include "tessel/schedule/named.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>

#include "tessel/core/check.h"
#include "tessel/schedule/bubble.h"
#include "tessel/schedule/generators.h"
#include "tessel/schedule/zero_bubble.h"

namespace tessel::schedule {

namespace {

enum class Kind { gpipe, one_f_one_b, interleaved_one_f_one_b, zb_h1, zb_v };

constexpr std::array<std::string_view, 5> kNames = {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
                                                    "zb-v"};
constexpr std::array<Kind, 5> kKinds = {Kind::gpipe, Kind::one_f_one_b,
                                        Kind::interleaved_one_f_one_b, Kind::zb_h1, Kind::zb_v};

// The schedule called `name`, checked against the chunks per rank it is asked to run.
Kind kind_of(std::string_view name, int virtual_stages) {
  const auto it = std::find(kNames.begin(), kNames.end(), name);
  TESSEL_CHECK(it != kNames.end(), ConfigError, "unknown schedule '{}' (known: {})", name,
               fmt::join(kNames, ", "));
  const Kind kind = kKinds[size_t(it - kNames.begin())];
  TESSEL_CHECK(virtual_stages >= 1, ConfigError,
               "schedule {}: virtual_stages is {}, must be at least 1", name, virtual_stages);
  TESSEL_CHECK(kind != Kind::zb_v || virtual_stages == 2, ConfigError,
               "schedule zb-v places two model chunks per rank as a V, but the plan has "
               "virtual_stages {}; use virtual_stages 2",
               virtual_stages);
  TESSEL_CHECK(kind == Kind::interleaved_one_f_one_b || kind == Kind::zb_v || virtual_stages == 1,
               ConfigError,
               "schedule {} runs one model chunk per rank, but the plan has virtual_stages {}; "
               "use --schedule interleaved-1f1b or greedy",
               name, virtual_stages);
  return kind;
}

}  // namespace

std::span<const std::string_view> schedule_names() {
  return kNames;
}

bool is_schedule_name(std::string_view name) {
  return std::find(kNames.begin(), kNames.end(), name) != kNames.end();
}

Schedule make_schedule(std::string_view name, int stages, int micro_batches, int virtual_stages) {
  switch (kind_of(name, virtual_stages)) {
    case Kind::gpipe:
      return gpipe(stages, micro_batches);
    case Kind::one_f_one_b:
      return one_f_one_b(stages, micro_batches);
    case Kind::interleaved_one_f_one_b:
      return interleaved_one_f_one_b(stages, micro_batches, virtual_stages);
    case Kind::zb_h1:
      return zb_h1(stages, micro_batches);
    case Kind::zb_v:
      return zb_v(stages, micro_batches);
  }
  TESSEL_THROW(ConfigError, "unknown schedule '{}'", name);
}

double analytic_bubble(std::string_view name, int stages, int micro_batches, int virtual_stages) {
  switch (kind_of(name, virtual_stages)) {
    case Kind::gpipe:
    case Kind::one_f_one_b:
      return bubble_fraction(stages, micro_batches);
    case Kind::interleaved_one_f_one_b:
      return bubble_fraction(stages, micro_batches, virtual_stages);
    case Kind::zb_h1:
      return zb_h1_bubble_fraction(stages, micro_batches);
    case Kind::zb_v:
      return zb_v_bubble_fraction(stages, micro_batches);
  }
  TESSEL_THROW(ConfigError, "unknown schedule '{}'", name);
}

}  // namespace tessel::schedule
