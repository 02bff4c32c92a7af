// tessel's built-in byte-level tokenizer and the `tessel data prepare` pipeline.
//
// Token id = byte value (0..255); EOT = 256 separates documents. Vocab size 257. Any byte string
// round-trips exactly, which makes it the tokenizer of choice for demos and tests that must not
// depend on a downloaded vocabulary.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

class ByteTokenizer {
 public:
  static constexpr uint32_t kEot = 256;
  static constexpr uint64_t kVocabSize = 257;
  // How decode() renders EOT (GPT-2's spelling).
  static constexpr std::string_view kEotText = "<|endoftext|>";

  static std::vector<uint32_t> encode(std::string_view text);
  // Bytes back to text; EOT becomes kEotText. Throws InvalidArgumentError naming the id and its
  // position for an id outside [0, 257).
  static std::string decode(std::span<const uint32_t> tokens);
  static std::string decode(std::span<const int32_t> tokens);
};

struct PrepareStats {
  int64_t documents = 0;
  int64_t bytes = 0;   // text bytes read
  int64_t tokens = 0;  // bytes + one EOT between consecutive documents
  // Unigram entropy of the byte distribution over all documents (EOTs excluded): the loss, per
  // token, of a model that ignores context. A trained model should get below it.
  double entropy_bits = 0.0;
  double entropy_nats = 0.0;
};

// Reads each input file as one document (bytes as-is), joins them with EOT and writes a uint16
// tessel token file with vocab 257 at `output` (atomically). Throws InvalidArgumentError for an
// empty input list, IoError naming an input that is missing or unreadable (nothing is written
// then) or an output that cannot be written.
PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output);

// Entropy of the distribution given by counts, in bits (0 for an empty or one-symbol input).
double entropy_bits(std::span<const int64_t> counts);

}  // namespace tessel::data
