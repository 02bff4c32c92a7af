// Logging goes through spdlog; this header only fixes tessel's logger setup in one place.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace tessel {

// Sets the global level from a name ("trace", "debug", "info", "warn", "error", "off").
// Throws ConfigError for an unknown name.
void set_log_level(const std::string& level);

}  // namespace tessel
