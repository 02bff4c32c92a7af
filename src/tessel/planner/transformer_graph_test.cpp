#include "tessel/planner/transformer_graph.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>

#include "tessel/core/error.h"
#include "tessel/planner/cost_model.h"

namespace tessel::planner {
namespace {

// The graph of every preset: a DAG in the order built, the model's exact parameter count, and
// matmul FLOPs equal to what the cost model counts for the blocks and the head (the graph and
// layer planners price the same work).
TEST(TransformerGraph, PresetsHaveTheModelsParametersAndFlops) {
  for (const auto& name : model::ModelConfig::preset_names()) {
    for (bool tie : {true, false}) {
      auto m = model::ModelConfig::preset(name);
      m.tie_embeddings = tie;
      SCOPED_TRACE(name + (tie ? " tied" : " untied"));
      const int64_t B = 2;
      const int T = std::min(m.max_seq_len, 128);
      const OpGraph g = transformer_graph(m, B, T);
      const auto order = g.validate();
      ASSERT_EQ(int(order.size()), g.size());
      for (int i = 0; i < g.size(); ++i) EXPECT_EQ(order[size_t(i)], i);  // built in order
      EXPECT_EQ(g.total_parameters(), m.num_params());
      double matmul = 0;
      std::map<int, int> per_layer;
      for (const auto& n : g.nodes()) {
        if (n.kind == OpKind::matmul) matmul += n.flops;
        if (n.layer >= 0) ++per_layer[n.layer];
      }
      const double expected = m.n_layer * block_forward_flops(m, B, T, 1).total() +
                              head_forward_flops(m, B, T, 1).total();
      EXPECT_NEAR(matmul, expected, 1e-12 * expected);
      // Every block is the same operators.
      ASSERT_EQ(int(per_layer.size()), m.n_layer);
      for (const auto& [layer, count] : per_layer) EXPECT_EQ(count, per_layer.begin()->second);
      // The head reads the embedding's table exactly when the model ties them.
      const OpNode& head = g.node(g.size() - 2);
      EXPECT_EQ(head.name, "lm_head");
      EXPECT_EQ(head.weights_of >= 0, tie);
      EXPECT_EQ(head.shape, (std::vector<int64_t>{B, T, m.padded_vocab()}));
    }
  }
}

TEST(TransformerGraph, Gpt3At96LayersIsAboutTwoThousandOperators) {
  const OpGraph g = transformer_graph(model::ModelConfig::preset("gpt3-175b"), 1, 2048);
  EXPECT_GT(g.size(), 96 * 15);
  EXPECT_LT(g.size(), 96 * 30);
  EXPECT_EQ(g.total_parameters(), model::ModelConfig::preset("gpt3-175b").num_params());
}

TEST(TransformerGraph, GroupedQueryAttentionRepeatsKeysAndValues) {
  const auto m = model::ModelConfig::preset("llama3-8b");  // 32 query heads, 8 kv heads
  const OpGraph g = transformer_graph(m, 1, 64);
  int repeats = 0;
  for (const auto& n : g.nodes())
    if (n.name.find("repeat_kv") != std::string::npos) {
      ++repeats;
      EXPECT_EQ(n.shape, (std::vector<int64_t>{1, m.n_head, 64, m.head_dim()}));
    }
  EXPECT_EQ(repeats, 2 * m.n_layer);
  const OpGraph mha = transformer_graph(model::ModelConfig::preset("llama2-7b"), 1, 64);
  for (const auto& n : mha.nodes()) EXPECT_EQ(n.name.find("repeat_kv"), std::string::npos);
}

// Every path of a block's computation goes through its residual adds (the attention and MLP
// branches rejoin there); nothing inside an attention or an MLP is critical.
TEST(TransformerGraph, CriticalNodesAreTheResidualStream) {
  for (const char* preset : {"gpt2-124m", "llama3-8b"}) {
    auto m = model::ModelConfig::preset(preset);
    m.n_layer = 3;
    const OpGraph g = transformer_graph(m, 1, 16);
    std::vector<std::string> names;
    for (int v : g.critical_nodes()) names.push_back(g.node(v).name);
    std::vector<std::string> want;
    if (m.family == model::Family::gpt2) want.push_back("embed_add");
    for (int l = 0; l < m.n_layer; ++l) {
      want.push_back(fmt::format("h.{}.residual_1", l));
      want.push_back(fmt::format("h.{}.residual_2", l));
    }
    for (const char* tail : {m.family == model::Family::gpt2 ? "ln_f" : "norm", "lm_head", "loss"})
      want.push_back(tail);
    if (m.family != model::Family::gpt2) {
      // LLaMA's embedding is a single operator feeding the first block's norm and residual.
      EXPECT_EQ(g.node(g.critical_nodes().front()).name, "h.0.residual_1") << preset;
    }
    EXPECT_EQ(names, want) << preset;
  }
}

TEST(TransformerGraph, RejectsSizesOutsideTheModel) {
  const auto m = model::ModelConfig::preset("gpt2-tiny");
  EXPECT_THROW(transformer_graph(m, 0, 8), ConfigError);
  EXPECT_THROW(transformer_graph(m, 1, m.max_seq_len + 1), ConfigError);
  EXPECT_THROW(transformer_graph(m, 1, 0), ConfigError);
}

// Nodes in any order are fine; an input that is no node, a tie to a node without weights, or a
// cycle is named.
TEST(OpGraph, ValidateOrdersAndNamesWhatIsWrong) {
  OpGraph g;
  const int c = g.add({.name = "c", .kind = OpKind::add, .inputs = {1, 2}});
  const int a = g.add({.name = "a", .kind = OpKind::input});
  const int b = g.add({.name = "b", .kind = OpKind::gelu, .inputs = {1}});
  EXPECT_EQ(g.validate(), (std::vector<int>{a, b, c}));

  OpGraph dangling = g;
  dangling.add({.name = "d", .kind = OpKind::mul, .inputs = {c, 7}});
  try {
    dangling.validate();
    ADD_FAILURE() << "a missing input was accepted";
  } catch (const CorruptDataError& e) {
    EXPECT_NE(std::string(e.what()).find("node 3 ('d') reads node 7"), std::string::npos)
        << e.what();
  }
  OpGraph tied = g;
  tied.add({.name = "h", .kind = OpKind::matmul, .inputs = {c}, .weights_of = a});
  EXPECT_THROW(tied.validate(), CorruptDataError);

  OpGraph cycle;
  cycle.add({.name = "in", .kind = OpKind::input});
  cycle.add({.name = "x", .kind = OpKind::add, .inputs = {0, 3}});
  cycle.add({.name = "y", .kind = OpKind::gelu, .inputs = {1}});
  cycle.add({.name = "z", .kind = OpKind::gelu, .inputs = {2}});
  try {
    cycle.validate();
    ADD_FAILURE() << "a cycle was accepted";
  } catch (const CorruptDataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("3 of 4 nodes"), std::string::npos) << what;
    EXPECT_NE(what.find("'x'"), std::string::npos) << what;
    EXPECT_NE(what.find("'z'"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tessel::planner
