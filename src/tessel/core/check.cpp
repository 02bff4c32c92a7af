#include "tessel/core/check.h"

#include <string_view>

namespace tessel::detail {

std::string where(const char* file, int line) {
  // Report paths from src/ on, so messages do not leak the build machine's layout.
  std::string_view path(file);
  if (auto pos = path.rfind("src/tessel/"); pos != std::string_view::npos)
    path.remove_prefix(pos + 4);
  return fmt::format("{}:{}", path, line);
}

}  // namespace tessel::detail
