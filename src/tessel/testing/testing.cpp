#include "tessel/testing/testing.h"

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>

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

double max_abs_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) throw std::invalid_argument("max_abs_error: size mismatch");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
  }
  return worst;
}

std::vector<float> absolute(std::span<const float> x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = std::fabs(x[i]);
  return r;
}

namespace {

void report_margin(double worst, size_t index, size_t count, const char* what) {
  static const bool enabled = [] {
    const char* env = std::getenv("TESSEL_REPORT_MARGINS");
    return env != nullptr && *env == '1';
  }();
  if (!enabled) return;
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::fprintf(
      stderr, "margin %-50s %-16s worst |diff|/bound %.3g (element %zu of %zu)\n",
      test != nullptr ? (std::string(test->test_suite_name()) + "." + test->name()).c_str() : "?",
      what, worst, index, count);
}

}  // namespace

::testing::AssertionResult within_bounds(std::span<const float> actual,
                                         std::span<const float> expected,
                                         std::span<const double> bound, const char* what) {
  if (actual.size() != expected.size() || bound.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": sizes differ (" << actual.size() << " values, " << expected.size()
           << " expected, " << bound.size() << " bounds)";
  }
  size_t beyond = 0, worst_index = 0;
  double worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double diff = std::fabs(double(actual[i]) - double(expected[i]));
    double ratio = 0;
    if (std::isnan(diff)) {
      ratio = INFINITY;
    } else if (diff > 0) {
      ratio = bound[i] > 0 ? diff / bound[i] : INFINITY;
    }
    if (ratio > 1) ++beyond;
    if (ratio > worst) worst = ratio, worst_index = i;
  }
  report_margin(worst, worst_index, actual.size(), what);
  if (beyond == 0) return ::testing::AssertionSuccess();
  const size_t i = worst_index;
  return ::testing::AssertionFailure()
         << what << ": " << beyond << " of " << actual.size()
         << " elements exceed their bound; worst is element " << i << ": " << actual[i] << " vs "
         << expected[i] << ", |difference| " << std::fabs(double(actual[i]) - double(expected[i]))
         << " = " << worst << " times its bound " << bound[i];
}

::testing::AssertionResult within_bound(double actual, double expected, double bound,
                                        const char* what) {
  const double diff = std::fabs(actual - expected);
  const double ratio = diff == 0 ? 0.0 : (bound > 0 ? diff / bound : INFINITY);
  report_margin(std::isnan(diff) ? INFINITY : ratio, 0, 1, what);
  if (diff <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << actual << " vs " << expected << ", |difference| " << diff << " = "
         << ratio << " times its bound " << bound;
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
