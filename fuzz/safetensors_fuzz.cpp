// The safetensors reader (store/safetensors.h): header length, JSON header, dtypes, shapes,
// offsets and tiling, then reads of every tensor and of a box of each, as a checkpoint load or
// `tessel convert` would.
#include <algorithm>
#include <vector>

#include "fuzz_util.h"
#include "tessel/store/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto path = fuzz::ScratchDir::get().write("input.safetensors", fuzz::as_text(data, size));
  fuzz::expect_only_tessel_errors([&] {
    const auto reader = store::SafetensorsReader::open(path);
    std::vector<char> buf;
    for (const auto& t : reader.tensors()) {
      // The data of a valid header lies inside the file, so it is no larger than the input.
      buf.resize(t.nbytes);
      reader.read(t.name, buf.data());
      if (t.shape.rank() == 0 || t.shape[0] == 0) continue;
      std::vector<int64_t> lo(t.shape.rank(), 0), hi = t.shape.dims();
      lo[0] = t.shape[0] / 2;
      reader.read_box(t.name, Box(lo, hi), buf.data());
    }
  });
  return 0;
}
