// `tessel generate` run as a user runs it: the built executable on a small checkpoint.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tessel/config/model_json.h"
#include "tessel/data/bpe_test_data.h"
#include "tessel/model/init.h"
#include "tessel/model/model_spec.h"
#include "tessel/store/checkpoint_store.h"
#include "tessel/testing/testing.h"

namespace tessel::cli {
namespace {

namespace fs = std::filesystem;
using tessel::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct Result {
  int status;
  std::string out;  // stdout alone, or stdout and stderr
};

// Runs `tessel generate ARGS`. With `err`, stdout and stderr are kept apart (stderr in *err):
// stdout is what a seed must reproduce, stderr holds timings.
Result generate(const std::string& args, std::string* err = nullptr) {
  Result r;
  const std::string bin = tessel::testing::tessel_binary().string();
  if (err == nullptr) {
    r.status = tessel::testing::run_command(bin + " generate " + args, &r.out);
    return r;
  }
  TempDir tmp;
  const fs::path err_file = tmp / "stderr";
  // Grouped, so that the 2>&1 run_command appends does not undo the redirection.
  r.status = tessel::testing::run_command(
      "{ " + bin + " generate " + args + " 2>" + err_file.string() + "; }", &r.out);
  std::ifstream in(err_file);
  *err = {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return r;
}

// gpt2-tiny with 2 layers (the byte vocabulary unless told otherwise, max_seq_len 64), freshly
// initialised, as a one-rank tessel checkpoint: what `tessel train` writes, without the optimizer
// state.
void write_checkpoint(const fs::path& dir, int vocab_size = 257) {
  model::ModelConfig cfg = model::ModelConfig::preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.vocab_size = vocab_size;
  const auto spec = model::ModelSpec::from(cfg);
  std::vector<std::vector<float>> values;
  store::CheckpointWriter w(dir.string(), 0);
  for (const auto& p : spec) {
    values.emplace_back(size_t(p.numel()));
    model::init_full(p, 3, values.back().data());
    w.add(p.name, DType::f32, p.shape, Box::of(p.shape), values.back().data());
  }
  w.write_rank_file();
  w.commit(1, {{"model", config::to_json(cfg)}, {"step", 1}});
}

int convert_to_hf(const fs::path& ckpt, const fs::path& hf) {
  std::string out;
  const int status =
      tessel::testing::run_command(tessel::testing::tessel_binary().string() + " convert --to hf " +
                                       ckpt.string() + " " + hf.string(),
                                   &out);
  EXPECT_EQ(status, 0) << out;
  return status;
}

class GenerateCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    write_checkpoint(tmp_ / "ckpt");
    ckpt_ = "--checkpoint " + (tmp_ / "ckpt").string();
  }
  TempDir tmp_;
  std::string ckpt_;
};

// A seed fixes the text: two runs print the same bytes, another seed other ones. The text is the
// prompt and then what the 24 tokens decode to, and stderr reports the speed.
TEST_F(GenerateCommand, TheSameSeedGivesTheSameText) {
  const std::string flags = ckpt_ + " --prompt 'Once upon' --max-new-tokens 24 --no-stop-at-eot " +
                            "--temperature 1 --top-k 0 --top-p 1 --seed ";
  std::string err;
  const Result a = generate(flags + "5", &err);
  ASSERT_EQ(a.status, 0) << a.out << err;
  EXPECT_THAT(a.out, StartsWith("Once upon"));
  EXPECT_THAT(err, HasSubstr("24 tokens in"));
  EXPECT_THAT(err, HasSubstr("tokens/s"));
  const Result b = generate(flags + "5", &err);
  ASSERT_EQ(b.status, 0) << err;
  EXPECT_EQ(b.out, a.out);
  // 24 draws from a near-uniform distribution over 257 ids: another seed gives other text.
  const Result c = generate(flags + "6", &err);
  ASSERT_EQ(c.status, 0) << err;
  EXPECT_NE(c.out, a.out);
}

// Temperature 0 is greedy: the same text whatever the seed.
TEST_F(GenerateCommand, TemperatureZeroIsDeterministic) {
  const std::string flags = ckpt_ + " --prompt hello --max-new-tokens 16 --temperature 0 --seed ";
  std::string err;
  const Result a = generate(flags + "1", &err);
  ASSERT_EQ(a.status, 0) << a.out << err;
  EXPECT_THAT(a.out, StartsWith("hello"));
  EXPECT_EQ(generate(flags + "1", &err).out, a.out);
  EXPECT_EQ(generate(flags + "999", &err).out, a.out);
}

// The same weights exported to a Hugging Face directory generate the same greedy text.
TEST_F(GenerateCommand, AHuggingFaceDirectoryGeneratesTheSameText) {
  std::string out;
  ASSERT_EQ(
      tessel::testing::run_command(tessel::testing::tessel_binary().string() + " convert --to hf " +
                                       (tmp_ / "ckpt").string() + " " + (tmp_ / "hf").string(),
                                   &out),
      0)
      << out;
  const std::string flags = " --prompt abc --max-new-tokens 12 --temperature 0";
  std::string err;
  const Result from_tessel = generate(ckpt_ + flags, &err);
  ASSERT_EQ(from_tessel.status, 0) << err;
  const Result from_hf = generate("--checkpoint " + (tmp_ / "hf").string() + flags, &err);
  ASSERT_EQ(from_hf.status, 0) << err;
  EXPECT_THAT(err, HasSubstr("Hugging Face"));
  EXPECT_EQ(from_hf.out, from_tessel.out);
}

// A Hugging Face directory's tokenizer.json is used unless --tokenizer says otherwise: a model of
// its vocabulary (272 ids) generates from it, the tessel checkpoint of the same weights with
// --tokenizer pointing at it prints the same text, and a model with fewer ids (257) refuses it.
TEST_F(GenerateCommand, TheModelDirectorysTokenizer) {
  write_checkpoint(tmp_ / "ckpt272", 272);
  ASSERT_EQ(convert_to_hf(tmp_ / "ckpt272", tmp_ / "hf272"), 0);
  std::ofstream(tmp_ / "hf272" / "tokenizer.json") << data::testing::gpt2_json();
  const std::string flags = " --prompt 'hello world' --max-new-tokens 8 --temperature 0";
  std::string err;
  const Result hf = generate("--checkpoint " + (tmp_ / "hf272").string() + flags, &err);
  ASSERT_EQ(hf.status, 0) << err;
  EXPECT_THAT(hf.out, StartsWith("hello world"));
  EXPECT_THAT(err, HasSubstr("tokenizer byte-level BPE from"));
  EXPECT_THAT(err, HasSubstr("8 tokens in"));
  const Result tessel = generate("--checkpoint " + (tmp_ / "ckpt272").string() + " --tokenizer " +
                                     (tmp_ / "hf272" / "tokenizer.json").string() + flags,
                                 &err);
  ASSERT_EQ(tessel.status, 0) << err;
  EXPECT_EQ(tessel.out, hf.out);

  ASSERT_EQ(convert_to_hf(tmp_ / "ckpt", tmp_ / "hf257"), 0);
  std::ofstream(tmp_ / "hf257" / "tokenizer.json") << data::testing::gpt2_json();
  const Result r = generate("--checkpoint " + (tmp_ / "hf257").string() + flags);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.out, HasSubstr("has 272 ids but model 'hf257' has vocab_size 257"));
}

