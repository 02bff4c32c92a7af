// Helpers shared by tessel's tests: temporary directories, paths to sources, numeric comparison.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace tessel::testing {

// A fresh directory removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Absolute path of a file in the source tree, e.g. source_path("examples/tiny.yaml").
std::filesystem::path source_path(const std::string& relative);

// Path of the built `tessel` executable: $TESSEL_BIN when set, else the one in the build tree.
std::filesystem::path tessel_binary();

// Largest |a - b| over the two arrays (sizes must match).
double max_abs_error(std::span<const float> a, std::span<const float> b);

// |x| element by element: run a reference kernel on absolute values to get, for each result, the
// sum of the magnitudes of the terms it adds up (what its rounding error scales with).
std::vector<float> absolute(std::span<const float> x);

// Compares element by element against bounds derived from the arithmetic (rounding.h): succeeds
// when every |actual_i - expected_i| <= bound_i (equal elements pass a zero bound; a NaN on either
// side fails), else names the worst element, its values, and how many elements exceed. With
// TESSEL_REPORT_MARGINS=1 in the environment it prints every comparison's worst |diff| / bound to
// stderr (labelled with the test and `what`): how close another CPU's rounding came.
::testing::AssertionResult within_bounds(std::span<const float> actual,
                                         std::span<const float> expected,
                                         std::span<const double> bound, const char* what = "");
// The same for one value.
::testing::AssertionResult within_bound(double actual, double expected, double bound,
                                        const char* what = "");

// The message of the E that f() throws. Another exception, or none, is a test failure (and "").
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected another exception; got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception; none was thrown";
  return "";
}

// Runs a shell command, returns its exit status and captures stdout+stderr into *output.
int run_command(const std::string& command, std::string* output);

}  // namespace tessel::testing
