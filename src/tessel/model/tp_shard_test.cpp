#include "tessel/model/tp_shard.h"

#include <gtest/gtest.h>

#include <vector>

#include "tessel/core/error.h"

namespace tessel::model {
namespace {

ModelConfig llama_with_kv(int n_kv_head) {
  ModelConfig c = ModelConfig::preset("llama-tiny");  // C 32, 4 heads of 8, F 64, Vp 384
  c.n_kv_head = n_kv_head;
  return c;
}

// Over all ranks, the pieces cover every element of the tensor exactly tp_copies() times and
// exactly one holder of each element is primary; on each rank the local boxes tile the local
// shape exactly once.
void expect_pieces_tile(const ModelConfig& c, int tp) {
  for (const ParamSpec& p : ModelSpec::from(c)) {
    SCOPED_TRACE(::testing::Message() << p.name << " tp=" << tp);
    const int copies = tp_copies(p, c, tp);
    std::vector<int> held(size_t(p.numel()), 0), primary(size_t(p.numel()), 0);
    const std::vector<int64_t> strides = p.shape.strides();
    for (int r = 0; r < tp; ++r) {
      const Shape local = tp_local_shape(p, c, r, tp);
      ASSERT_EQ(local.rank(), p.shape.rank());
      std::vector<int> local_held(size_t(local.numel()), 0);
      const std::vector<int64_t> local_strides = local.strides();
      for (const ShardPiece& pc : tp_shard_pieces(p, c, r, tp)) {
        ASSERT_TRUE(Box::of(p.shape).contains(pc.global)) << pc.global.str();
        ASSERT_TRUE(Box::of(local).contains(pc.local)) << pc.local.str();
        ASSERT_EQ(pc.global.shape(), pc.local.shape());
        // Walk the piece (rank 1 or 2 tensors).
        const int64_t rows = pc.global.extent(0);
        const int64_t cols = p.shape.rank() == 2 ? pc.global.extent(1) : 1;
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            int64_t g = (pc.global.lo(0) + i) * strides[0];
            int64_t l = (pc.local.lo(0) + i) * local_strides[0];
            if (p.shape.rank() == 2) {
              g += pc.global.lo(1) + j;
              l += pc.local.lo(1) + j;
            }
            ++held[size_t(g)];
            primary[size_t(g)] += tp_is_primary(p, c, r, tp) ? 1 : 0;
            ++local_held[size_t(l)];
          }
        }
      }
      for (size_t i = 0; i < local_held.size(); ++i) ASSERT_EQ(local_held[i], 1) << "local " << i;
    }
    for (size_t i = 0; i < held.size(); ++i) {
      ASSERT_EQ(held[i], copies) << "element " << i;
      ASSERT_EQ(primary[i], 1) << "element " << i;
    }
  }
}

TEST(TpShard, PiecesTileEveryParameter) {
  for (const ModelConfig& c : {ModelConfig::preset("gpt2-tiny"), ModelConfig::preset("llama-tiny"),
                               llama_with_kv(1), llama_with_kv(4)}) {
    for (int tp : {1, 2, 4}) expect_pieces_tile(c, tp);
  }
}

TEST(TpShard, Gpt2Shards) {
  const ModelConfig c = ModelConfig::preset("gpt2-tiny");  // C 32, 4 heads, F 128, Vp 384
  ModelSpec s = ModelSpec::from(c);
  const ParamSpec& qkv = s.at("transformer.h.0.attn.c_attn.weight");  // [96, 32]
  // Rank 1 of 2 takes heads 2-3 of each of q, k and v, stacked.
  EXPECT_EQ(tp_local_shape(qkv, c, 1, 2), (Shape{48, 32}));
  EXPECT_EQ(tp_shard_pieces(qkv, c, 1, 2),
            (std::vector<ShardPiece>{{Box({16, 0}, {32, 32}), Box({0, 0}, {16, 32})},
                                     {Box({48, 0}, {64, 32}), Box({16, 0}, {32, 32})},
                                     {Box({80, 0}, {96, 32}), Box({32, 0}, {48, 32})}}));
  const ParamSpec& qkv_bias = s.at("transformer.h.0.attn.c_attn.bias");
  EXPECT_EQ(tp_shard_pieces(qkv_bias, c, 3, 4)[2], (ShardPiece{Box({88}, {96}), Box({16}, {24})}));
  const ParamSpec& proj = s.at("transformer.h.0.attn.c_proj.weight");  // row split
  EXPECT_EQ(tp_shard_pieces(proj, c, 1, 2),
            (std::vector<ShardPiece>{{Box({0, 16}, {32, 32}), Box({0, 0}, {32, 16})}}));
  EXPECT_EQ(tp_local_shape(s.at("transformer.h.0.mlp.c_fc.weight"), c, 2, 4), (Shape{32, 32}));
  EXPECT_EQ(tp_local_shape(s.at("transformer.h.0.mlp.c_fc.bias"), c, 2, 4), (Shape{32}));
  EXPECT_EQ(tp_local_shape(s.at("transformer.h.0.mlp.c_proj.bias"), c, 2, 4), (Shape{32}));
  EXPECT_EQ(tp_local_shape(s.at("transformer.wpe.weight"), c, 2, 4), (Shape{64, 32}));
  // The vocabulary: 384 rows in 4 shards of 96; the last holds padding only (V = 257).
  const ParamSpec& wte = s.at("transformer.wte.weight");
  EXPECT_EQ(tp_shard_pieces(wte, c, 3, 4)[0].global, Box({288, 0}, {384, 32}));
  EXPECT_EQ(tp_vocab_range(c, 3, 4).start, 288);
  EXPECT_EQ(tp_vocab_range(c, 3, 4).rows, 96);
  EXPECT_EQ(tp_copies(wte, c, 4), 1);
  EXPECT_EQ(tp_copies(s.at("transformer.ln_f.weight"), c, 4), 4);
  EXPECT_TRUE(tp_is_primary(s.at("transformer.ln_f.weight"), c, 0, 4));
  EXPECT_FALSE(tp_is_primary(s.at("transformer.ln_f.weight"), c, 1, 4));
}

