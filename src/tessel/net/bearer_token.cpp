#include "tessel/net/bearer_token.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "tessel/core/check.h"

namespace tessel::net {

namespace {

constexpr size_t kMinTokenChars = 16;

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

}  // namespace

std::string read_token_file(const std::string& path, std::string_view what) {
  struct stat st {};
  TESSEL_CHECK(::stat(path.c_str(), &st) == 0, ConfigError, "{}: cannot read the token file {}: {}",
               what, path, std::strerror(errno));
  TESSEL_CHECK(S_ISREG(st.st_mode), ConfigError, "{}: the token file {} is not a regular file",
               what, path);
  TESSEL_CHECK((st.st_mode & (S_IRWXG | S_IRWXO)) == 0, ConfigError,
               "{}: the token file {} can be read or written by group or others (mode {:04o}); "
               "make it private with `chmod 600 {}`",
               what, path, st.st_mode & 07777, path);
  std::ifstream in(path, std::ios::binary);
  TESSEL_CHECK(in.good(), ConfigError, "{}: cannot open the token file {}: {}", what, path,
               std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  std::string token = text.str();
  while (!token.empty() && is_space(token.back())) token.pop_back();
  size_t first = 0;
  while (first < token.size() && is_space(token[first])) ++first;
  token.erase(0, first);
  TESSEL_CHECK(token.size() >= kMinTokenChars, ConfigError,
               "{}: the token in {} has {} characters, fewer than {}; write a random one, e.g. "
               "`head -c 32 /dev/urandom | base64 > {}`",
               what, path, token.size(), kMinTokenChars, path);
  for (char c : token) {
    TESSEL_CHECK(c > ' ' && c < 127, ConfigError,
                 "{}: the token in {} holds a space or a control or non-ASCII character, which "
                 "cannot go into an HTTP header; use printable ASCII only (e.g. base64)",
                 what, path);
  }
  return token;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is looked at, and the differences are only ever OR-ed
  // together, so the time depends on the lengths alone.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= unsigned(x ^ y);
  }
  // Through a volatile, so the compiler cannot turn the loop into an early-exit comparison.
  volatile unsigned result = diff;
  return result == 0;
}

std::optional<std::string_view> bearer_token(std::string_view authorization) {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size()) return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    const char c = authorization[i];
    if ((c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c) != kScheme[i]) return std::nullopt;
  }
  std::string_view token = authorization.substr(kScheme.size());
  while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
  while (!token.empty() && (token.back() == ' ' || token.back() == '\t')) token.remove_suffix(1);
  if (token.empty()) return std::nullopt;
  return token;
}

}  // namespace tessel::net