// With --no-slide, generation that reaches max_seq_len (64) stops there and says so: a 40-byte
// prompt leaves room for 24 tokens in the context, plus the one its last position predicts.
TEST_F(GenerateCommand, StopsAtTheContextLimit) {
  std::string err;
  const std::string prompt(40, 'x');
  const Result r = generate(ckpt_ + " --prompt " + prompt +
                                " --max-new-tokens 100 --temperature 0 --no-stop-at-eot --no-slide",
                            &err);
  ASSERT_EQ(r.status, 0) << r.out << err;
  EXPECT_THAT(r.out, StartsWith(prompt));
  EXPECT_THAT(err, HasSubstr("25 tokens in"));
  EXPECT_THAT(err, HasSubstr("stopped at the context limit (max_seq_len 64 of model 'gpt2-tiny')"));
}

// By default the context slides: all 100 tokens come, the window (64) moving to its newest 32
// each time it fills -- after the first 25 tokens, then every 32: 3 times. The text up to the
// first slide is the --no-slide text.
TEST_F(GenerateCommand, SlidesPastTheContext) {
  std::string err;
  const std::string prompt(40, 'x');
  const std::string flags =
      ckpt_ + " --prompt " + prompt + " --max-new-tokens 100 --temperature 0 --no-stop-at-eot";
  const Result r = generate(flags, &err);
  ASSERT_EQ(r.status, 0) << r.out << err;
  EXPECT_THAT(err, HasSubstr("100 tokens in"));
  EXPECT_THAT(err, HasSubstr("slid 3 times"));
  const Result stopped = generate(flags + " --no-slide", &err);
  ASSERT_EQ(stopped.status, 0) << err;
  // Byte-level tokens: the text is bytes; the no-slide text (minus its newline) is a prefix.
  ASSERT_GT(stopped.out.size(), 1u);
  EXPECT_THAT(r.out, StartsWith(stopped.out.substr(0, stopped.out.size() - 1)));
  EXPECT_GT(r.out.size(), stopped.out.size() + 60);
}

