#include "tessel/cli/generate_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "tessel/checkpoint/model_weights.h"
#include "tessel/core/check.h"
#include "tessel/core/parse_number.h"
#include "tessel/data/tokenizer.h"
#include "tessel/model/decoder.h"
#include "tessel/model/sampler.h"

namespace tessel::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct GenerateArgs {
  std::string checkpoint;
  std::string prompt;
  std::string prompt_file;
  std::string tokenizer;
  int64_t max_new_tokens = 64;
  double temperature = 0.8;
  int64_t top_k = 50;
  double top_p = 0.95;
  std::string seed = "1";  // read by parse_integer: CLI11 would wrap -1 into an unsigned seed
  bool stop_at_eot = true;
  bool slide = true;
  CLI::Option* prompt_option = nullptr;
  CLI::Option* prompt_file_option = nullptr;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Every numeric flag, before anything is read: a mistake costs no model load.
void check_flags(const GenerateArgs& a) {
  TESSEL_CHECK(a.max_new_tokens >= 1 && a.max_new_tokens <= INT_MAX, ConfigError,
               "--max-new-tokens is {}; it must be a count of at least 1, such as 64",
               a.max_new_tokens);
  TESSEL_CHECK(std::isfinite(a.temperature) && a.temperature >= 0, ConfigError,
               "--temperature is {}; it must be 0 (greedy) or a positive number, such as 0.8",
               a.temperature);
  TESSEL_CHECK(a.top_k >= 0, ConfigError,
               "--top-k is {}; it must be 0 (off) or a positive number of ids, such as 50",
               a.top_k);
  TESSEL_CHECK(a.top_p > 0 && a.top_p <= 1, ConfigError,
               "--top-p is {}; it must be in (0, 1] (1 is off), such as 0.95", a.top_p);
  parse_integer(a.seed, "--seed", 0, INT64_MAX);
  TESSEL_CHECK(a.prompt_option->count() + a.prompt_file_option->count() > 0, ConfigError,
               "tessel generate needs --prompt TEXT or --prompt-file PATH (--prompt '' starts "
               "from the beginning of a document)");
}

std::string read_prompt(const GenerateArgs& a) {
  if (a.prompt_file_option->count() == 0) return a.prompt;
  std::ifstream in(a.prompt_file, std::ios::binary);
  TESSEL_CHECK(in.good() && !fs::is_directory(a.prompt_file), ConfigError,
               "--prompt-file '{}' cannot be read: give a text file", a.prompt_file);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// --tokenizer, else the model directory's own tokenizer file, else the byte-level tokenizer.
std::unique_ptr<data::Tokenizer> open_tokenizer(const GenerateArgs& a,
                                                const checkpoint::ModelWeights& weights) {
  if (!a.tokenizer.empty()) {
    TESSEL_CHECK(fs::exists(a.tokenizer), ConfigError,
                 "--tokenizer '{}' does not exist: give a tokenizer.json, a tokenizer.model or a "
                 "directory holding one",
                 a.tokenizer);
    return data::load_tokenizer(a.tokenizer);
  }
  const fs::path dir = weights.path();
  if (fs::exists(dir / "tokenizer.json") || fs::exists(dir / "tokenizer.model")) {
    return data::load_tokenizer(dir.string());
  }
  return data::load_tokenizer("");
}

// The length of the longest prefix of `s` that does not end inside a UTF-8 sequence which later
// bytes could complete: a multi-byte character split across tokens is printed whole.
size_t printable_prefix(std::string_view s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// Prints the generated text as it grows. The whole sequence is decoded each time and the part
// after the prompt's own decoding printed, so tokenizers whose pieces depend on what precedes
// them (SentencePiece's leading spaces, bytes of one character in several tokens) print right.
class TextStream {
 public:
  TextStream(const data::Tokenizer& tokenizer, std::vector<uint32_t> prompt)
      : tokenizer_(tokenizer), ids_(std::move(prompt)), base_(tokenizer_.decode(ids_)) {}

  void add(uint32_t id) {
    ids_.push_back(id);
    print(false);
  }
  void finish() { print(true); }

 private:
  void print(bool final) {
    const std::string all = tokenizer_.decode(ids_);
    std::string_view text(all);
    if (text.substr(0, base_.size()) == base_) text.remove_prefix(base_.size());
    const size_t end = final ? text.size() : printable_prefix(text);
    if (end > shown_) {
      std::fwrite(text.data() + shown_, 1, end - shown_, stdout);
      std::fflush(stdout);
      shown_ = end;
    }
  }

  const data::Tokenizer& tokenizer_;
  std::vector<uint32_t> ids_;
  std::string base_;
  size_t shown_ = 0;
};

int run_generate(const GenerateArgs& a) {
  check_flags(a);
  const std::string prompt = read_prompt(a);
  TESSEL_CHECK(fs::exists(a.checkpoint), ConfigError,
               "--checkpoint '{}' does not exist: give a tessel checkpoint (a step directory or a "
               "run's checkpoint.dir) or a Hugging Face model directory",
               a.checkpoint);
  const auto load_start = Clock::now();
  const auto weights = checkpoint::ModelWeights::open(a.checkpoint);
  const model::ModelConfig& model = weights->model();
  const auto tokenizer = open_tokenizer(a, *weights);
  TESSEL_CHECK(tokenizer->vocab_size() <= uint64_t(model.vocab_size), ConfigError,
               "the tokenizer ({}) has {} ids but model '{}' has vocab_size {}: it is not the "
               "model's tokenizer; pass the one the model was trained with as --tokenizer",
               tokenizer->describe(), tokenizer->vocab_size(), model.name, model.vocab_size);
  // Ids the tokenizer cannot decode are never drawn.
  const size_t vocab = size_t(tokenizer->vocab_size());

  std::vector<uint32_t> ids;
  if (tokenizer->bos()) ids.push_back(*tokenizer->bos());
  const std::vector<uint32_t> text_ids = tokenizer->encode(prompt);
  ids.insert(ids.end(), text_ids.begin(), text_ids.end());
  if (ids.empty()) {
    // An empty prompt starts a document: after an end-of-text, as in training data.
    TESSEL_CHECK(tokenizer->eot().has_value(), ConfigError,
                 "--prompt is empty and the tokenizer ({}) has neither a BOS nor an end-of-text "
                 "id to start from; give some text",
                 tokenizer->describe());
    ids.push_back(*tokenizer->eot());
  }
  const int64_t P = int64_t(ids.size());
  TESSEL_CHECK(P <= model.max_seq_len, ConfigError,
               "--prompt is {} tokens but model '{}' reads at most {} (max_seq_len); shorten the "
               "prompt",
               P, model.name, model.max_seq_len);

  // The cache holds what this run can reach: the prompt and all but the last new token (at most
  // the model's context: past it, the window slides).
  const int64_t needed = std::max<int64_t>(P, P + a.max_new_tokens - 1);
  model::Decoder decoder(model, "cpu",
                         {.max_len = int(std::min<int64_t>(needed, model.max_seq_len))});
  decoder.load([&](const model::ParamSpec& p, float* out) {
    weights->read(weights->spec().at(p.name), out);
  });
  fmt::print(stderr, "tessel generate: {} ({} parameters), tokenizer {}; loaded in {:.2f} s\n",
             weights->describe(), decoder.num_params(), tokenizer->describe(),
             seconds_since(load_start));

  model::Sampler sampler({.temperature = a.temperature,
                          .top_k = int(std::min<int64_t>(a.top_k, INT_MAX)),
                          .top_p = a.top_p},
                         uint64_t(parse_integer(a.seed, "--seed", 0, INT64_MAX)));
  fmt::print("{}", prompt);
  std::fflush(stdout);
  TextStream stream(*tokenizer, ids);

  const auto prefill_start = Clock::now();
  const std::vector<int32_t> prompt_ids(ids.begin(), ids.end());
  std::span<const float> logits = decoder.prefill(prompt_ids);
  const double prefill_s = seconds_since(prefill_start);
  const auto decode_start = Clock::now();
  int64_t generated = 0, slides = 0;
  std::string stop = fmt::format("{} new tokens", a.max_new_tokens);
  // Every token so far: a full context slides to its newest half, read again from position 0
  // (as nanoGPT crops its context; positions are absolute, so the cache cannot just shift). One
  // prefill of max_len / 2 tokens every max_len / 2 steps: about one token's extra work a step.
  std::vector<int32_t> all(ids.begin(), ids.end());
  while (true) {
    const int32_t id = sampler.sample(logits.first(vocab));
    if (a.stop_at_eot && tokenizer->eot() && uint32_t(id) == *tokenizer->eot()) {
      stop = "end of text";
      break;
    }
    ++generated;
    stream.add(uint32_t(id));
    all.push_back(id);
    if (generated == a.max_new_tokens) break;
    if (decoder.position() == decoder.max_len()) {
      if (!a.slide) {
        stop = fmt::format("the context limit (max_seq_len {} of model '{}')", model.max_seq_len,
                           model.name);
        break;
      }
      const size_t keep = size_t(std::max(1, decoder.max_len() / 2));
      logits = decoder.prefill(std::span<const int32_t>(all).last(keep));
      ++slides;
      continue;
    }
    logits = decoder.step(id);
  }
  if (slides > 0)
    stop += fmt::format(
        " (the context of {} tokens slid {} time{}: later tokens saw the newest {})",
        decoder.max_len(), slides, slides == 1 ? "" : "s", std::max(1, decoder.max_len() / 2));
  stream.finish();
  fmt::print("\n");
  std::fflush(stdout);
  const double decode_s = seconds_since(decode_start);
  fmt::print(stderr,
             "tessel generate: {} tokens in {:.2f} s ({:.1f} tokens/s), stopped at {}; prompt {} "
             "tokens in {:.2f} s ({:.1f} tokens/s)\n",
             generated, decode_s, decode_s > 0 ? double(generated) / decode_s : 0.0, stop, P,
             prefill_s, prefill_s > 0 ? double(P) / prefill_s : 0.0);
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, std::function<int()>& action) {
  auto args = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand(
      "generate", "generate text from a tessel checkpoint or a Hugging Face model directory");
  cmd->add_option("--checkpoint", args->checkpoint,
                  "tessel checkpoint (step directory or checkpoint.dir) or Hugging Face model "
                  "directory")
      ->required();
  args->prompt_option = cmd->add_option("--prompt", args->prompt, "the text to continue");
  args->prompt_file_option =
      cmd->add_option("--prompt-file", args->prompt_file, "read the prompt from this file");
  args->prompt_option->excludes(args->prompt_file_option);
  cmd->add_option("--max-new-tokens", args->max_new_tokens, "tokens to generate at most")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "sampling temperature; 0 is greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "sample from the k likeliest ids; 0 is off")
      ->capture_default_str();
  cmd->add_option("--top-p", args->top_p,
                  "sample from the likeliest ids holding this much probability; 1 is off")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "random seed: the same seed gives the same text")
      ->type_name("UINT")
      ->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "tokenizer.json, tokenizer.model or a directory with one (default: the model "
                  "directory's, else tessel's byte-level tokenizer)");
  cmd->add_flag("--stop-at-eot,!--no-stop-at-eot", args->stop_at_eot,
                "stop at the tokenizer's end-of-text id (default on)");
  cmd->add_flag("--slide,!--no-slide", args->slide,
                "past the model's context (max_seq_len), go on from its newest half (default "
                "on); --no-slide stops there");
  cmd->callback([&action, args] { action = [args] { return run_generate(*args); }; });
}

}  // namespace tessel::cli
