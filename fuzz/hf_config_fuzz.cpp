// A Hugging Face config.json as `tessel convert` reads it (core/json_file.h, then
// config::model_config_from_hf), and the config.json export writes from it as a base.
#include "fuzz_util.h"
#include "tessel/config/hf_model_config.h"
#include "tessel/core/json_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto path = fuzz::ScratchDir::get().write("config.json", fuzz::as_text(data, size));
  fuzz::expect_only_tessel_errors([&] {
    const nlohmann::json config = read_json_file(path);
    const auto model = config::model_config_from_hf(config, "fuzz");
    config::hf_config_from_model(model, DType::bf16, config);
  });
  return 0;
}
