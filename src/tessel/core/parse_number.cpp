#include "tessel/core/parse_number.h"

#include <charconv>

#include "tessel/core/check.h"

namespace tessel {

int64_t parse_integer(std::string_view text, std::string_view what, int64_t min, int64_t max) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  // from_chars takes no '+' and no spaces, and says when the value does not fit.
  const auto [stop, ec] = std::from_chars(text.data(), end, v);
  TESSEL_CHECK(ec != std::errc::result_out_of_range, ConfigError,
               "{} is '{}', out of range; it must be a whole number from {} to {}", what, text, min,
               max);
  TESSEL_CHECK(!text.empty() && ec == std::errc() && stop == end, ConfigError,
               "{} is '{}', not a whole number; it must be one from {} to {}", what, text, min,
               max);
  TESSEL_CHECK(v >= min && v <= max, ConfigError, "{} is {}; it must be from {} to {}", what, v,
               min, max);
  return v;
}

}  // namespace tessel
