// A token file as `tessel train` opens its data (data/token_source.h: the format chosen by the
// magic, then data/token_dataset.h: header, size, ids against the vocabulary and the checksum),
// and reads of its tokens.
#include <algorithm>
#include <vector>

#include "fuzz_util.h"
#include "tessel/data/token_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto path = fuzz::ScratchDir::get().write("input.tok", fuzz::as_text(data, size));
  for (const bool verify : {true, false})
    fuzz::expect_only_tessel_errors([&] {
      const auto source = data::open_token_source(path, {.verify = verify});
      const int64_t n = std::min<int64_t>(source->size(), 1 << 16);
      std::vector<int32_t> out(size_t(n) + 1);
      source->read(0, n, out.data());
      source->read(source->size() - n, n, out.data());
      (void)source->describe();
    });
  return 0;
}
