#include "tessel/comm/control_store.h"

#include <charconv>

#include "tessel/core/check.h"

namespace tessel::comm {

int64_t parse_counter(const std::string& key, const std::string& value) {
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  TESSEL_CHECK(ec == std::errc() && end == value.data() + value.size(), CorruptDataError,
               "control store: key '{}' holds '{}', not a counter", key, value);
  return n;
}

}  // namespace tessel::comm
