#include "tessel/data/bpe_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <queue>

#include "tessel/core/check.h"
#include "tessel/core/json_file.h"
#include "tessel/data/token_dataset.h"
#include "tessel/data/unicode_class.h"

namespace tessel::data {

using nlohmann::json;

char32_t byte_level_char(uint8_t byte) {
  // Printable Latin-1 stands for itself; the remaining bytes (controls, space, DEL, the C1
  // controls, NBSP and the soft hyphen) take U+0100 upwards in byte order.
  auto printable = [](unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  if (printable(byte)) return byte;
  char32_t next = 0x100;
  for (unsigned b = 0; b < byte; ++b) next += !printable(b);
  return next;
}

namespace {

constexpr std::string_view kSupported =
    "tessel reads byte-level BPE tokenizer.json files (GPT-2, LLaMA-3 style) and SentencePiece "
    ".model files";

// Token strings that mark the end of a document, most specific first.
constexpr std::string_view kEotNames[] = {"<|endoftext|>", "<|end_of_text|>", "</s>"};

uint64_t merge_key(uint32_t left, uint32_t right) {
  return (uint64_t{left} << 32) | right;
}

std::string type_of(const json& section) {
  if (section.is_object() && section.contains("type") && section["type"].is_string())
    return section["type"].get<std::string>();
  return section.dump();
}

bool null_or_empty_string(const json& obj, const char* key) {
  if (!obj.contains(key) || obj[key].is_null()) return true;
  return obj[key].is_string() && obj[key].get<std::string>().empty();
}

// The pre-tokenizer pattern of a tokenizer.json: ByteLevel with use_regex (GPT-2's regex), or a
// Sequence of a Split by a known regex and a ByteLevel without one.
PreTokenizerPattern read_pre_tokenizer(const json& doc, const std::string& path) {
  const json pt = doc.contains("pre_tokenizer") ? doc["pre_tokenizer"] : json();
  if (pt.is_null()) {
    std::string hint;
    const auto model = std::filesystem::path(path).parent_path() / "tokenizer.model";
    if (std::filesystem::exists(model)) hint = fmt::format("; use {} instead", model.string());
    TESSEL_THROW(UnsupportedError,
                 "tokenizer '{}' has no pre-tokenizer, so it is not a byte-level BPE (e.g. a "
                 "LLaMA-2-style tokenizer.json){}; {}",
                 path, hint, kSupported);
  }
  std::vector<json> steps;
  if (type_of(pt) == "Sequence" && pt.contains("pretokenizers") && pt["pretokenizers"].is_array())
    steps.assign(pt["pretokenizers"].begin(), pt["pretokenizers"].end());
  else
    steps.push_back(pt);
  auto check_byte_level = [&](const json& bl, bool want_regex) {
    TESSEL_CHECK(!bl.value("add_prefix_space", false), UnsupportedError,
                 "tokenizer '{}': the ByteLevel pre-tokenizer's add_prefix_space is not "
                 "supported; {}",
                 path, kSupported);
    const bool use_regex = bl.value("use_regex", true);
    TESSEL_CHECK(use_regex == want_regex, UnsupportedError,
                 "tokenizer '{}': a ByteLevel pre-tokenizer with use_regex {} {} is not "
                 "supported; {}",
                 path, use_regex, want_regex ? "and no Split before it" : "after a Split",
                 kSupported);
  };
  if (steps.size() == 1 && type_of(steps[0]) == "ByteLevel") {
    check_byte_level(steps[0], true);
    return PreTokenizerPattern::kGpt2;
  }
  if (steps.size() == 2 && type_of(steps[0]) == "Split" && type_of(steps[1]) == "ByteLevel") {
    const json& split = steps[0];
    const json pattern = split.contains("pattern") ? split["pattern"] : json();
    TESSEL_CHECK(pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string(),
                 UnsupportedError,
                 "tokenizer '{}': a Split pre-tokenizer by {} is not supported (only by the "
                 "GPT-2 or LLaMA-3 regex); {}",
                 path, pattern.dump(), kSupported);
    const auto regex = pattern["Regex"].get<std::string>();
    const auto known = pattern_of_regex(regex);
    TESSEL_CHECK(known.has_value(), UnsupportedError,
                 "tokenizer '{}': its pre-tokenizer regex {} is not one tessel implements (it "
                 "knows GPT-2's {} and LLaMA-3's {})",
                 path, json(regex).dump(), json(kGpt2Regex).dump(), json(kLlama3Regex).dump());
    TESSEL_CHECK(split.value("behavior", std::string("Isolated")) == "Isolated" &&
                     !split.value("invert", false),
                 UnsupportedError,
                 "tokenizer '{}': a Split pre-tokenizer with behavior {} and invert {} is not "
                 "supported (only Isolated, not inverted)",
                 path, split.value("behavior", json()).dump(),
                 split.value("invert", json()).dump());
    check_byte_level(steps[1], false);
    return *known;
  }
  std::string kinds;
  for (const auto& s : steps) kinds += (kinds.empty() ? "" : ", ") + type_of(s);
  TESSEL_THROW(UnsupportedError,
               "tokenizer '{}': pre-tokenizer [{}] is not supported (only ByteLevel with its "
               "regex, or a Split by the GPT-2 or LLaMA-3 regex followed by ByteLevel); {}",
               path, kinds, kSupported);
}

// The id of the special token a TemplateProcessing puts before a single sequence, if any
// (LLaMA-3: <|begin_of_text|>).
std::optional<uint32_t> read_bos(const json& doc) {
  if (!doc.contains("post_processor")) return std::nullopt;
  std::vector<json> processors{doc["post_processor"]};
  if (type_of(processors[0]) == "Sequence" && processors[0].contains("processors") &&
      processors[0]["processors"].is_array())
    processors.assign(processors[0]["processors"].begin(), processors[0]["processors"].end());
  for (const auto& p : processors) {
    if (type_of(p) != "TemplateProcessing") continue;
    const json single = p.value("single", json::array());
    if (!single.is_array() || single.empty() || !single[0].contains("SpecialToken")) continue;
    const auto name = single[0]["SpecialToken"].value("id", std::string());
    const json special = p.value("special_tokens", json::object());
    if (!special.contains(name)) continue;
    const json ids = special[name].value("ids", json::array());
    if (ids.is_array() && ids.size() == 1 && ids[0].is_number_unsigned())
      return ids[0].get<uint32_t>();
  }
  return std::nullopt;
}

// A vocabulary string back to bytes: each character through the byte alphabet, or, when one is
// not in it, the string's own UTF-8 bytes (Hugging Face's ByteLevel decoder does the same).
std::string token_bytes(const std::string& token, const std::array<int16_t, 0x144>& byte_of) {
  std::string bytes;
  for (size_t pos = 0; pos < token.size();) {
    const Utf8Char c = utf8_char_at(token, pos);
    if (c.code_point >= byte_of.size() || byte_of[c.code_point] < 0) return token;
    bytes.push_back(static_cast<char>(byte_of[c.code_point]));
    pos += c.length;
  }
  return bytes;
}

}  // namespace

std::unique_ptr<BpeTokenizer> BpeTokenizer::load(const std::string& path) {
  TESSEL_CHECK(std::filesystem::is_regular_file(path), IoError,
               "tokenizer file '{}' does not exist or is not a regular file; check the path", path);
  const json doc = read_json_file(path);
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->path_ = path;
  try {
    TESSEL_CHECK(doc.is_object() && doc.contains("model") && doc["model"].is_object(),
                 CorruptDataError,
                 "'{}' is not a Hugging Face tokenizer.json: it has no \"model\" object", path);
    const json& model = doc["model"];
    const std::string type = model.value("type", std::string("BPE"));
    TESSEL_CHECK(type == "BPE", UnsupportedError, "tokenizer '{}' has model type '{}'; {}", path,
                 type, kSupported);
    TESSEL_CHECK(!doc.contains("normalizer") || doc["normalizer"].is_null(), UnsupportedError,
                 "tokenizer '{}' has a normalizer ({}), which tessel does not implement; {}", path,
                 type_of(doc["normalizer"]), kSupported);
    TESSEL_CHECK(!model.value("byte_fallback", false), UnsupportedError,
                 "tokenizer '{}' is a BPE with byte_fallback (SentencePiece style), not a "
                 "byte-level BPE; use the model's tokenizer.model instead",
                 path);
    TESSEL_CHECK(null_or_empty_string(model, "continuing_subword_prefix") &&
                     null_or_empty_string(model, "end_of_word_suffix"),
                 UnsupportedError,
                 "tokenizer '{}': BPE with continuing_subword_prefix or end_of_word_suffix is not "
                 "supported; {}",
                 path, kSupported);
    t->pattern_ = read_pre_tokenizer(doc, path);
    t->ignore_merges_ = model.value("ignore_merges", false);

    TESSEL_CHECK(model.contains("vocab") && model["vocab"].is_object(), CorruptDataError,
                 "tokenizer '{}': model.vocab is missing or not an object", path);
    uint64_t size = 0;
    for (const auto& [token, id_json] : model["vocab"].items()) {
      TESSEL_CHECK(id_json.is_number_unsigned() && id_json.get<uint64_t>() < kMaxVocabSize,
                   CorruptDataError,
                   "tokenizer '{}': the vocabulary gives token {} the id {}, not a whole number "
                   "in [0, 2^31)",
                   path, json(token).dump(), id_json.dump());
      const auto id = id_json.get<uint32_t>();
      t->vocab_.emplace(token, id);
      size = std::max<uint64_t>(size, uint64_t{id} + 1);
    }
    TESSEL_CHECK(model.contains("merges") && model["merges"].is_array(), CorruptDataError,
                 "tokenizer '{}': model.merges is missing or not an array", path);
    const json& merges = model["merges"];
    t->merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& m = merges[rank];
      std::string left, right;
      if (m.is_string()) {  // "a b"
        const auto s = m.get<std::string>();
        const size_t space = s.find(' ');
        TESSEL_CHECK(space != std::string::npos, CorruptDataError,
                     "tokenizer '{}': merge #{} {} is not two tokens separated by a space", path,
                     rank, m.dump());
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {  // ["a", "b"]
        TESSEL_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                     CorruptDataError,
                     "tokenizer '{}': merge #{} {} is neither \"a b\" nor [\"a\", \"b\"]", path,
                     rank, m.dump());
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      }
      const auto l = t->vocab_.find(left), r = t->vocab_.find(right),
                 joined = t->vocab_.find(left + right);
      TESSEL_CHECK(l != t->vocab_.end() && r != t->vocab_.end() && joined != t->vocab_.end(),
                   CorruptDataError,
                   "tokenizer '{}': merge #{} {} joins tokens that are not all in the vocabulary "
                   "({}, {} and their join {})",
                   path, rank, m.dump(), json(left).dump(), json(right).dump(),
                   json(left + right).dump());
      // A pair listed twice keeps its first (lowest) rank, as Hugging Face does.
      t->merges_.emplace(merge_key(l->second, r->second),
                         Merge{static_cast<uint32_t>(rank), joined->second});
    }

    const json added = doc.value("added_tokens", json::array());
    TESSEL_CHECK(added.is_array(), CorruptDataError, "tokenizer '{}': added_tokens is not an array",
                 path);
    for (const json& a : added) {
      TESSEL_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_unsigned() &&
                       a["id"].get<uint64_t>() < kMaxVocabSize && a.contains("content") &&
                       a["content"].is_string() && !a["content"].get<std::string>().empty(),
                   CorruptDataError,
                   "tokenizer '{}': added token {} needs an \"id\" in [0, 2^31) and a non-empty "
                   "\"content\"",
                   path, a.dump());
      AddedToken token{a["content"].get<std::string>(), a["id"].get<uint32_t>()};
      size = std::max<uint64_t>(size, uint64_t{token.id} + 1);
      t->added_token_has_newline_ |= token.content.find('\n') != std::string::npos;
      t->added_.push_back(std::move(token));
    }
    for (uint32_t i = 0; i < t->added_.size(); ++i)
      t->added_by_first_byte_[static_cast<unsigned char>(t->added_[i].content[0])].push_back(i);
    for (auto& candidates : t->added_by_first_byte_) {
      std::stable_sort(candidates.begin(), candidates.end(), [&](uint32_t a, uint32_t b) {
        return t->added_[a].content.size() > t->added_[b].content.size();
      });
    }
    t->vocab_size_ = size;
    TESSEL_CHECK(size > 0, CorruptDataError, "tokenizer '{}' has an empty vocabulary", path);

    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      if (auto it = t->vocab_.find(model["unk_token"].get<std::string>()); it != t->vocab_.end())
        t->unk_ = it->second;
    }
    t->bos_ = read_bos(doc);
  } catch (const json::exception& e) {
    TESSEL_THROW(CorruptDataError, "tokenizer '{}' is not a well-formed tokenizer.json: {}", path,
                 e.what());
  }

  // The byte alphabet, both ways.
  std::array<int16_t, 0x144> byte_of;
  byte_of.fill(-1);
  for (unsigned b = 0; b < 256; ++b) {
    const char32_t c = byte_level_char(static_cast<uint8_t>(b));
    byte_of[c] = static_cast<int16_t>(b);
    append_utf8(c, t->byte_symbol_[b]);
    const auto it = t->vocab_.find(t->byte_symbol_[b]);
    t->byte_token_[b] = it == t->vocab_.end() ? -1 : int64_t{it->second};
  }
  // What each id decodes to; an added token's content wins over a vocabulary entry of its id.
  t->id_bytes_.resize(t->vocab_size_);
  t->id_known_.assign(t->vocab_size_, false);
  for (const auto& [token, id] : t->vocab_) {
    t->id_bytes_[id] = token_bytes(token, byte_of);
    t->id_known_[id] = true;
  }
  for (const auto& a : t->added_) {
    t->id_bytes_[a.id] = token_bytes(a.content, byte_of);
    t->id_known_[a.id] = true;
  }

  for (std::string_view name : kEotNames) {
    for (const auto& a : t->added_) {
      if (a.content == name && !t->eot_) t->eot_ = a.id;
    }
  }
  for (std::string_view name : kEotNames) {
    if (auto it = t->vocab_.find(name); it != t->vocab_.end() && !t->eot_) t->eot_ = it->second;
  }
  if (t->bos_ && *t->bos_ >= t->vocab_size_) t->bos_.reset();
  return t;
}

