// A sharded Hugging Face model's model.safetensors.index.json (checkpoint/hf_convert.h): the
// weight_map and its shard names, which must never leave the model's directory.
#include "fuzz_util.h"
#include "tessel/checkpoint/hf_convert.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  fuzz::expect_only_tessel_errors([&] {
    for (const auto& [tensor, file] :
         checkpoint::hf_index_weight_map(std::string(fuzz::as_text(data, size)), "index")) {
      // What open_weights joins to the model directory: one plain name.
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        __builtin_trap();
    }
  });
  return 0;
}
