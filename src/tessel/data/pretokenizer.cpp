#include "tessel/data/pretokenizer.h"

#include "tessel/data/unicode_class.h"

namespace tessel::data {

const std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

bool is_newline(char32_t cp) {
  return cp == '\r' || cp == '\n';
}

// The end of the run of characters of class `cls` that starts at `pos` (pos if there is none).
size_t run_end(std::string_view s, size_t pos, CharClass cls) {
  while (pos < s.size()) {
    const Utf8Char c = utf8_char_at(s, pos);
    if (c.cls != cls) break;
    pos += c.length;
  }
  return pos;
}

CharClass class_at(std::string_view s, size_t pos) {
  return pos < s.size() ? utf8_char_at(s, pos).cls : CharClass::kSpace;  // end: no match
}

// 's|'t|'re|'ve|'m|'ll|'d at `pos` (s[pos] == '\''): the match's end, or 0. The alternatives
// begin with distinct letters, so their order does not matter. Case folding is ASCII only
// (Oniguruma would also fold U+017F LATIN SMALL LETTER LONG S to 's').
size_t contraction_end(std::string_view s, size_t pos, bool ignore_case) {
  auto letter = [&](size_t i) -> char {
    if (i >= s.size()) return 0;
    char c = s[i];
    if (ignore_case && c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    return c;
  };
  const char a = letter(pos + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return pos + 2;
  const char b = letter(pos + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return pos + 3;
  return 0;
}

struct SpaceRun {
  size_t end;                 // end of the white space run
  size_t last_start;          // start of its last character
  size_t after_last_newline;  // just past its last \r or \n, 0 when it has none
};

SpaceRun space_run(std::string_view s, size_t pos) {
  SpaceRun run{pos, pos, 0};
  while (run.end < s.size()) {
    const Utf8Char c = utf8_char_at(s, run.end);
    if (c.cls != CharClass::kSpace) break;
    run.last_start = run.end;
    run.end += c.length;
    if (is_newline(c.code_point)) run.after_last_newline = run.end;
  }
  return run;
}

// \s+(?!\S)|\s+ at `begin`, the start of `run`: the whole run when the text ends with it; else
// the run less its last character (which a following word may take as its leading space), unless
// that leaves nothing, when \s+ takes the one character.
size_t space_tail_end(std::string_view s, size_t begin, const SpaceRun& run) {
  if (run.end == s.size()) return run.end;
  if (run.last_start > begin) return run.last_start;
  return run.end;
}

size_t gpt2_piece_end(std::string_view s, size_t begin) {
  if (s[begin] == '\'') {
    if (size_t end = contraction_end(s, begin, false)) return end;
  }
  // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: with the optional space when there is one (without
  // it the space itself would have to be of the class, which it is not).
  const size_t first = s[begin] == ' ' ? begin + 1 : begin;
  const CharClass cls = class_at(s, first);
  if (cls != CharClass::kSpace) return run_end(s, first, cls);
  return space_tail_end(s, begin, space_run(s, begin));
}

size_t llama3_piece_end(std::string_view s, size_t begin) {
  if (s[begin] == '\'') {
    if (size_t end = contraction_end(s, begin, true)) return end;
  }
  const Utf8Char c0 = utf8_char_at(s, begin);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (c0.cls == CharClass::kLetter) return run_end(s, begin, CharClass::kLetter);
  if (c0.cls != CharClass::kNumber && !is_newline(c0.code_point)) {
    const size_t next = begin + c0.length;
    if (class_at(s, next) == CharClass::kLetter) return run_end(s, next, CharClass::kLetter);
  }
  // \p{N}{1,3}
  if (c0.cls == CharClass::kNumber) {
    size_t end = begin;
    for (int digits = 0; digits < 3 && end < s.size(); ++digits) {
      const Utf8Char c = utf8_char_at(s, end);
      if (c.cls != CharClass::kNumber) break;
      end += c.length;
    }
    return end;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  const size_t first = s[begin] == ' ' ? begin + 1 : begin;
  if (first < s.size() && class_at(s, first) == CharClass::kOther) {
    size_t end = run_end(s, first, CharClass::kOther);
    while (end < s.size() && (s[end] == '\r' || s[end] == '\n')) ++end;
    return end;
  }
  // What is left starts with white space. \s*[\r\n]+ backtracks to the run's last newline.
  const SpaceRun run = space_run(s, begin);
  if (run.after_last_newline != 0) return run.after_last_newline;
  return space_tail_end(s, begin, run);
}

}  // namespace

std::optional<PreTokenizerPattern> pattern_of_regex(std::string_view regex) {
  if (regex == kGpt2Regex) return PreTokenizerPattern::kGpt2;
  if (regex == kLlama3Regex) return PreTokenizerPattern::kLlama3;
  return std::nullopt;
}

const char* pattern_name(PreTokenizerPattern pattern) {
  switch (pattern) {
    case PreTokenizerPattern::kGpt2:
      return "GPT-2";
    case PreTokenizerPattern::kLlama3:
      return "LLaMA-3";
  }
  return "?";
}

size_t next_piece_end(PreTokenizerPattern pattern, std::string_view text, size_t begin) {
  return pattern == PreTokenizerPattern::kGpt2 ? gpt2_piece_end(text, begin)
                                               : llama3_piece_end(text, begin);
}

std::vector<std::string_view> pretokenize(PreTokenizerPattern pattern, std::string_view text) {
  std::vector<std::string_view> pieces;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = next_piece_end(pattern, text, begin);
    pieces.push_back(text.substr(begin, end - begin));
    begin = end;
  }
  return pieces;
}

}  // namespace tessel::data
