// The training config: TrainConfig from YAML text (config/train_config.h), with YamlSection's
// strict keys, types and duplicate checks and the validation that follows. Relative paths in the
// config resolve inside the scratch directory, where no plan file exists.
#include "fuzz_util.h"
#include "tessel/config/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const std::string path = fuzz::ScratchDir::get().path() + "/config.yaml";
  fuzz::expect_only_tessel_errors(
      [&] { config::TrainConfig::parse(std::string(fuzz::as_text(data, size)), path); });
  return 0;
}
