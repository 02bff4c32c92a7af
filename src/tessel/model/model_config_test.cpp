#include "tessel/model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/model/model_spec.h"

namespace tessel::model {
namespace {

using ::testing::HasSubstr;

// Runs f, expects a ConfigError, returns its message.
template <typename F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

TEST(ModelConfig, Gpt2_124mParameterCountMatchesPublishedWithPaddedVocab) {
  ModelConfig c = ModelConfig::preset("gpt2-124m");
  EXPECT_EQ(c.padded_vocab(), 50304);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.num_params(), 124'475'904);
}

TEST(ModelConfig, Llama2_7bParameterCount) {
  ModelConfig c = ModelConfig::preset("llama2-7b");
  EXPECT_EQ(c.padded_vocab(), 32000);
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_EQ(c.num_params(), 6'738'415'616);
}

TEST(ModelConfig, PresetFieldsOfTinyModels) {
  ModelConfig g = ModelConfig::preset("gpt2-tiny");
  EXPECT_EQ(g.family, Family::gpt2);
  EXPECT_EQ(g.n_layer, 6);
  EXPECT_EQ(g.n_embd, 32);
  EXPECT_EQ(g.n_head, 4);
  EXPECT_EQ(g.n_kv_head, 4);
  EXPECT_EQ(g.ffn_hidden, 128);
  EXPECT_EQ(g.vocab_size, 257);
  EXPECT_EQ(g.padded_vocab(), 384);
  EXPECT_EQ(g.max_seq_len, 64);
  EXPECT_TRUE(g.bias);
  EXPECT_TRUE(g.tie_embeddings);
  EXPECT_FLOAT_EQ(g.norm_eps, 1e-5f);

  ModelConfig l = ModelConfig::preset("llama-tiny");
  EXPECT_EQ(l.family, Family::llama);
  EXPECT_EQ(l.n_kv_head, 2);
  EXPECT_EQ(l.ffn_hidden, 64);
  EXPECT_FALSE(l.bias);
  EXPECT_FALSE(l.tie_embeddings);
  EXPECT_FLOAT_EQ(l.rope_theta, 10000.0f);

  ModelConfig l3 = ModelConfig::preset("llama3-8b");
  EXPECT_EQ(l3.n_kv_head, 8);
  EXPECT_EQ(l3.vocab_size, 128256);
  EXPECT_EQ(l3.max_seq_len, 8192);
  EXPECT_FLOAT_EQ(l3.rope_theta, 500000.0f);
  EXPECT_EQ(ModelConfig::preset("gpt2-1.5b").head_dim(), 64);
  EXPECT_EQ(ModelConfig::preset("gpt3-175b").ffn_hidden, 49152);
}

TEST(ModelConfig, NumParamsEqualsSpecSizeForEveryPreset) {
  for (const std::string& name : ModelConfig::preset_names()) {
    ModelConfig c = ModelConfig::preset(name);
    EXPECT_EQ(c.name, name);
    EXPECT_EQ(ModelSpec::from(c).numel(), c.num_params()) << name;
  }
  // Also for the variants presets do not cover: untied gpt2 without biases, tied llama.
  ModelConfig g = ModelConfig::preset("gpt2-tiny");
  g.bias = false;
  g.tie_embeddings = false;
  EXPECT_EQ(ModelSpec::from(g).numel(), g.num_params());
  ModelConfig l = ModelConfig::preset("llama-tiny");
  l.tie_embeddings = true;
  EXPECT_EQ(ModelSpec::from(l).numel(), l.num_params());
}

TEST(ModelConfig, PresetNamesListsAll) {
  EXPECT_THAT(ModelConfig::preset_names(),
              ::testing::UnorderedElementsAre("gpt2-tiny", "llama-tiny", "gpt2-124m", "gpt2-350m",
                                              "gpt2-1.5b", "llama2-7b", "llama3-8b", "gpt3-175b"));
}

TEST(ModelConfig, UnknownPresetListsKnownOnes) {
  std::string msg = config_error([] { ModelConfig::preset("gpt5"); });
  EXPECT_THAT(msg, HasSubstr("gpt5"));
  EXPECT_THAT(msg, HasSubstr("gpt2-124m"));
  EXPECT_THAT(msg, HasSubstr("llama-tiny"));
}

TEST(ModelConfig, PaddedVocabRoundsUpTo128) {
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  c.vocab_size = 128;
  EXPECT_EQ(c.padded_vocab(), 128);
  c.vocab_size = 129;
  EXPECT_EQ(c.padded_vocab(), 256);
  c.vocab_size = 1;
  EXPECT_EQ(c.padded_vocab(), 128);
}

TEST(ModelConfig, ValidateNamesFieldAndFix) {
  ModelConfig base = ModelConfig::preset("gpt2-tiny");
  {
    ModelConfig c = base;
    c.n_head = 5;
    c.n_kv_head = 5;
    std::string msg = config_error([&] { c.validate(); });
    EXPECT_THAT(msg, HasSubstr("n_embd 32 is not divisible by n_head 5"));
  }
  {
    ModelConfig c = base;
    c.n_layer = 0;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("n_layer"));
  }
  {
    ModelConfig c = base;
    c.vocab_size = -3;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("vocab_size"));
  }
  {
    ModelConfig c = base;
    c.norm_eps = 0;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("norm_eps"));
  }
  {
    ModelConfig c = base;
    c.n_kv_head = 2;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("n_kv_head (2) must equal n_head"));
  }
  ModelConfig llama = ModelConfig::preset("llama-tiny");
  {
    ModelConfig c = llama;
    c.n_kv_head = 3;
    EXPECT_THAT(config_error([&] { c.validate(); }),
                HasSubstr("n_head 4 is not divisible by n_kv_head 3"));
  }
  {
    ModelConfig c = llama;
    c.bias = true;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("set bias to false"));
  }
  {
    ModelConfig c = llama;
    c.n_embd = 36;  // head_dim 9
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("must be even"));
  }
  {
    ModelConfig c = llama;
    c.rope_theta = -1;
    EXPECT_THAT(config_error([&] { c.validate(); }), HasSubstr("rope_theta"));
  }
  EXPECT_NO_THROW(base.validate());
  EXPECT_NO_THROW(llama.validate());
}

TEST(ModelConfig, FamilyNamesRoundTrip) {
  EXPECT_EQ(parse_family(family_name(Family::gpt2)), Family::gpt2);
  EXPECT_EQ(parse_family(family_name(Family::llama)), Family::llama);
  EXPECT_THAT(config_error([] { parse_family("mamba"); }), HasSubstr("mamba"));
}

}  // namespace
}  // namespace tessel::model
