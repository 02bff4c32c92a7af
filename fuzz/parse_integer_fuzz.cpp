// parse_integer (core/parse_number.h): the one reader of whole numbers from flags, environment
// variables and the coordinator's control socket ("scale N" reads N with it, in [1, 2^20]).
#include "fuzz_util.h"
#include "tessel/core/parse_number.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto text = fuzz::as_text(data, size);
  constexpr int64_t kRanges[][2] = {
      {1, 1 << 20}, {0, 100}, {INT64_MIN, INT64_MAX}, {-5, -1}, {INT64_MAX, INT64_MAX}};
  for (const auto& r : kRanges)
    fuzz::expect_only_tessel_errors([&] {
      const int64_t v = parse_integer(text, "the fuzzed number", r[0], r[1]);
      if (v < r[0] || v > r[1]) __builtin_trap();
    });
  return 0;
}
