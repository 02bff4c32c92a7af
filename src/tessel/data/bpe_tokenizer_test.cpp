#include "tessel/data/bpe_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/bpe_test_data.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::error_of;
using tessel::testing::TempDir;
using ::testing::HasSubstr;
using Ids = std::vector<uint32_t>;
using namespace std::string_literals;
using namespace tessel::data::testing;

class BpeTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string write(const std::string& name, const std::string& text) {
    const auto path = (dir / name).string();
    testing::write_bytes(path, text);
    return path;
  }
  std::unique_ptr<BpeTokenizer> gpt2() {
    return BpeTokenizer::load(write("gpt2.json", gpt2_json()));
  }
  std::unique_ptr<BpeTokenizer> llama3(bool ignore_merges = true) {
    return BpeTokenizer::load(write("llama3.json", llama3_json(ignore_merges)));
  }
};

TEST_F(BpeTest, ReadsTheGpt2StyleFile) {
  auto t = gpt2();
  EXPECT_EQ(t->vocab_size(), 272u);
  EXPECT_EQ(t->merge_count(), 15u);
  EXPECT_EQ(t->pattern(), PreTokenizerPattern::kGpt2);
  EXPECT_EQ(t->eot(), 271u);
  EXPECT_EQ(t->bos(), std::nullopt);
  EXPECT_EQ(t->token_id("Ġ"), 220u);
  EXPECT_EQ(t->token_id("Ċ"), 198u);
  EXPECT_THAT(t->describe(), HasSubstr("(vocab 272, 15 merges, GPT-2 pre-tokenizer"));
  EXPECT_THAT(t->describe(), HasSubstr("EOT \"<|endoftext|>\" = 271"));
}

TEST_F(BpeTest, EncodesBytesInGpt2Order) {
  auto t = gpt2();
  EXPECT_EQ(t->encode("!"), Ids{0});
  EXPECT_EQ(t->encode("\n"), Ids{198});
  EXPECT_EQ(t->encode(" "), Ids{220});
  EXPECT_EQ(t->encode(std::string(1, '\0')), Ids{188});
  EXPECT_EQ(t->encode("\x7f"), Ids{221});
  EXPECT_EQ(t->encode("\xad"), Ids{255});
  EXPECT_EQ(t->encode("\xff"), Ids{187});
}

TEST_F(BpeTest, AppliesMergesByRank) {
  auto t = gpt2();
  // Pieces "hello" " world" "'s" " " " 123" "!!" (PreTokenizer.Gpt2SplitsAsItsRegex):
  //   hello:  h e l l o -> (h e, rank 0) he l l o -> (l l, 1) he ll o -> (2) hell o -> (3) 259
  //   " world": Ġ w o r l d -> (4) Ġw -> (5) or -> (6) Ġwor -> (7) ld -> (8) Ġworld 264
  //   's 265; " " alone 220; " 123": (10) Ġ1 2 3 -> (11) Ġ1 23 -> (12) Ġ123 268; !! 269.
  EXPECT_EQ(t->encode("hello world's  123!!"), (Ids{259, 264, 265, 220, 268, 269}));
  // "ell": e l l has (e l, rank 14) at 0 and (l l, rank 1) at 1: the lower rank wins although it
  // is not leftmost -> e ll. (A left-to-right greedy merge would give el l = 270 75.)
  EXPECT_EQ(t->encode("ell"), (Ids{68, 257}));
  // "Hello": H e l l o -> (l l) H e ll o; no merge of "e ll" or "ll o" exists.
  EXPECT_EQ(t->encode("Hello"), (Ids{39, 68, 257, 78}));
  // "lll": (l l) at 0 and at 1 have the same rank: the leftmost goes first -> ll l.
  EXPECT_EQ(t->encode("lll"), (Ids{257, 75}));
  // "orld" is one piece: (o r, 5) then (l d, 7) -> or ld.
  EXPECT_EQ(t->encode("orld"), (Ids{261, 263}));
  // Repeated pieces come from the cache: the same ids again.
  EXPECT_EQ(t->encode("hello hello"), (Ids{259, 220, 259}));
  EXPECT_EQ(t->encode("hello hello"), (Ids{259, 220, 259}));
  EXPECT_EQ(t->encode(""), Ids{});
}

