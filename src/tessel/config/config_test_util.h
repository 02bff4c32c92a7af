// Shared fixtures for runtime tests: a small corpus and a config for a tiny model.
#pragma once

#include <fstream>
#include <string>

#include "tessel/config/train_config.h"
#include "tessel/core/error.h"
#include "tessel/data/tokenizer.h"
#include "tessel/testing/testing.h"

namespace tessel::config::testing {

// Writes a few KB of repetitive English-like text as a token file and returns its path.
inline std::string make_corpus(const tessel::testing::TempDir& dir) {
  std::string text;
  const char* words[] = {"the ", "model ", "trains ", "on ",   "many ", "devices ",
                         "and ", "keeps ", "going ",  "when ", "they ", "change. "};
  uint32_t x = 12345;
  for (int i = 0; i < 3000; ++i) {
    x = x * 1103515245u + 12345u;
    text += words[(x >> 16) % 12];
  }
  std::string txt = (dir / "corpus.txt").string();
  std::ofstream(txt) << text;
  std::string tok = (dir / "corpus.tok").string();
  data::prepare_dataset({txt}, tok);
  return tok;
}

// A YAML config for gpt2-tiny (or another preset) on `data_path`, with extra lines appended.
inline std::string write_config(const tessel::testing::TempDir& dir, const std::string& data_path,
                                const std::string& extra = "", const std::string& name = "cfg.yaml",
                                const std::string& preset = "gpt2-tiny") {
  std::string path = (dir / name).string();
  std::ofstream(path) << "model: {preset: " << preset << "}\n"
                      << "data: {path: " << data_path << ", seq_len: 16, eval_fraction: 0.1}\n"
                      << extra;
  return path;
}

// The ConfigError a `parallel:` section (YAML flow map) gets when the config is loaded and its
// plan validated (steps 1, global batch 4, micro-batch 1, gpt2-tiny or `preset`), or "" when it is
// accepted.
inline std::string parallel_config_error(const tessel::testing::TempDir& dir,
                                         const std::string& data_path, const std::string& parallel,
                                         const std::string& preset = "gpt2-tiny") {
  try {
    auto cfg = TrainConfig::load(write_config(
        dir, data_path,
        "training: {steps: 1, global_batch: 4, micro_batch: 1}\nparallel: " + parallel + "\n",
        "parallel_check.yaml", preset));
    cfg.plan.validate(cfg.model, cfg.training.global_batch, cfg.plan.world());
    return "";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

}  // namespace tessel::config::testing
