#include "tessel/data/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include "tessel/core/check.h"

namespace tessel::data {

SentencePieceTokenizer::SentencePieceTokenizer()
    : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::load(const std::string& path) {
  TESSEL_CHECK(std::filesystem::is_regular_file(path), IoError,
               "SentencePiece model '{}' does not exist or is not a regular file; check the path",
               path);
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
  t->path_ = path;
  const auto status = t->processor_->Load(path);
  TESSEL_CHECK(status.ok(), CorruptDataError,
               "'{}' is not a SentencePiece model the library can load ({}); pass the model's "
               "tokenizer.model file",
               path, status.ToString());
  TESSEL_CHECK(t->processor_->GetPieceSize() > 0, CorruptDataError,
               "SentencePiece model '{}' has no pieces", path);
  return t;
}

std::vector<uint32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  TESSEL_CHECK(status.ok(), InvalidArgumentError,
               "SentencePiece model '{}' cannot encode a text of {} bytes: {}", path_, text.size(),
               status.ToString());
  return std::vector<uint32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(std::span<const uint32_t> ids) const {
  const uint64_t size = vocab_size();
  std::vector<int> as_int(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    TESSEL_CHECK(ids[i] < size, InvalidArgumentError,
                 "token id {} at position {} is not in the vocabulary of SentencePiece model "
                 "'{}' (vocab size {})",
                 ids[i], i, path_, size);
    as_int[i] = static_cast<int>(ids[i]);
  }
  std::string text;
  const auto status = processor_->Decode(as_int, &text);
  TESSEL_CHECK(status.ok(), InvalidArgumentError, "SentencePiece model '{}' cannot decode: {}",
               path_, status.ToString());
  return text;
}

uint64_t SentencePieceTokenizer::vocab_size() const {
  return static_cast<uint64_t>(processor_->GetPieceSize());
}

std::optional<uint32_t> SentencePieceTokenizer::eot() const {
  const int id = processor_->eos_id();
  if (id < 0) return std::nullopt;
  return static_cast<uint32_t>(id);
}

std::optional<uint32_t> SentencePieceTokenizer::bos() const {
  const int id = processor_->bos_id();
  if (id < 0) return std::nullopt;
  return static_cast<uint32_t>(id);
}

std::string SentencePieceTokenizer::describe() const {
  std::string special;
  if (auto id = eot()) special += fmt::format(", EOS {} = {}", processor_->IdToPiece(*id), *id);
  if (auto id = bos()) special += fmt::format(", BOS {} = {}", processor_->IdToPiece(*id), *id);
  return fmt::format("SentencePiece model {} (vocab {}{})", path_, vocab_size(), special);
}

}  // namespace tessel::data
