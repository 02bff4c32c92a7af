// Tokenizers and the `tessel data prepare` pipeline.
//
// A Tokenizer turns text into token ids and back. Three kinds:
//   * ByteTokenizer (here): id = byte value, EOT = 256, vocab 257; any byte string round-trips.
//     The tokenizer of choice for demos and tests that must not depend on a downloaded vocabulary.
//   * BpeTokenizer (bpe_tokenizer.h): byte-level BPE from a Hugging Face tokenizer.json (GPT-2,
//     LLaMA-3).
//   * SentencePieceTokenizer (sentencepiece_tokenizer.h): a SentencePiece .model (LLaMA-1/2, T5,
//     ...).
// load_tokenizer() picks one from a path.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

// Every method is safe to call from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of `text`; no BOS or EOS is added.
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // The text of `ids`. Throws InvalidArgumentError naming the id and its position for an id that
  // is not in the vocabulary.
  virtual std::string decode(std::span<const uint32_t> ids) const = 0;
  // Every id encode() returns is < vocab_size().
  virtual uint64_t vocab_size() const = 0;
  // The document separator (GPT-2 <|endoftext|>, LLaMA </s> or <|end_of_text|>, a SentencePiece
  // model's eos id), if the tokenizer has one.
  virtual std::optional<uint32_t> eot() const = 0;
  // The id prepended to each document when the model family uses one (LLaMA, SentencePiece);
  // none for GPT-2.
  virtual std::optional<uint32_t> bos() const = 0;
  // One line for people, e.g. "byte-level BPE from tok.json (vocab 50257)".
  virtual std::string describe() const = 0;

  // Where a document may be cut into parts that are encoded separately: the largest p <=
  // text.size() such that, whatever text follows `text` in the document, encoding text[0, p)
  // and the rest separately gives the ids of encoding them together; 0 when no such cut is
  // known. Lets prepare_dataset() stream a large document instead of reading it whole.
  virtual size_t safe_cut(std::string_view text) const { return 0; }
};

class ByteTokenizer : public Tokenizer {
 public:
  static constexpr uint32_t kEot = 256;
  static constexpr uint64_t kVocabSize = 257;
  // How decode() renders EOT (GPT-2's spelling).
  static constexpr std::string_view kEotText = "<|endoftext|>";

  std::vector<uint32_t> encode(std::string_view text) const override;
  // Bytes back to text; EOT becomes kEotText. Throws InvalidArgumentError naming the id and its
  // position for an id outside [0, 257).
  std::string decode(std::span<const uint32_t> ids) const override;
  // The same for ids as token sources read them (TokenSource::read).
  std::string decode(std::span<const int32_t> ids) const;
  uint64_t vocab_size() const override { return kVocabSize; }
  std::optional<uint32_t> eot() const override { return kEot; }
  std::optional<uint32_t> bos() const override { return std::nullopt; }
  std::string describe() const override;
  size_t safe_cut(std::string_view text) const override { return text.size(); }
};

// Chooses the tokenizer for `path`:
//   ""                      -> ByteTokenizer;
//   a path ending in .json  -> byte-level BPE from a Hugging Face tokenizer.json;
//   a path ending in .model -> SentencePiece;
//   a directory             -> its tokenizer.json, else its tokenizer.model.
// Throws IoError naming the path when it does not exist, is unreadable, or is a directory with
// neither file; ConfigError for another file name; and what the loaders throw (CorruptDataError
// for a damaged file, UnsupportedError for a tokenizer kind tessel does not implement), each
// naming the file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

struct PrepareStats {
  int64_t documents = 0;
  int64_t bytes = 0;   // text bytes read
  int64_t tokens = 0;  // all tokens written: the documents', one BOS each (if the tokenizer has
                       // one), and one EOT between consecutive documents (if it has one)
  uint64_t vocab_size = 0;
  int token_width = 0;  // bytes per token in the file: 2 when vocab_size <= 65536, else 4
  // Unigram entropy of the token ids of the documents' text (BOS and separating EOTs excluded):
  // the loss, per token, of a model that ignores context. A trained model should get below it.
  double entropy_bits = 0.0;
  double entropy_nats = 0.0;
};

// Reads each input file as one document, tokenizes it, puts the tokenizer's BOS (if any) before
// each document and its EOT (if any) between consecutive documents, and writes a tessel token
// file with the tokenizer's vocab size at `output` (atomically; uint16 tokens when the vocab fits,
// else uint32). Throws InvalidArgumentError for an empty input list, IoError naming an input that
// is missing or unreadable (nothing is written then) or an output that cannot be written.
PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output,
                             const Tokenizer& tokenizer);
// The same with the ByteTokenizer: a uint16 file with vocab 257, the bytes of each document, EOT
// between documents.
PrepareStats prepare_dataset(const std::vector<std::string>& inputs, const std::string& output);

// Entropy of the distribution given by counts, in bits (0 for an empty or one-symbol input).
double entropy_bits(std::span<const int64_t> counts);

}  // namespace tessel::data
