// A checkpoint's index.json (store/checkpoint_reader.cpp): files, tensors, dtypes, shapes, boxes,
// piece and chunk checksums and the tiling check, then box reads and a full verify driven by what
// the index claims. manifest.json is rewritten to match each input (its size and xxh3 of the
// index), so the index's own parsing is what gets exercised.
#include "checkpoint_fixture.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto& fixture = fuzz::CheckpointFixture::get();
  fixture.write_index(fuzz::as_text(data, size));
  fuzz::expect_only_tessel_errors([&] { fuzz::CheckpointFixture::read_all(fixture.dir); });
  return 0;
}
