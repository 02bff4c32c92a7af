// Checks that throw a typed tessel error carrying file, line and a formatted message.
//
//   TESSEL_CHECK(n % heads == 0, ConfigError, "n_embd {} is not divisible by n_head {}", n, heads);
//
// The condition is evaluated once; the message is formatted only on failure.
#pragma once

#include <fmt/format.h>

#include <string>

#include "tessel/core/error.h"

namespace tessel::detail {

std::string where(const char* file, int line);

template <typename E, typename... Args>
[[noreturn]] void fail(const char* file, int line, fmt::format_string<Args...> f, Args&&... args) {
  throw E(fmt::format(f, std::forward<Args>(args)...) + " [" + where(file, line) + "]");
}

}  // namespace tessel::detail

#define TESSEL_CHECK(cond, ErrorType, ...)                                          \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::tessel::detail::fail<::tessel::ErrorType>(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define TESSEL_THROW(ErrorType, ...) \
  ::tessel::detail::fail<::tessel::ErrorType>(__FILE__, __LINE__, __VA_ARGS__)
