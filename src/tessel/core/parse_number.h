// One strict reading of a whole number from text (a flag, an environment variable, a control
// message): the whole text is the number -- no sign where none is allowed, no fraction, no
// trailing characters, no overflow -- and it lies within [min, max]. Anything else is a
// ConfigError naming `what` and the range, never a silent truncation ("2.5" is not 2).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tessel {

int64_t parse_integer(std::string_view text, std::string_view what, int64_t min, int64_t max);

}  // namespace tessel
