#include "tessel/model/model_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tessel/core/error.h"

namespace tessel::model {
namespace {

using ::testing::HasSubstr;

TEST(ModelSpec, Gpt2NamesShapesAndOrder) {
  ModelConfig c = ModelConfig::preset("gpt2-124m");
  ModelSpec s = ModelSpec::from(c);
  // 2 embeddings + 12 per block + 2 final norm; tied: no lm_head.
  ASSERT_EQ(s.size(), 2u + 12u * 12u + 2u);
  EXPECT_EQ(s[0].name, "transformer.wte.weight");
  EXPECT_EQ(s[0].shape, (Shape{50304, 768}));
  EXPECT_EQ(s[1].name, "transformer.wpe.weight");
  EXPECT_EQ(s[1].shape, (Shape{1024, 768}));
  const char* block[] = {"ln_1.weight",      "ln_1.bias",          "attn.c_attn.weight",
                         "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                         "ln_2.weight",      "ln_2.bias",          "mlp.c_fc.weight",
                         "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(s[size_t(2 + 12 * 7 + i)].name, std::string("transformer.h.7.") + block[i]);
    EXPECT_EQ(s[size_t(2 + 12 * 7 + i)].layer, 7);
  }
  EXPECT_EQ(s.at("transformer.h.3.attn.c_attn.weight").shape, (Shape{2304, 768}));
  EXPECT_EQ(s.at("transformer.h.3.attn.c_attn.bias").shape, (Shape{2304}));
  EXPECT_EQ(s.at("transformer.h.3.attn.c_proj.weight").shape, (Shape{768, 768}));
  EXPECT_EQ(s.at("transformer.h.3.mlp.c_fc.weight").shape, (Shape{3072, 768}));
  EXPECT_EQ(s.at("transformer.h.3.mlp.c_proj.weight").shape, (Shape{768, 3072}));
  EXPECT_EQ(s[s.size() - 2].name, "transformer.ln_f.weight");
  EXPECT_EQ(s[s.size() - 1].name, "transformer.ln_f.bias");
  EXPECT_EQ(s[s.size() - 1].layer, 12);
  EXPECT_EQ(s[0].layer, -1);
  EXPECT_FALSE(s.contains("lm_head.weight"));
}

TEST(ModelSpec, LlamaNamesShapesAndOrder) {
  ModelConfig c = ModelConfig::preset("llama3-8b");  // GQA: 8 kv heads of 128
  ModelSpec s = ModelSpec::from(c);
  ASSERT_EQ(s.size(), 1u + 9u * 32u + 2u);
  EXPECT_EQ(s[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(s[0].shape, (Shape{128256, 4096}));
  const char* block[] = {
      "input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
      "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
      "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight"};
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(s[size_t(1 + 9 * 31 + i)].name, std::string("model.layers.31.") + block[i]);
  }
  EXPECT_EQ(s.at("model.layers.0.self_attn.q_proj.weight").shape, (Shape{4096, 4096}));
  EXPECT_EQ(s.at("model.layers.0.self_attn.k_proj.weight").shape, (Shape{1024, 4096}));
  EXPECT_EQ(s.at("model.layers.0.self_attn.v_proj.weight").shape, (Shape{1024, 4096}));
  EXPECT_EQ(s.at("model.layers.0.self_attn.o_proj.weight").shape, (Shape{4096, 4096}));
  EXPECT_EQ(s.at("model.layers.0.mlp.gate_proj.weight").shape, (Shape{14336, 4096}));
  EXPECT_EQ(s.at("model.layers.0.mlp.down_proj.weight").shape, (Shape{4096, 14336}));
  EXPECT_EQ(s[s.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(s[s.size() - 1].name, "lm_head.weight");
  EXPECT_EQ(s[s.size() - 1].shape, (Shape{128256, 4096}));
  EXPECT_EQ(s[s.size() - 1].layer, 32);
}

TEST(ModelSpec, Gpt2InitDecayAndSplit) {
  ModelConfig c = ModelConfig::preset("gpt2-tiny");  // 6 layers
  ModelSpec s = ModelSpec::from(c);
  const float residual = 0.02f / std::sqrt(12.0f);
  auto expect = [&](const std::string& name, InitKind init, float std, bool decay, TpSplit split) {
    const ParamSpec& p = s.at(name);
    EXPECT_EQ(p.init, init) << name;
    if (init == InitKind::normal) {
      EXPECT_FLOAT_EQ(p.std, std) << name;
    }
    EXPECT_EQ(p.weight_decay, decay) << name;
    EXPECT_EQ(p.split, split) << name << " " << tp_split_name(p.split);
  };
  expect("transformer.wte.weight", InitKind::normal, 0.02f, true, TpSplit::vocab);
  expect("transformer.wpe.weight", InitKind::normal, 0.02f, true, TpSplit::replicated);
  expect("transformer.h.2.ln_1.weight", InitKind::ones, 0, false, TpSplit::replicated);
  expect("transformer.h.2.ln_1.bias", InitKind::zeros, 0, false, TpSplit::replicated);
  expect("transformer.h.2.attn.c_attn.weight", InitKind::normal, 0.02f, true,
         TpSplit::qkv_fused_per_head);
  expect("transformer.h.2.attn.c_attn.bias", InitKind::zeros, 0, false,
         TpSplit::qkv_fused_per_head);
  expect("transformer.h.2.attn.c_proj.weight", InitKind::normal, residual, true, TpSplit::row);
  expect("transformer.h.2.attn.c_proj.bias", InitKind::zeros, 0, false, TpSplit::replicated);
  expect("transformer.h.2.mlp.c_fc.weight", InitKind::normal, 0.02f, true, TpSplit::column);
  expect("transformer.h.2.mlp.c_fc.bias", InitKind::zeros, 0, false, TpSplit::column);
  expect("transformer.h.2.mlp.c_proj.weight", InitKind::normal, residual, true, TpSplit::row);
  expect("transformer.ln_f.weight", InitKind::ones, 0, false, TpSplit::replicated);
  // Vocabulary padding rows start at zero.
  EXPECT_EQ(s.at("transformer.wte.weight").init_rows, 257);
  EXPECT_EQ(s.at("transformer.wpe.weight").init_rows, -1);
}

TEST(ModelSpec, LlamaInitDecayAndSplit) {
  ModelSpec s = ModelSpec::from(ModelConfig::preset("llama-tiny"));
  for (const ParamSpec& p : s) {
    const bool matrix = p.shape.rank() == 2;
    EXPECT_EQ(p.weight_decay, matrix) << p.name;
    EXPECT_EQ(p.init, matrix ? InitKind::normal : InitKind::ones) << p.name;
    if (matrix) {
      EXPECT_FLOAT_EQ(p.std, 0.02f) << p.name;
    }
  }
  EXPECT_EQ(s.at("model.layers.1.self_attn.k_proj.weight").split, TpSplit::kv_heads);
  EXPECT_EQ(s.at("model.layers.1.self_attn.v_proj.weight").split, TpSplit::kv_heads);
  EXPECT_EQ(s.at("model.layers.1.self_attn.q_proj.weight").split, TpSplit::column);
  EXPECT_EQ(s.at("model.layers.1.self_attn.o_proj.weight").split, TpSplit::row);
  EXPECT_EQ(s.at("model.layers.1.mlp.up_proj.weight").split, TpSplit::column);
  EXPECT_EQ(s.at("model.layers.1.mlp.down_proj.weight").split, TpSplit::row);
  EXPECT_EQ(s.at("lm_head.weight").split, TpSplit::vocab);
  EXPECT_EQ(s.at("lm_head.weight").init_rows, 257);
}

TEST(ModelSpec, NoBiasGpt2HasNoBiases) {
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  c.bias = false;
  ModelSpec s = ModelSpec::from(c);
  for (const ParamSpec& p : s) EXPECT_THAT(p.name, ::testing::Not(HasSubstr("bias")));
  EXPECT_EQ(s.size(), 2u + 6u * 6u + 1u);
}

TEST(ModelSpec, AtThrowsForUnknownName) {
  ModelSpec s = ModelSpec::from(ModelConfig::preset("gpt2-tiny"));
  EXPECT_EQ(s.index_of("nope"), -1);
  EXPECT_THROW(s.at("transformer.h.6.ln_1.weight"), InvalidArgumentError);
}

TEST(ModelSpec, StagesPartitionTheModel) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig c = ModelConfig::preset(preset);
    ModelSpec full = ModelSpec::from(c);
    ModelSpec a = full.for_stage(StageRange::layers(c, 0, 2));
    ModelSpec b = full.for_stage(StageRange::layers(c, 2, 5));
    ModelSpec d = full.for_stage(StageRange::layers(c, 5, 6));
    // Every parameter is in exactly one stage, except a tied embedding, which the head stage
    // also holds.
    const std::string wte = global_param_name(c.family, GlobalParam::token_embedding);
    for (const ParamSpec& p : full) {
      int n = int(a.contains(p.name)) + int(b.contains(p.name)) + int(d.contains(p.name));
      EXPECT_EQ(n, (c.tie_embeddings && p.name == wte) ? 2 : 1) << p.name;
    }
    EXPECT_TRUE(a.contains(wte));
    EXPECT_FALSE(b.contains(wte));
    EXPECT_EQ(d.contains(wte), c.tie_embeddings);
    EXPECT_TRUE(d.contains(global_param_name(c.family, GlobalParam::final_norm_weight)));
    EXPECT_TRUE(b.contains(layer_param_name(c.family, 4, LayerParam::mlp_out_weight)));
    EXPECT_FALSE(b.contains(layer_param_name(c.family, 5, LayerParam::mlp_out_weight)));
    // Order stays canonical.
    int last = -1;
    for (const ParamSpec& p : b) {
      EXPECT_GT(full.index_of(p.name), last);
      last = full.index_of(p.name);
    }
  }
}

TEST(StageRange, ResolvesAndValidates) {
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  StageRange whole = StageRange{}.resolved(c);
  EXPECT_EQ(whole.layer_end, 6);
  EXPECT_TRUE(StageRange{}.is_whole(c));
  EXPECT_FALSE(StageRange::layers(c, 0, 3).is_whole(c));
  EXPECT_TRUE(StageRange::layers(c, 0, 3).has_embedding);
  EXPECT_FALSE(StageRange::layers(c, 0, 3).has_head);
  EXPECT_TRUE(StageRange::layers(c, 3, 6).has_head);
  EXPECT_THROW(StageRange::layers(c, 4, 7), ConfigError);
  EXPECT_THROW(StageRange::layers(c, 4, 3), ConfigError);
  EXPECT_THROW((StageRange{1, 3, true, false}.resolved(c)), ConfigError);
  EXPECT_THROW((StageRange{1, 3, false, true}.resolved(c)), ConfigError);
  EXPECT_THROW((StageRange{2, 2, false, false}.resolved(c)), ConfigError);
  EXPECT_NO_THROW((StageRange{0, 0, true, false}.resolved(c)));  // embedding-only stage
}

}  // namespace
}  // namespace tessel::model