const BpeTokenizer::AddedToken* BpeTokenizer::added_token_at(std::string_view text,
                                                             size_t pos) const {
  for (uint32_t i : added_by_first_byte_[static_cast<unsigned char>(text[pos])]) {
    if (text.substr(pos).starts_with(added_[i].content)) return &added_[i];
  }
  return nullptr;
}

std::vector<uint32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3);
  auto encode_segment = [&](std::string_view segment) {
    for (size_t begin = 0; begin < segment.size();) {
      const size_t end = next_piece_end(pattern_, segment, begin);
      encode_piece(segment.substr(begin, end - begin), ids);
      begin = end;
    }
  };
  size_t segment_begin = 0;
  if (!added_.empty()) {
    for (size_t pos = 0; pos < text.size();) {
      const AddedToken* token = added_token_at(text, pos);
      if (token == nullptr) {
        ++pos;
        continue;
      }
      encode_segment(text.substr(segment_begin, pos - segment_begin));
      ids.push_back(token->id);
      pos += token->content.size();
      segment_begin = pos;
    }
  }
  encode_segment(text.substr(segment_begin));
  return ids;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& ids) const {
  {
    std::lock_guard lock(cache_mutex_);
    if (auto it = cache_.find(piece); it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  merge_piece(piece, ids);
  std::lock_guard lock(cache_mutex_);
  if (cache_.size() < kCacheLimit && piece.size() <= kCachedPieceBytes)
    cache_.emplace(std::string(piece), std::vector<uint32_t>(ids.begin() + first, ids.end()));
}

void BpeTokenizer::merge_piece(std::string_view piece, std::vector<uint32_t>& ids) const {
  if (ignore_merges_) {
    std::string symbols;
    for (char c : piece) symbols += byte_symbol_[static_cast<unsigned char>(c)];
    if (auto it = vocab_.find(symbols); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  // A doubly linked list of symbols; a merge folds the right symbol into the left one.
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    const auto byte = static_cast<unsigned char>(piece[i]);
    int64_t id = byte_token_[byte];
    if (id < 0) {
      TESSEL_CHECK(unk_.has_value(), InvalidArgumentError,
                   "tokenizer '{}' cannot encode byte 0x{:02x}: its byte-level token is not in "
                   "the vocabulary and the model has no unk_token",
                   path_, byte);
      id = *unk_;
    }
    symbols[i] = {static_cast<uint32_t>(id), static_cast<int32_t>(i) - 1,
                  i + 1 < piece.size() ? static_cast<int32_t>(i + 1) : -1, true};
  }
  // Candidate merges ordered by rank, then position; an entry is stale once either symbol has
  // changed, which the check against the current pair detects.
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    uint32_t id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    auto it = merges_.find(merge_key(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    auto it = merges_.find(merge_key(left.id, right.id));
    if (it == merges_.end() || it->second.id != top.id) continue;
    left.id = top.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (const Symbol& s : symbols) {
    if (s.alive) ids.push_back(s.id);
  }
}

std::string BpeTokenizer::decode(std::span<const uint32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    TESSEL_CHECK(id < vocab_size_ && id_known_[id], InvalidArgumentError,
                 "token id {} at position {} is not in the vocabulary of tokenizer '{}' (vocab "
                 "size {})",
                 id, i, path_, vocab_size_);
    text += id_bytes_[id];
  }
  return text;
}

std::optional<uint32_t> BpeTokenizer::token_id(std::string_view token) const {
  for (const auto& a : added_) {
    if (a.content == token) return a.id;
  }
  if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
  return std::nullopt;
}

size_t BpeTokenizer::safe_cut(std::string_view text) const {
  if (added_token_has_newline_) return 0;
  auto printable = [](char c) { return c >= 0x21 && c <= 0x7E; };
  for (size_t p = text.size(); p-- > 2;) {
    if (text[p - 1] == '\n' && printable(text[p]) && printable(text[p - 2])) return p;
  }
  return 0;
}

std::string BpeTokenizer::describe() const {
  auto name_of = [&](uint32_t id) {
    return json(id_bytes_[id]).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  std::string special;
  if (eot_) special += fmt::format(", EOT {} = {}", name_of(*eot_), *eot_);
  if (bos_) special += fmt::format(", BOS {} = {}", name_of(*bos_), *bos_);
  return fmt::format("byte-level BPE from {} (vocab {}, {} merges, {} pre-tokenizer{}{})", path_,
                     vocab_size_, merges_.size(), pattern_name(pattern_),
                     ignore_merges_ ? ", ignore_merges" : "", special);
}

}  // namespace tessel::data
