// `tessel data prepare --tokenizer`: run as a user runs it, checking the file, the printout and
// the failures (non-zero exit, the file named, no output left behind).
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "tessel/data/bpe_test_data.h"
#include "tessel/data/test_files.h"
#include "tessel/data/token_dataset.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

using tessel::testing::run_command;
using tessel::testing::TempDir;
using namespace tessel::data::testing;
namespace fs = std::filesystem;

struct Result {
  int status;
  std::string output;
};

Result prepare(const std::string& args) {
  Result r;
  r.status =
      run_command(tessel::testing::tessel_binary().string() + " data prepare " + args, &r.output);
  return r;
}

std::vector<int32_t> tokens_of(const fs::path& path) {
  auto tf = data::TokenFile::open(path.string());
  std::vector<int32_t> tokens(static_cast<size_t>(tf->size()));
  tf->read(0, tf->size(), tokens.data());
  return tokens;
}

class DataPrepareTest : public ::testing::Test {
 protected:
  TempDir dir;
  std::string docs;  // two documents, for --input
  void SetUp() override {
    write_bytes(dir / "1.txt", "hello world");
    write_bytes(dir / "2.txt", "hello");
    docs = (dir / "1.txt").string() + " " + (dir / "2.txt").string();
  }
  std::string out() const { return (dir / "o.tok").string(); }
};

TEST_F(DataPrepareTest, WithAGpt2StyleTokenizerJson) {
  write_bytes(dir / "tok.json", gpt2_json());
  auto r = prepare("--input " + docs + " --output " + out() + " --tokenizer " +
                   (dir / "tok.json").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 documents, 16 bytes, 4 tokens (vocab 272, uint16)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("tokenizer: byte-level BPE from " + (dir / "tok.json").string()),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("unigram entropy of the tokens"), std::string::npos) << r.output;
  // Ids worked out in data/bpe_test_data.h: hello 259, " world" 264, <|endoftext|> 271.
  EXPECT_EQ(tokens_of(out()), (std::vector<int32_t>{259, 264, 271, 259}));
}

TEST_F(DataPrepareTest, VocabAbove65536IsWrittenAsUint32) {
  // An added token with id 70000 makes the vocabulary 70001 ids (the ones between are unused).
  std::string json = gpt2_json();
  json.replace(json.find("{\"id\": 271,"), 11, "{\"id\": 70000,");
  write_bytes(dir / "wide.json", json);
  auto r = prepare("--input " + docs + " --output " + out() + " --tokenizer " +
                   (dir / "wide.json").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(vocab 70001, uint32)"), std::string::npos) << r.output;
  EXPECT_EQ(data::TokenFile::open(out())->token_width(), 4);
  EXPECT_EQ(tokens_of(out()), (std::vector<int32_t>{259, 264, 70000, 259}));
}

TEST_F(DataPrepareTest, WithASentencePieceModelDirectory) {
  std::string corpus;
  for (int i = 0; i < 200; ++i) corpus += "hello world, a second document and a third line\n";
  write_bytes(dir / "corpus.txt", corpus);
  fs::create_directory(dir / "model");
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt").string() +
      " --model_prefix=" + (dir / "model" / "tokenizer").string() +
      " --model_type=bpe --vocab_size=60 --num_threads=1 --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  auto r = prepare("--input " + docs + " --output " + out() + " --tokenizer " +
                   (dir / "model").string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: SentencePiece model " +
                          (dir / "model" / "tokenizer.model").string() + " (vocab 60"),
            std::string::npos)
      << r.output;
  // <s> = 1 starts each document and </s> = 2 separates them.
  const auto tokens = tokens_of(out());
  ASSERT_GE(tokens.size(), 5u);
  EXPECT_EQ(tokens.front(), 1);
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), 1), 2);
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), 2), 1);
}

TEST_F(DataPrepareTest, BadTokenizersFailNamingTheFileAndWriteNothing) {
  std::string other_regex = llama3_json();
  other_regex.replace(other_regex.find("\\\\p{N}{1,3}"), 11, "\\\\p{N}");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"broken.json", "{\"model\": "},
      {"wordpiece.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})"},
      {"unigram.json", R"({"model": {"type": "Unigram", "vocab": []}})"},
      {"regex.json", other_regex},
      {"corrupt.model", "not a model"},
  };
  const std::vector<std::string> expected = {"not valid JSON", "model type 'WordPiece'",
                                             "model type 'Unigram'", "not one tessel implements",
                                             "not a SentencePiece model"};
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto path = (dir / cases[i].first).string();
    write_bytes(path, cases[i].second);
    auto r = prepare("--input " + docs + " --output " + out() + " --tokenizer " + path);
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(expected[i]), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out())) << cases[i].first;
  }
  auto r = prepare("--input " + docs + " --output " + out() + " --tokenizer " +
                   (dir / "missing.json").string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("missing.json"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out()));
  // Nothing but the files this test wrote: no temporary file left behind either.
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_FALSE(e.path().filename().string().starts_with("o.tok")) << e.path();
}

TEST_F(DataPrepareTest, NeverWritesOverTheTokenizer) {
  write_bytes(dir / "tokenizer.json", gpt2_json());
  for (const auto& target : {dir / "tokenizer.json", dir.path()}) {
    auto r = prepare("--force --input " + docs + " --output " + (dir / "tokenizer.json").string() +
                     " --tokenizer " + target.string());
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("is the input"), std::string::npos) << r.output;
    EXPECT_EQ(read_bytes(dir / "tokenizer.json"), gpt2_json());
  }
}

}  // namespace
}  // namespace tessel::cli
