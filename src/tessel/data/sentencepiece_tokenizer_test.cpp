#include "tessel/data/sentencepiece_tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::data {
namespace {

using tessel::testing::error_of;
using tessel::testing::run_command;
using tessel::testing::TempDir;
using ::testing::HasSubstr;
using Ids = std::vector<uint32_t>;
using namespace tessel::data::testing;

// Lines the model is checked on: seen and unseen words, accents, CJK and an emoji (which only
// byte fallback can encode), digits and punctuation. Single spaces and no space at either end:
// the default normalizer (nmt_nfkc) folds white space runs, which would not round-trip.
const std::vector<std::string> kLines = {
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer turns text into token ids and back",
    "unseen words: zyxwvut qwertyuiop, 12345 and 3.14159!",
    "caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9",
    "\xe6\x9d\xb1\xe4\xba\xac is Tokyo \xf0\x9f\x98\x80",
};

// One SentencePiece BPE model with byte fallback (as LLaMA's), trained once for all tests on a
// text made of a small vocabulary; vocab 400 = 256 byte pieces, <unk> <s> </s>, and merges.
class SentencePieceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    std::mt19937 rng(5);
    const std::vector<std::string> words = {
        "the",   "quick", "brown",    "fox",  "jumps",       "over",   "lazy", "dog",   "a",
        "token", "text",  "turns",    "into", "ids",         "and",    "back", "model", "train",
        "data",  "piece", "sentence", "word", "caf\xc3\xa9", "tessel", "1",    "2",     "3"};
    std::ostringstream corpus;
    for (int line = 0; line < 400; ++line) {
      for (int w = 0; w < 8; ++w) corpus << (w ? " " : "") << words[rng() % words.size()];
      corpus << "\n";
    }
    write_bytes(*dir_ / "corpus.txt", corpus.str());
    model_ = (*dir_ / "m.model").string();
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + (*dir_ / "corpus.txt").string() + " --model_prefix=" + (*dir_ / "m").string() +
        " --model_type=bpe --vocab_size=400 --byte_fallback=true --character_coverage=1.0"
        " --num_threads=1 --minloglevel=2");
    train_error_ = status.ok() ? "" : status.ToString();
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(train_error_, "") << "SentencePiece training failed"; }

  static TempDir* dir_;
  static std::string model_;
  static std::string train_error_;
  TempDir tmp;
};
TempDir* SentencePieceTest::dir_ = nullptr;
std::string SentencePieceTest::model_;
std::string SentencePieceTest::train_error_;

TEST_F(SentencePieceTest, ReadsTheModel) {
  const auto t = load_tokenizer(model_);
  ASSERT_NE(dynamic_cast<const SentencePieceTokenizer*>(t.get()), nullptr);
  EXPECT_EQ(t->vocab_size(), 400u);
  // SentencePiece's default ids: <unk> 0, <s> 1, </s> 2.
  EXPECT_EQ(t->bos(), 1u);
  EXPECT_EQ(t->eot(), 2u);
  EXPECT_THAT(t->describe(), HasSubstr("SentencePiece model " + model_ + " (vocab 400"));
  EXPECT_THAT(t->describe(), HasSubstr("EOS </s> = 2, BOS <s> = 1"));
}

TEST_F(SentencePieceTest, RoundTripsText) {
  const auto t = load_tokenizer(model_);
  for (const auto& line : kLines) {
    const Ids ids = t->encode(line);
    EXPECT_FALSE(ids.empty());
    for (uint32_t id : ids) EXPECT_LT(id, 400u);
    EXPECT_EQ(t->decode(ids), line);
  }
  // Seen words merge: fewer ids than bytes.
  EXPECT_LT(t->encode(kLines[0]).size(), kLines[0].size() / 2);
  const auto msg = error_of<InvalidArgumentError>([&] { t->decode(Ids{5, 400}); });
  EXPECT_THAT(msg, HasSubstr("token id 400 at position 1"));
  EXPECT_THAT(msg, HasSubstr(model_));
}

// The known encoding: SentencePiece's own command-line encoder on the same model and lines.
TEST_F(SentencePieceTest, IdsEqualSpmEncode) {
  std::string out;
  if (run_command("command -v spm_encode", &out) != 0)
    GTEST_SKIP() << "spm_encode is not installed (Debian package sentencepiece; scripts/setup "
                    "installs it)";
  std::string text;
  for (const auto& line : kLines) text += line + "\n";
  write_bytes(tmp / "lines.txt", text);
  out.clear();
  ASSERT_EQ(run_command("spm_encode --model=" + model_ +
                            " --output_format=id --input=" + (tmp / "lines.txt").string() +
                            " --output=" + (tmp / "ids.txt").string(),
                        &out),
            0)
      << out;
  std::istringstream expected(read_bytes(tmp / "ids.txt"));
  const auto t = load_tokenizer(model_);
  for (const auto& line : kLines) {
    std::string ids_line;
    ASSERT_TRUE(std::getline(expected, ids_line)) << "spm_encode gave fewer lines";
    std::istringstream fields(ids_line);
    Ids want;
    for (uint32_t id; fields >> id;) want.push_back(id);
    EXPECT_EQ(t->encode(line), want) << line;
  }
}

TEST_F(SentencePieceTest, PrepareAddsBosPerDocumentAndEosBetween) {
  const auto t = load_tokenizer(model_);
  write_bytes(tmp / "1.txt", kLines[0]);
  write_bytes(tmp / "2.txt", kLines[1]);
  const auto out = (tmp / "o.tok").string();
  const auto stats = prepare_dataset({(tmp / "1.txt").string(), (tmp / "2.txt").string()}, out, *t);
  Ids want{1};
  for (uint32_t id : t->encode(kLines[0])) want.push_back(id);
  want.push_back(2);
  want.push_back(1);
  for (uint32_t id : t->encode(kLines[1])) want.push_back(id);
  EXPECT_EQ(stats.tokens, static_cast<int64_t>(want.size()));
  EXPECT_EQ(stats.token_width, 2);
  auto tf = TokenFile::open(out);
  EXPECT_EQ(tf->vocab_size(), 400u);
  std::vector<int32_t> got(want.size());
  tf->read(0, static_cast<int64_t>(got.size()), got.data());
  EXPECT_EQ(Ids(got.begin(), got.end()), want);
}

TEST_F(SentencePieceTest, CorruptModelsAreErrorsNamingTheFile) {
  write_bytes(tmp / "text.model", "this is not a sentencepiece model\n");
  auto msg = error_of<CorruptDataError>([&] { load_tokenizer((tmp / "text.model").string()); });
  EXPECT_THAT(msg, HasSubstr((tmp / "text.model").string()));
  EXPECT_THAT(msg, HasSubstr("not a SentencePiece model"));
  write_bytes(tmp / "cut.model", read_bytes(model_).substr(0, 200));
  msg = error_of<CorruptDataError>([&] { load_tokenizer((tmp / "cut.model").string()); });
  EXPECT_THAT(msg, HasSubstr((tmp / "cut.model").string()));
  write_bytes(tmp / "empty.model", "");
  msg = error_of<CorruptDataError>([&] { load_tokenizer((tmp / "empty.model").string()); });
  EXPECT_THAT(msg, HasSubstr((tmp / "empty.model").string()));
  msg = error_of<IoError>([&] { load_tokenizer((tmp / "none.model").string()); });
  EXPECT_THAT(msg, HasSubstr((tmp / "none.model").string()));
}

}  // namespace
}  // namespace tessel::data
