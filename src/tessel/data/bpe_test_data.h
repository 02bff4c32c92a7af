// Two small byte-level BPE tokenizer.json files for tests (the BPE tokenizer's, `tessel data
// prepare`'s): GPT-2 style and LLaMA-3 style, over one 256-byte alphabet and 15 merges, with the
// ids each step produces worked out in the comments.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace tessel::data::testing {

// GPT-2's bytes_to_unicode() as openai/gpt-2's encoder.py defines it: bs lists the printable
// bytes '!'..'~', '¡'..'¬', '®'..'ÿ' (each its own character), then the 68 others in byte order,
// which become U+0100, U+0101, ... GPT-2's first 256 ids follow that order, and so do ours:
//   '!' = 0, ..., 'a' = 'a' - 33 = 64, ..., 0x00 = 188, '\n' = 198, ' ' = 220, 0x7f = 221,
//   0xad = 255 (the last of the others), 0xff = 187.
inline std::vector<std::pair<int, char32_t>> gpt2_byte_order() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<std::pair<int, char32_t>> order;
  for (int b : bs) order.emplace_back(b, char32_t(b));
  char32_t next = 0x100;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) order.emplace_back(b, next++);
  }
  return order;
}

inline std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += char(c);
  } else {  // every byte-level character is < U+0800
    s += char(0xC0 | (c >> 6));
    s += char(0x80 | (c & 0x3F));
  }
  return s;
}

// `"<char>": id` for the 256 byte tokens, ids in GPT-2's order.
inline std::string byte_vocab() {
  std::string out;
  const auto order = gpt2_byte_order();
  for (size_t id = 0; id < order.size(); ++id) {
    std::string c = utf8(order[id].second);
    if (c == "\"" || c == "\\") c = "\\" + c;
    out += "\"" + c + "\": " + std::to_string(id) + ", ";
  }
  return out;
}

// Byte ids used below (GPT-2's, see gpt2_byte_order): ' '=220 '!'=0 "'"=6 '1'=16 '2'=17
// '3'=18 '4'=19 '5'=20 'E'=36 'H'=39 'd'=67 'e'=68 'h'=71 'l'=75 'o'=78 'r'=81 's'=82 'w'=86.
//
// Merges, by rank, and the ids of the tokens they make:
//   0 h e -> he 256        5 o r -> or 261          10 Ġ 1 -> Ġ1 266
//   1 l l -> ll 257        6 Ġw or -> Ġwor 262      11 2 3 -> 23 267
//   2 he ll -> hell 258    7 l d -> ld 263          12 Ġ1 23 -> Ġ123 268
//   3 hell o -> hello 259  8 Ġwor ld -> Ġworld 264  13 ! ! -> !! 269
//   4 Ġ w -> Ġw 260        9 ' s -> 's 265          14 e l -> el 270
inline constexpr const char* kMergedVocab =
    R"("he": 256, "ll": 257, "hell": 258, "hello": 259, "Ġw": 260, "or": 261, "Ġwor": 262,
       "ld": 263, "Ġworld": 264, "'s": 265, "Ġ1": 266, "23": 267, "Ġ123": 268, "!!": 269,
       "el": 270)";
inline constexpr const char* kMergeStrings =
    R"(["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "' s", "Ġ 1",
       "2 3", "Ġ1 23", "! !", "e l"])";
// The same merges in the newer form.
inline constexpr const char* kMergeArrays =
    R"([["h", "e"], ["l", "l"], ["he", "ll"], ["hell", "o"], ["Ġ", "w"], ["o", "r"],
       ["Ġw", "or"], ["l", "d"], ["Ġwor", "ld"], ["'", "s"], ["Ġ", "1"], ["2", "3"],
       ["Ġ1", "23"], ["!", "!"], ["e", "l"]])";

// GPT-2 style: ByteLevel pre-tokenizer with its regex, <|endoftext|> = 271 both in the
// vocabulary and an added token (as in GPT-2's own file), no BOS.
inline std::string gpt2_json() {
  return R"({
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 271, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": true, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                     "use_regex": true},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "vocab": {)" +
         byte_vocab() + kMergedVocab + R"(, "<|endoftext|>": 271},
            "merges": )" +
         kMergeStrings + "}}";
}

// LLaMA-3 style: Split by LLaMA-3's regex then ByteLevel without one, ignore_merges, merges as
// arrays, added tokens outside the model vocabulary, a template that starts with BOS. "ello" (271)
// is a vocabulary entry no merge makes: with ignore_merges the piece "ello" is that one token.
inline std::string llama3_json(bool ignore_merges = true) {
  return R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 272, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true},
    {"id": 273, "content": "<|end_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
  "post_processor": {"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
    {"type": "TemplateProcessing",
     "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}],
     "pair": [],
     "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [272],
                                               "tokens": ["<|begin_of_text|>"]}}}]},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": )" +
         std::string(ignore_merges ? "true" : "false") + R"(,
            "vocab": {)" +
         byte_vocab() + kMergedVocab + R"(, "ello": 271},
            "merges": )" +
         kMergeArrays + "}}";
}

}  // namespace tessel::data::testing