TEST_F(BpeTest, FindsAddedTokensBeforeSplitting) {
  auto t = gpt2();
  // "hello" | <|endoftext|> | " world": the special token is cut out first, then each side is
  // pre-tokenized on its own.
  EXPECT_EQ(t->encode("hello<|endoftext|> world"), (Ids{259, 271, 264}));
  EXPECT_EQ(t->encode("<|endoftext|><|endoftext|>"), (Ids{271, 271}));
  // Not the whole token: plain text, pieces "<|" "endoftext" "|"; no merge applies inside
  // "endoftext" (none of e n, n d, d o, o f, f t, t e, e x, x t is a merge), so 2 + 9 + 1 ids.
  const Ids partial = t->encode("<|endoftext|");
  EXPECT_EQ(partial.size(), 12u);
  EXPECT_EQ(t->decode(partial), "<|endoftext|");
  EXPECT_EQ(t->decode(Ids{259, 271, 264}), "hello<|endoftext|> world");
}

TEST_F(BpeTest, RoundTripsAnyText) {
  auto t = gpt2();
  const std::vector<std::string> texts = {
      "The quick brown fox jumps over the lazy dog.",
      "don't, I'm, we'll, they've, she'd, it's, you're, DON'T",
      "   leading and trailing   ",
      "tabs\tand\nnew\r\nlines\n\n\n  \n",
      "caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9 \xc3\x9f \xc3\x85ngstr\xc3\xb6m",  // accents
      "\xe6\x9d\xb1\xe4\xba\xac\xe3\x81\xaf\xe6\x97\xa5\xe6\x9c\xac",  // 東京は日本 (CJK, kana)
      "emoji \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd and \xe2\x82\xac 100\xc2\xb2",
      "nul \0 byte and \xff\xfe invalid \x80 utf-8"s,
      "<|endoftext|>hello<|endoftext|>",
  };
  for (const auto& text : texts) {
    const Ids ids = t->encode(text);
    EXPECT_EQ(t->decode(ids), text);
    for (uint32_t id : ids) EXPECT_LT(id, t->vocab_size());
  }
  // All 256 bytes, in every order the RNG gives.
  std::mt19937 rng(3);
  for (int round = 0; round < 50; ++round) {
    std::string text(64, '\0');
    for (char& c : text) c = static_cast<char>(rng() % 256);
    EXPECT_EQ(t->decode(t->encode(text)), text);
  }
}

TEST_F(BpeTest, DecodeRejectsUnknownIds) {
  auto t = gpt2();
  const auto msg = error_of<InvalidArgumentError>([&] { t->decode(Ids{259, 272}); });
  EXPECT_THAT(msg, HasSubstr("token id 272 at position 1"));
  EXPECT_THAT(msg, HasSubstr("gpt2.json"));
}

TEST_F(BpeTest, ReadsTheLlama3StyleFile) {
  auto t = llama3();
  EXPECT_EQ(t->pattern(), PreTokenizerPattern::kLlama3);
  EXPECT_EQ(t->vocab_size(), 274u);
  EXPECT_EQ(t->merge_count(), 15u);  // the array form gives the same merges
  EXPECT_EQ(t->bos(), 272u);         // from the TemplateProcessing
  EXPECT_EQ(t->eot(), 273u);         // <|end_of_text|>
  // " 123": the space cannot lead digits in LLaMA-3 -> " " (220) then "123": 1 (2 3) -> 16 267.
  // GPT-2's pattern keeps " 123" together -> Ġ123 268.
  EXPECT_EQ(t->encode(" 123"), (Ids{220, 16, 267}));
  EXPECT_EQ(gpt2()->encode(" 123"), (Ids{268}));
  // Digits by threes: "12345" -> "123" "45" -> 16 267, 19 20.
  EXPECT_EQ(t->encode("12345"), (Ids{16, 267, 19, 20}));
  // "world's": "world" (w (o r) (l d) -> 86 261 263) and "'s" 265.
  EXPECT_EQ(t->encode("world's"), (Ids{86, 261, 263, 265}));
  EXPECT_EQ(t->encode("<|begin_of_text|>hello<|end_of_text|>"), (Ids{272, 259, 273}));
  EXPECT_EQ(t->decode(Ids{272, 259, 273}), "<|begin_of_text|>hello<|end_of_text|>");
}

