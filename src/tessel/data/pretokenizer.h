// The pre-tokenizers of byte-level BPE tokenizers: a text is cut into pieces ("words") before
// BPE merges are applied inside each piece. Hugging Face tokenizers does this with a regex; there
// is no regex library with Unicode classes among tessel's dependencies, so each known pattern is
// a hand-written scanner that returns exactly the pieces the regex's successive matches give
// (leftmost, first alternative that matches, with the regex's backtracking).
//
// Character classes are those of unicode_class.h (\p{L}, \p{N}, \s = White_Space); an invalid
// UTF-8 byte is one character of neither class, so any byte string splits, and the pieces always
// concatenate back to the text.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

enum class PreTokenizerPattern {
  // GPT-2 (also the ByteLevel pre-tokenizer with use_regex: true):
  //   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // LLaMA-3 (a Split pre-tokenizer): case-insensitive contractions, a letter run may take one
  // leading non-letter non-newline character, numbers in groups of at most three digits, and
  // newlines end punctuation and whitespace runs:
  //   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  //   \s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
};

// The regex strings as they appear in tokenizer.json (after JSON unescaping).
extern const std::string_view kGpt2Regex;
extern const std::string_view kLlama3Regex;

// The pattern whose regex is exactly `regex`, if it is one of the known ones.
std::optional<PreTokenizerPattern> pattern_of_regex(std::string_view regex);

const char* pattern_name(PreTokenizerPattern pattern);

// The end (a byte offset > begin) of the piece that starts at byte `begin` < text.size().
size_t next_piece_end(PreTokenizerPattern pattern, std::string_view text, size_t begin);

// All pieces of `text`, in order (views into `text`).
std::vector<std::string_view> pretokenize(PreTokenizerPattern pattern, std::string_view text);

}  // namespace tessel::data
