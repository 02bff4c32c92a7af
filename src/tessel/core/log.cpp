#include "tessel/core/log.h"

#include "tessel/core/check.h"

namespace tessel {

void set_log_level(const std::string& level) {
  auto parsed = spdlog::level::from_str(level);
  TESSEL_CHECK(parsed != spdlog::level::off || level == "off", ConfigError,
               "unknown log level '{}' (use trace, debug, info, warn, error or off)", level);
  spdlog::set_level(parsed);
}

}  // namespace tessel