TEST_F(BpeTest, IgnoreMergesTakesAWholeWordFromTheVocabulary) {
  // "ello" is in the vocabulary (271) but no merge makes it: e l l o -> (l l) e ll o.
  EXPECT_EQ(llama3(true)->encode("ello"), (Ids{271}));
  EXPECT_EQ(llama3(false)->encode("ello"), (Ids{68, 257, 78}));
  // Pieces that are not vocabulary entries are merged as usual.
  EXPECT_EQ(llama3(true)->encode("hello"), (Ids{259}));
}

// safe_cut() promises that encoding the two sides separately gives the same ids, whatever
// follows: checked on every prefix of random texts made of the characters that matter.
TEST_F(BpeTest, SafeCutsDoNotChangeTheIds) {
  const std::vector<std::string> fragments = {"hello", " world", "'s", "\n", "\n",           "\r\n",
                                              " ",     "  ",     "!!", "1",  "234",          "\t",
                                              "x",     "(",      "é",  ".",  "<|endoftext|>"};
  std::mt19937 rng(11);
  std::vector<std::unique_ptr<BpeTokenizer>> tokenizers;
  tokenizers.push_back(gpt2());
  tokenizers.push_back(llama3());
  for (const auto& t : tokenizers) {
    int cuts = 0;
    for (int round = 0; round < 200; ++round) {
      std::string text;
      for (int i = 0; i < 24; ++i) text += fragments[rng() % fragments.size()];
      const Ids whole = t->encode(text);
      for (size_t len = 0; len <= text.size(); ++len) {
        const size_t cut = t->safe_cut(std::string_view(text).substr(0, len));
        if (cut == 0) continue;
        ASSERT_LE(cut, len);
        ++cuts;
        Ids parts = t->encode(std::string_view(text).substr(0, cut));
        const Ids rest = t->encode(std::string_view(text).substr(cut));
        parts.insert(parts.end(), rest.begin(), rest.end());
        ASSERT_EQ(parts, whole) << "cut at " << cut << " of \"" << text << "\"";
        // The pieces too: the ids alone may agree by chance (no merge joins white space here).
        auto pieces = pretokenize(t->pattern(), std::string_view(text).substr(0, cut));
        const auto rest_pieces = pretokenize(t->pattern(), std::string_view(text).substr(cut));
        pieces.insert(pieces.end(), rest_pieces.begin(), rest_pieces.end());
        ASSERT_EQ(pieces, pretokenize(t->pattern(), text))
            << "cut at " << cut << " of \"" << text << "\"";
      }
    }
    EXPECT_GT(cuts, 1000);  // the property was exercised
  }
}

TEST_F(BpeTest, ErrorsNameTheFileAndTheProblem) {
  auto msg = error_of<CorruptDataError>([&] { BpeTokenizer::load(write("a.json", "{ not json")); });
  EXPECT_THAT(msg, HasSubstr("a.json"));
  msg = error_of<CorruptDataError>([&] { BpeTokenizer::load(write("b.json", "[1, 2]")); });
  EXPECT_THAT(msg, HasSubstr("b.json"));
  for (std::string type : {"WordPiece", "Unigram", "WordLevel"}) {
    msg = error_of<UnsupportedError>([&] {
      BpeTokenizer::load(
          write("c.json", R"({"model": {"type": ")" + type + R"(", "vocab": {"a": 0}}})"));
    });
    EXPECT_THAT(msg, HasSubstr("c.json"));
    EXPECT_THAT(msg, HasSubstr("model type '" + type + "'"));
  }
  // Another regex: named, and the ones tessel knows are listed.
  std::string other = llama3_json();
  other.replace(other.find("\\\\p{N}{1,3}"), 11, "\\\\p{N}");
  msg = error_of<UnsupportedError>([&] { BpeTokenizer::load(write("d.json", other)); });
  EXPECT_THAT(msg, HasSubstr("d.json"));
  EXPECT_THAT(msg, HasSubstr("regex \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?"
                             "\\\\p{L}+|\\\\p{N}| ?"));
  EXPECT_THAT(msg, HasSubstr("not one tessel implements"));
  // A SentencePiece-style BPE (LLaMA-2's tokenizer.json): no pre-tokenizer.
  std::string spm_style = gpt2_json();
  spm_style.replace(spm_style.find("\"pre_tokenizer\""), 15, "\"no_pre_tokenizer\"");
  msg = error_of<UnsupportedError>([&] { BpeTokenizer::load(write("e.json", spm_style)); });
  EXPECT_THAT(msg, HasSubstr("e.json"));
  EXPECT_THAT(msg, HasSubstr("not a byte-level BPE"));
  // A normalizer.
  std::string normalized = gpt2_json();
  normalized.replace(normalized.find("\"normalizer\": null"), 18,
                     R"("normalizer": {"type": "NFC"})");
  msg = error_of<UnsupportedError>([&] { BpeTokenizer::load(write("f.json", normalized)); });
  EXPECT_THAT(msg, HasSubstr("normalizer (NFC)"));
  // A merge of tokens that are not in the vocabulary.
  std::string bad_merge = gpt2_json();
  bad_merge.replace(bad_merge.find("\"h e\""), 5, "\"h q\"");
  msg = error_of<CorruptDataError>([&] { BpeTokenizer::load(write("g.json", bad_merge)); });
  EXPECT_THAT(msg, HasSubstr("g.json"));
  EXPECT_THAT(msg, HasSubstr("merge #0 \"h q\""));
  // A missing file.
  msg = error_of<IoError>([&] { BpeTokenizer::load((dir / "none.json").string()); });
  EXPECT_THAT(msg, HasSubstr("none.json"));
}

