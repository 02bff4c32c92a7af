// Byte-level BPE tokenizers read from a Hugging Face tokenizer.json (GPT-2, GPT-NeoX, LLaMA-3).
//
// Encoding follows Hugging Face tokenizers:
//   1. added tokens (added_tokens: <|endoftext|>, <|begin_of_text|>, ...) are found literally in
//      the text, leftmost first and the longest at a position, and become their ids;
//   2. the text between them is cut into pieces by the pre-tokenizer's regex (pretokenizer.h:
//      GPT-2's or LLaMA-3's, recognised from the file);
//   3. each piece's bytes become the byte-level alphabet (GPT-2's bytes_to_unicode: printable
//      Latin-1 bytes stand for themselves, the other 68 bytes for U+0100..U+0143), one token per
//      byte, and merges are applied lowest rank first (ties: leftmost first) -- unless the model
//      has ignore_merges (LLaMA-3) and the whole piece is a token of the vocabulary.
// Decoding maps each token's characters back to bytes; a token with a character outside the
// byte alphabet (an added token such as "<|im start|>") contributes its UTF-8 text, as Hugging
// Face's ByteLevel decoder does. Any byte string round-trips: decode(encode(x)) == x (text that
// contains an added token's spelling comes back with that spelling).
//
// Not supported, each an UnsupportedError naming the file: model types other than BPE, a
// normalizer, another pre-tokenizer regex, ByteLevel add_prefix_space, continuing_subword_prefix
// or end_of_word_suffix, and byte_fallback (SentencePiece-style BPE files such as LLaMA-2's
// tokenizer.json: use its tokenizer.model). Ignored: the decoder and post-processor sections
// (except that a TemplateProcessing that starts with a special token names the BOS), dropout
// (training-time randomness), and the added tokens' lstrip/rstrip/single_word flags.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessel/data/pretokenizer.h"
#include "tessel/data/tokenizer.h"

namespace tessel::data {

class BpeTokenizer : public Tokenizer {
 public:
  // Reads `path`. Throws IoError when it is missing or unreadable, CorruptDataError when it is
  // not JSON or not a well-formed tokenizer.json (e.g. a merge of tokens that are not in the
  // vocabulary), UnsupportedError as above; each message names the file.
  static std::unique_ptr<BpeTokenizer> load(const std::string& path);

  // Throws InvalidArgumentError when the text has a byte whose byte-level token is not in the
  // vocabulary and the model has no unk_token.
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const uint32_t> ids) const override;
  uint64_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> eot() const override { return eot_; }
  std::optional<uint32_t> bos() const override { return bos_; }
  std::string describe() const override;
  // After a '\n' between two printable ASCII characters (when no added token contains '\n'):
  // both known patterns end a piece there and start the next one at the character after it.
  size_t safe_cut(std::string_view text) const override;

  PreTokenizerPattern pattern() const { return pattern_; }
  size_t merge_count() const { return merges_.size(); }
  // The id of a vocabulary entry (in the byte-level alphabet, e.g. "Ġthe") or of an added token.
  std::optional<uint32_t> token_id(std::string_view token) const;

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using StringMap = std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>>;
  struct Merge {
    uint32_t rank;
    uint32_t id;  // of the merged token
  };
  struct AddedToken {
    std::string content;
    uint32_t id;
  };

  BpeTokenizer() = default;
  void encode_piece(std::string_view piece, std::vector<uint32_t>& ids) const;
  void merge_piece(std::string_view piece, std::vector<uint32_t>& ids) const;
  // The added token that starts at text[pos], the longest if several do.
  const AddedToken* added_token_at(std::string_view text, size_t pos) const;

  std::string path_;
  PreTokenizerPattern pattern_ = PreTokenizerPattern::kGpt2;
  bool ignore_merges_ = false;
  StringMap vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: left id << 32 | right id
  std::array<int64_t, 256> byte_token_{};       // the id of each byte's one-character token, or -1
  std::array<std::string, 256> byte_symbol_;    // each byte's character in the byte alphabet
  std::optional<uint32_t> unk_;
  std::vector<AddedToken> added_;
  std::array<std::vector<uint32_t>, 256>
      added_by_first_byte_;  // indices into added_, longest first
  bool added_token_has_newline_ = false;
  std::vector<std::string> id_bytes_;  // what decode() writes for each id
  std::vector<bool> id_known_;
  uint64_t vocab_size_ = 0;
  std::optional<uint32_t> eot_, bos_;

  // Pieces recur (" the", " and"): their ids are kept, up to kCacheLimit pieces of at most
  // kCachedPieceBytes (a long run of letters or white space is rare and would only take memory).
  static constexpr size_t kCacheLimit = 1 << 18;
  static constexpr size_t kCachedPieceBytes = 256;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>>
      cache_;
};

// GPT-2's bytes_to_unicode(): the character that stands for each byte in byte-level vocabularies.
char32_t byte_level_char(uint8_t byte);

}  // namespace tessel::data
