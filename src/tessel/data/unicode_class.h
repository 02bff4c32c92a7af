// UTF-8 decoding and the Unicode character classes that the GPT-2 and LLaMA-3 pre-tokenizer
// regexes test: \p{L} (letters), \p{N} (numbers) and \s (white space).
//
// Letters are the general categories Lu, Ll, Lt, Lm and Lo; numbers Nd, Nl and No; both are
// exact tables for Unicode 14.0 (generated from Python 3.11's unicodedata, see
// unicode_class.cpp). White space is Unicode's White_Space property (what Oniguruma, the regex
// engine of Hugging Face tokenizers, matches with \s): U+0009..U+000D, U+0020, U+0085, U+00A0,
// U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F and U+3000.
//
// Text read from files need not be valid UTF-8. A byte that does not start a well-formed UTF-8
// sequence (a stray continuation byte, an overlong form, a surrogate, a truncated sequence, a
// code point above U+10FFFF) is taken as one character of class kOther, so every byte string
// splits into characters and byte-level tokenizers still round-trip it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tessel::data {

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

// The class of one code point (any value; above U+10FFFF is kOther).
CharClass char_class(char32_t cp);

struct Utf8Char {
  char32_t code_point;  // U+FFFD for an invalid byte
  uint8_t length;       // bytes, 1..4
  CharClass cls;
};

// The character starting at byte `pos` (< text.size()) of `text`.
Utf8Char utf8_char_at(std::string_view text, size_t pos);

// Appends the UTF-8 encoding of `cp` (<= U+10FFFF) to `out`.
void append_utf8(char32_t cp, std::string& out);

}  // namespace tessel::data