std::vector<int32_t> read_tokens(const std::string& path) {
  auto tf = TokenFile::open(path);
  std::vector<int32_t> tokens(static_cast<size_t>(tf->size()));
  tf->read(0, tf->size(), tokens.data());
  return tokens;
}

TEST_F(BpeTest, PrepareSeparatesDocumentsWithEot) {
  const auto out = (dir / "o.tok").string();
  // "hello world" -> 259 264 (above), then EOT 271, then "hello" -> 259. No BOS in GPT-2.
  auto stats =
      prepare_dataset({write("1.txt", "hello world"), write("2.txt", "hello")}, out, *gpt2());
  EXPECT_EQ(stats.documents, 2);
  EXPECT_EQ(stats.bytes, 16);
  EXPECT_EQ(stats.tokens, 4);
  EXPECT_EQ(stats.vocab_size, 272u);
  EXPECT_EQ(stats.token_width, 2);
  EXPECT_EQ(read_tokens(out), (std::vector<int32_t>{259, 264, 271, 259}));
  EXPECT_EQ(TokenFile::open(out)->vocab_size(), 272u);
  // Content ids 259 259 264 (EOT excluded): p = (2/3, 1/3) -> log2(3) - 2/3 bits; both sides
  // are a few double operations on values near 1, so they agree to within 1e-12.
  EXPECT_NEAR(stats.entropy_bits, std::log2(3.0) - 2.0 / 3.0, 1e-12);
  // LLaMA-3: BOS 272 before each document, EOT 273 between.
  stats = prepare_dataset({write("1.txt", "hello world"), write("2.txt", "hello")}, out, *llama3());
  EXPECT_EQ(read_tokens(out), (std::vector<int32_t>{272, 259, 264, 273, 272, 259}));
}

// A document of several MB is encoded in parts cut where safe_cut() allows: the file holds the
// ids of encoding it whole.
TEST_F(BpeTest, PrepareStreamsALargeDocumentWithoutChangingIds) {
  const std::vector<std::string> lines = {
      "hello world's  123!!\n", "  indented line\n", "\n",
      "crlf line\r\n",          "trailing space \n", "caf\xc3\xa9 \xe6\x9d\xb1\n",
      "<|endoftext|>x\n",       "ell lll\n"};
  std::string text;
  std::mt19937 rng(1);
  while (text.size() < 3 * (size_t{1} << 20)) text += lines[rng() % lines.size()];
  const auto out = (dir / "big.tok").string();
  auto t = gpt2();
  const auto stats = prepare_dataset({write("big.txt", text)}, out, *t);
  const Ids whole = t->encode(text);
  EXPECT_EQ(stats.tokens, static_cast<int64_t>(whole.size()));
  EXPECT_EQ(read_tokens(out), std::vector<int32_t>(whole.begin(), whole.end()));
}
}  // namespace
}  // namespace tessel::data
