// A checkpoint's manifest.json (store/checkpoint_reader.cpp): format, version, its checksum, meta
// and the reference to the index. An input that is a JSON object gets its "checksum" made right
// (else nearly every input would stop there); other inputs are written as they are.
#include "checkpoint_fixture.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const auto& fixture = fuzz::CheckpointFixture::get();
  fuzz::ScratchDir::get().write("checkpoint/index.json", fixture.index_text);
  auto m = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (m.is_object())
    fixture.write_manifest(std::move(m));
  else
    fuzz::ScratchDir::get().write("checkpoint/manifest.json", fuzz::as_text(data, size));
  fuzz::expect_only_tessel_errors([&] {
    fuzz::CheckpointFixture::read_all(fixture.dir);
    (void)store::CheckpointReader(fixture.dir).meta();
  });
  return 0;
}