TEST_F(GenerateCommand, BadInputsNameTheFlag) {
  struct Bad {
    std::string args;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {"--checkpoint " + (tmp_ / "nothing").string() + " --prompt a", "--checkpoint '"},
      {ckpt_ + " --prompt " + std::string(65, 'y'), "--prompt is 65 tokens but model"},
      {ckpt_ + " --prompt a --top-p 0", "--top-p is 0"},
      {ckpt_ + " --prompt a --top-p 1.5", "--top-p is 1.5"},
      {ckpt_ + " --prompt a --temperature -1", "--temperature is -1"},
      {ckpt_ + " --prompt a --temperature nan", "--temperature"},
      {ckpt_ + " --prompt a --max-new-tokens 0", "--max-new-tokens is 0"},
      {ckpt_ + " --prompt a --max-new-tokens -3", "--max-new-tokens is -3"},
      {ckpt_ + " --prompt a --top-k -1", "--top-k is -1"},
      {ckpt_ + " --prompt a --seed -1", "--seed"},
      {ckpt_, "--prompt TEXT or --prompt-file"},
      {ckpt_ + " --prompt-file " + (tmp_ / "none.txt").string(), "--prompt-file '"},
      {ckpt_ + " --prompt a --tokenizer " + (tmp_ / "none.json").string(), "--tokenizer '"},
  };
  for (const Bad& c : cases) {
    const Result r = generate(c.args);
    EXPECT_NE(r.status, 0) << c.args << "\n" << r.out;
    EXPECT_THAT(r.out, HasSubstr(c.message)) << c.args;
  }
}

// A prompt from a file, and the empty prompt (generation from the start of a document).
TEST_F(GenerateCommand, PromptFileAndEmptyPrompt) {
  std::ofstream(tmp_ / "prompt.txt") << "from a file";
  std::string err;
  const Result r = generate(
      ckpt_ + " --prompt-file " + (tmp_ / "prompt.txt").string() + " --max-new-tokens 3", &err);
  ASSERT_EQ(r.status, 0) << err;
  EXPECT_THAT(r.out, StartsWith("from a file"));
  const Result empty = generate(ckpt_ + " --prompt '' --max-new-tokens 3 --no-stop-at-eot", &err);
  ASSERT_EQ(empty.status, 0) << err;
  EXPECT_THAT(err, HasSubstr("3 tokens in"));
}

}  // namespace
}  // namespace tessel::cli
