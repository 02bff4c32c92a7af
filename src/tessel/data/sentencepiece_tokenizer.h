// SentencePiece models (*.model: LLaMA-1/2, Mistral, T5, ...) through the SentencePiece library.
// Encoding and decoding are the library's, so ids equal what `spm_encode --output_format=id`
// gives for the same model and text.
#pragma once

#include <memory>
#include <string>

#include "tessel/data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}  // namespace sentencepiece

namespace tessel::data {

class SentencePieceTokenizer : public Tokenizer {
 public:
  // Loads `path`. Throws IoError when it is missing or not a regular file, CorruptDataError
  // naming the file and the library's reason when it is not a SentencePiece model.
  static std::unique_ptr<SentencePieceTokenizer> load(const std::string& path);
  ~SentencePieceTokenizer() override;

  // Throws InvalidArgumentError with the library's reason if it cannot encode the text.
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  uint64_t vocab_size() const override;
  // The model's eos and bos ids (absent when the model disables them, id -1).
  std::optional<uint32_t> eot() const override;
  std::optional<uint32_t> bos() const override;
  std::string describe() const override;
  // No safe cut: the model adds a dummy prefix at the start of every text it encodes, so a
  // document is encoded whole.

 private:
  SentencePieceTokenizer();

  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

}  // namespace tessel::data
