#include "tessel/testing/testing.h"

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>

namespace tessel::testing {

TempDir::TempDir() {
  std::random_device rd;
  auto base = std::filesystem::temp_directory_path();
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto candidate = base / ("tessel-test-" + std::to_string(rd()) + std::to_string(attempt));
    if (std::filesystem::create_directory(candidate)) {
      path_ = candidate;
      return;
    }
  }
  throw std::runtime_error("cannot create a temporary directory");
}

TempDir::~TempDir() {
  // TESSEL_KEEP_TEMP=1 keeps test directories for a post-mortem (their paths are in the logs).
  if (const char* keep = std::getenv("TESSEL_KEEP_TEMP"); keep != nullptr && *keep == '1') return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::filesystem::path source_path(const std::string& relative) {
#ifdef TESSEL_SOURCE_DIR
  return std::filesystem::path(TESSEL_SOURCE_DIR) / relative;
#else
  return std::filesystem::path(relative);
#endif
}

std::filesystem::path tessel_binary() {
  if (const char* bin = std::getenv("TESSEL_BIN")) return bin;
#ifdef TESSEL_BINARY_DIR
  return std::filesystem::path(TESSEL_BINARY_DIR) / "tessel";
#else
  return "tessel";
#endif
}

double max_rel_error(std::span<const float> a, std::span<const float> b, double floor) {
  if (a.size() != b.size()) throw std::invalid_argument("max_rel_error: size mismatch");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = std::fabs(double(a[i]) - double(b[i]));
    double scale = std::max(std::fabs(double(b[i])), floor);
    if (!(d / scale <= worst)) worst = std::isnan(d) ? INFINITY : d / scale;
  }
  return worst;
}

double max_rel_error_rms(std::span<const float> a, std::span<const float> b) {
  double ss = 0;
  for (float x : b) ss += double(x) * x;
  const double rms = b.empty() ? 0.0 : std::sqrt(ss / double(b.size()));
  return max_rel_error(a, b, std::max(rms, 1e-30));
}

double max_abs_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) throw std::invalid_argument("max_abs_error: size mismatch");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
  }
  return worst;
}

int run_command(const std::string& command, std::string* output) {
  std::string full = command + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) throw std::runtime_error("popen failed: " + command);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) {
    if (output) output->append(buf.data(), n);
  }
  int status = pclose(pipe);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace tessel::testing
