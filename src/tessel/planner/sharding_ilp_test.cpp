#include "tessel/planner/sharding_ilp.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "tessel/core/error.h"
#include "tessel/planner/sharding_test_util.h"
#include "tessel/planner/transformer_graph.h"

namespace tessel::planner {
namespace {

model::ModelConfig two_blocks(const std::string& preset) {
  auto m = model::ModelConfig::preset(preset);
  m.n_layer = 2;
  return m;
}

void print(const OpGraph& g, const ShardingSolution& s) {
  for (int i = 0; i < g.size(); ++i)
    fmt::print("  {:<28} {:<12} out {}\n", g.node(i).name, s.chosen[size_t(i)].name,
               to_string(s.chosen[size_t(i)].out));
}

// Megatron-LM's tensor parallelism, rediscovered on two-block graphs of GPT-2 350M (one sample of
// 1024 tokens, tied head) and LLaMA-2 7B (2048 tokens): the QKV (q, k, v) projections and the
// first MLP matmuls split by columns, the attention output and the last MLP matmul by rows, the
// attention itself by heads, the residual stream whole (or partial) between them, and the
// vocabulary split in
// the embedding (when the head is tied to it), the head and the loss. At these widths a matmul
// run whole on every device costs more than the all-reduce a row split leaves; at GPT-2 124M's
// 768 and tp 2 the two come within a few microseconds, and either may win.
TEST(ShardingIlp, RediscoversMegatronOnGpt2AndLlama) {
  struct Case {
    const char* preset;
    int seq;
    std::vector<std::string> column, row;
  };
  const std::vector<Case> cases = {
      {"gpt2-350m", 1024, {"attn.c_attn", "mlp.c_fc"}, {"attn.c_proj", "mlp.c_proj"}},
      {"llama2-7b",
       2048,
       {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"},
       {"self_attn.o_proj", "mlp.down_proj"}},
  };
  for (const Case& c : cases)
    for (int t : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} tp {}", c.preset, t));
      const auto model = two_blocks(c.preset);
      const OpGraph g = transformer_graph(model, 1, c.seq);
      const ShardingSolution s =
          solve_sharding(g, t, testing::nvlink_costs(), {.time_limit_s = 60});
      ASSERT_EQ(s.status, IlpStatus::optimal) << ilp_status_name(s.status);
      if (std::getenv("TESSEL_PRINT_SHARDING")) print(g, s);
      for (int l = 0; l < 2; ++l) {
        auto of = [&](const std::string& name) {
          return s.of(g, fmt::format("h.{}.{}", l, name)).name;
        };
        for (const auto& name : c.column) EXPECT_EQ(of(name), "column") << name;
        for (const auto& name : c.row) EXPECT_EQ(of(name), "row") << name;
        EXPECT_EQ(of("qk"), "batch(1)");  // heads
        EXPECT_EQ(of("pv"), "batch(1)");
        // The residual stream is whole, or the partial sums the all-reduce then sums (adding
        // before or after it moves the same bytes).
        EXPECT_NE(s.of(g, fmt::format("h.{}.residual_1", l)).out.kind, Shard::Kind::split);
      }
      if (model.tie_embeddings) {
        EXPECT_EQ(s.of(g, "wte").name, "vocab");
      }
      EXPECT_EQ(s.of(g, "lm_head").name, "column");
      EXPECT_EQ(s.of(g, "loss").name, "vocab");
      if (::testing::Test::HasFailure()) print(g, s);
    }
}

// Small weights and many tokens on CPU workers (gpt2-tiny: hidden 32, 128 samples of 64
// tokens): splitting the batch and all-reducing the few weight gradients beats moving
// activations, and beats every device computing everything, so every matmul with weights runs
// data-parallel. Squeezed below the replicated weights' training state, the same
// graph must split weights instead.
TEST(ShardingIlp, SmallWeightsRunDataParallelUnlessMemoryForbids) {
  auto model = model::ModelConfig::preset("gpt2-tiny");
  model.n_layer = 1;
  const OpGraph g = transformer_graph(model, 128, 64);
  ShardingCosts costs = testing::cpu_worker_costs();
  const ShardingSolution s = solve_sharding(g, 4, costs, {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal);
  double state = 0;
  for (int i = 0; i < g.size(); ++i) {
    const OpNode& n = g.node(i);
    if (n.kind == OpKind::matmul && !n.weights.empty()) {
      EXPECT_TRUE(s.chosen[size_t(i)].name.starts_with("batch"))
          << n.name << ": " << s.chosen[size_t(i)].name;
    }
    if (n.weights_of < 0)  // a tied head's weights are its embedding's
      state += s.chosen[size_t(i)].weight_elements * costs.state_bytes_per_weight;
  }
  if (::testing::Test::HasFailure()) print(g, s);
  // Every weight replicated: the whole model's state on each device.
  EXPECT_DOUBLE_EQ(state, double(model.num_params()) * costs.state_bytes_per_weight);
  costs.memory_bytes = 0.5 * state;
  const ShardingSolution tight = solve_sharding(g, 4, costs, {.time_limit_s = 60});
  ASSERT_TRUE(tight.status == IlpStatus::optimal || tight.status == IlpStatus::feasible);
  double tight_state = 0;
  for (int i = 0; i < g.size(); ++i)
    if (g.node(i).weights_of < 0)
      tight_state += tight.chosen[size_t(i)].weight_elements * costs.state_bytes_per_weight;
  EXPECT_LE(tight_state, costs.memory_bytes);
  EXPECT_GT(tight.time_s, s.time_s);
  // Nothing fits a device that cannot hold a quarter of the state.
  costs.memory_bytes = 0.2 * state;
  EXPECT_EQ(solve_sharding(g, 4, costs, {.time_limit_s = 60}).status, IlpStatus::infeasible);
}

// A small Wide-ResNet-style CNN (64 images of 32 x 32, 3 -> 64 channels, 3 x 3 convolutions, a
// global pool and a 10-way classifier): weights of a few tens of thousands of values against
// activations of millions, so every convolution runs data-parallel.
TEST(ShardingIlp, ConvolutionsRunDataParallel) {
  const int64_t B = 64, H = 32, W = 32;
  OpGraph g;
  const int images = g.add({.name = "images", .kind = OpKind::input, .shape = {B, 3, H, W}});
  const int labels = g.add({.name = "labels", .kind = OpKind::input, .shape = {B}});
  int x = images;
  int64_t channels = 3;
  for (int l = 0; l < 4; ++l) {
    const int64_t out = l == 0 ? 16 : 64;
    const int conv = g.add({.name = fmt::format("conv{}", l),
                            .kind = OpKind::conv,
                            .inputs = {x},
                            .shape = {B, out, H, W},
                            .weights = {{out, channels, 3, 3}, {out}},
                            .flops = 2.0 * B * out * H * W * channels * 9});
    x = g.add({.name = fmt::format("relu{}", l),
               .kind = OpKind::gelu,
               .inputs = {conv},
               .shape = {B, out, H, W},
               .flops = double(B * out * H * W)});
    channels = out;
  }
  const int pool = g.add({.name = "pool",
                          .kind = OpKind::reduce,
                          .inputs = {x},
                          .shape = {B, channels},
                          .flops = double(B * channels * H * W)});
  const int fc = g.add({.name = "fc",
                        .kind = OpKind::matmul,
                        .inputs = {pool},
                        .shape = {B, 10},
                        .weights = {{channels, 10}, {10}},
                        .flops = 2.0 * B * channels * 10});
  g.add({.name = "loss", .kind = OpKind::loss, .inputs = {fc, labels}, .flops = 5.0 * B * 10});
  const ShardingCosts costs = testing::cpu_worker_costs();
  const ShardingSolution s = solve_sharding(g, 4, costs, {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(s.of(g, fmt::format("conv{}", l)).name, "batch(0)") << l;
  EXPECT_EQ(s.of(g, "pool").out, Shard::S(0));
  // Convolution strategies: the three splits where the sizes divide.
  const auto conv1 = op_strategies(g, g.size() - 9, 4);
  std::vector<std::string> names;
  for (const auto& st : conv1) names.push_back(st.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"replicated", "batch(0)", "out_channels", "in_channels"}));
}

TEST(ShardingIlp, RejectsBadCosts) {
  const OpGraph g = transformer_graph(model::ModelConfig::preset("gpt2-tiny"), 1, 8);
  ShardingCosts c;
  c.bandwidth = 0;
  EXPECT_THROW(solve_sharding(g, 2, c), InvalidArgumentError);
  EXPECT_THROW(solve_sharding(g, 0, ShardingCosts{}), InvalidArgumentError);
  EXPECT_THROW(ShardingSolution{}.of(g, "wte"), InvalidArgumentError);
  // A problem whose per-node lists do not match the graph, or that allows a strategy the node
  // does not have.
  ShardingProblem short_lists;
  short_lists.active = {1, 1};
  EXPECT_THROW(solve_sharding(g, 2, ShardingCosts{}, {}, short_lists), InvalidArgumentError);
  ShardingProblem unknown;
  unknown.allowed.assign(size_t(g.size()), {});
  unknown.allowed[2] = {99};
  EXPECT_THROW(solve_sharding(g, 2, ShardingCosts{}, {}, unknown), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner
