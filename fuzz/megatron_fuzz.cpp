// A Megatron-LM .bin/.idx pair (data/megatron_dataset.h): the index header, its tables against
// the .bin, the token scan, and reads across sequences.
// Input: u16 little-endian length L, then L bytes of prefix.bin (fewer when the input ends), then
// prefix.idx.
#include <algorithm>
#include <vector>

#include "fuzz_util.h"
#include "tessel/data/megatron_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  if (size < 2) return 0;
  const auto input = fuzz::as_text(data + 2, size - 2);
  const size_t bin_len = std::min<size_t>(size_t(data[0]) | size_t(data[1]) << 8, input.size());
  const auto& dir = fuzz::ScratchDir::get();
  dir.write("input.bin", input.substr(0, bin_len));
  dir.write("input.idx", input.substr(bin_len));
  const std::string prefix = dir.path() + "/input";
  // Inferred vocabulary (a scan), a given one checked by a scan, and a given one unchecked (so
  // reads meet the ids out of range themselves).
  const data::TokenSourceOptions options[] = {{.verify = true, .vocab_size = 0},
                                              {.verify = true, .vocab_size = 300},
                                              {.verify = false, .vocab_size = 300}};
  for (const auto& o : options)
    fuzz::expect_only_tessel_errors([&] {
      const auto ds = data::MegatronDataset::open(prefix, o);
      const int64_t n = std::min<int64_t>(ds->size(), 1 << 16);
      std::vector<int32_t> out(size_t(n) + 1);
      ds->read(0, n, out.data());
      ds->read(ds->size() - n, n, out.data());
      if (ds->size() > 2) ds->read(ds->size() / 2 - 1, 2, out.data());
      (void)ds->describe();
    });
  return 0;
}