TEST(TpShard, KvHeadsSplitOrReplicated) {
  const ModelConfig c = ModelConfig::preset("llama-tiny");  // 4 q heads, 2 kv heads of 8
  ModelSpec s = ModelSpec::from(c);
  const ParamSpec& k = s.at("model.layers.0.self_attn.k_proj.weight");  // [16, 32]
  // tp 2 divides the kv heads: one each.
  TpHeads h = tp_heads(c, 1, 2);
  EXPECT_EQ(h.q_begin, 2);
  EXPECT_EQ(h.q_heads, 2);
  EXPECT_EQ(h.kv_begin, 1);
  EXPECT_EQ(h.kv_heads, 1);
  EXPECT_FALSE(h.kv_replicated);
  EXPECT_EQ(tp_shard_pieces(k, c, 1, 2)[0].global, Box({8, 0}, {16, 32}));
  EXPECT_EQ(tp_copies(k, c, 2), 1);
  // tp 4: query head r uses kv head r / 2, so ranks 0-1 hold kv head 0 and ranks 2-3 kv head 1.
  for (int r = 0; r < 4; ++r) {
    h = tp_heads(c, r, 4);
    EXPECT_EQ(h.q_begin, r);
    EXPECT_EQ(h.q_heads, 1);
    EXPECT_EQ(h.kv_begin, r / 2);
    EXPECT_EQ(h.kv_heads, 1);
    EXPECT_TRUE(h.kv_replicated);
    EXPECT_EQ(tp_shard_pieces(k, c, r, 4)[0].global, Box({8 * (r / 2), 0}, {8 * (r / 2) + 8, 32}));
    EXPECT_EQ(tp_is_primary(k, c, r, 4), r % 2 == 0);
  }
  EXPECT_EQ(tp_copies(k, c, 4), 2);
  // Multi-query attention: every rank holds the one kv head.
  const ModelConfig mqa = llama_with_kv(1);
  const ModelSpec mqa_spec = ModelSpec::from(mqa);
  const ParamSpec& k1 = mqa_spec.at("model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(tp_local_shape(k1, mqa, 3, 4), (Shape{8, 32}));
  EXPECT_EQ(tp_copies(k1, mqa, 4), 4);
  // q and o follow the query heads.
  EXPECT_EQ(tp_local_shape(s.at("model.layers.0.self_attn.q_proj.weight"), c, 0, 4),
            (Shape{8, 32}));
  EXPECT_EQ(tp_local_shape(s.at("model.layers.0.self_attn.o_proj.weight"), c, 0, 4),
            (Shape{32, 8}));
  EXPECT_EQ(tp_local_shape(s.at("lm_head.weight"), c, 0, 2), (Shape{192, 32}));
}

TEST(TpShard, RejectsLayoutsThatDoNotSplit) {
  EXPECT_THROW(validate_tp(ModelConfig::preset("gpt2-tiny"), 0), ConfigError);
  EXPECT_THROW(validate_tp(ModelConfig::preset("gpt2-tiny"), 3), ConfigError);  // 4 heads
  EXPECT_THROW(validate_tp(ModelConfig::preset("gpt2-tiny"), 8), ConfigError);
  EXPECT_NO_THROW(validate_tp(ModelConfig::preset("gpt2-tiny"), 4));
  ModelConfig c = ModelConfig::preset("llama-tiny");
  c.n_embd = 48;
  c.n_head = 12;
  c.ffn_hidden = 96;
  c.n_kv_head = 3;  // tp 2 neither divides 3 kv heads nor is a multiple of them
  EXPECT_THROW(validate_tp(c, 2), ConfigError);
  EXPECT_NO_THROW(validate_tp(c, 3));
  c.n_kv_head = 6;
  EXPECT_NO_THROW(validate_tp(c, 2));
  c.ffn_hidden = 66;
  EXPECT_THROW(validate_tp(c, 4), ConfigError);
  const ModelConfig t = ModelConfig::preset("gpt2-tiny");
  EXPECT_THROW(tp_shard_pieces(ModelSpec::from(t)[0], t, 2, 2), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::model
