// A tokenizer.json as `tessel data prepare --tokenizer` reads it (data/bpe_tokenizer.h: the
// model, its vocabulary and merges, the added tokens and the pre-tokenizer recognised), then
// the input itself encoded and decoded with what loaded: any byte string must round-trip.
#include <string>

#include "fuzz_util.h"
#include "tessel/core/check.h"
#include "tessel/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel;
  const std::string text(fuzz::as_text(data, size));
  const auto path = fuzz::ScratchDir::get().write("tokenizer.json", text);
  fuzz::expect_only_tessel_errors([&] {
    const auto tokenizer = data::load_tokenizer(path);
    for (const std::string& s : {std::string("Hello world's  123!!\n<|endoftext|>x"), text}) {
      const auto ids = tokenizer->encode(s);
      const std::string back = tokenizer->decode(ids);
      TESSEL_CHECK(back == s, Error, "'{}' decodes to '{}'", s, back);
    }
  });
  return 0;
}
