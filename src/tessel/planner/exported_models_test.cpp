// The graph planner on models exported from PyTorch by tools/export_onnx.py (committed in
// testdata/; rerun the script with Debian's python3-torch to regenerate them): they import with
// their operators known, a CNN's convolutions run data-parallel, and a mixture of experts whose
// experts do not fit one device holds each device's share of the experts.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tessel/planner/graph_costs.h"
#include "tessel/planner/graph_plan.h"
#include "tessel/planner/graph_sharding.h"
#include "tessel/planner/onnx_graph.h"

namespace tessel::planner {
namespace {

std::string testdata(const char* name) {
  return std::string(TESSEL_SOURCE_DIR) + "/src/tessel/planner/testdata/" + name;
}

int count(const OpGraph& g, OpKind kind, bool weighted) {
  int n = 0;
  for (const auto& node : g.nodes()) n += node.kind == kind && !node.weights.empty() == weighted;
  return n;
}

// GPT-2: per block the fused QKV, the output projection and the two MLP matmuls with weights, and
// q k^T, p v between activations; the head. Its parameters are the module's: wte 256 x 64, wpe
// 32 x 64, per block 2 layer norms (2 x 128), c_attn 64 x 192 + 192, c_proj 64 x 64 + 64, c_fc
// 64 x 256 + 256, its projection 256 x 64 + 64; the final norm and the 64 x 256 head.
TEST(ExportedModels, Gpt2AndLlamaImportWithTheirOperatorsKnown) {
  const auto gpt2 = read_onnx(testdata("gpt2_tiny.onnx"), {.dims = {{"batch", 8}}});
  EXPECT_EQ(count(gpt2.graph, OpKind::matmul, true), 2 * 4 + 1);
  EXPECT_EQ(count(gpt2.graph, OpKind::matmul, false), 2 * 2);
  EXPECT_EQ(count(gpt2.graph, OpKind::other, false) + count(gpt2.graph, OpKind::other, true), 0);
  const int64_t block =
      2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64);
  EXPECT_EQ(gpt2.graph.total_parameters(), 256 * 64 + 32 * 64 + 2 * block + 128 + 64 * 256);
  for (const auto& w : gpt2.warnings) EXPECT_EQ(w.find("kept replicated"), std::string::npos) << w;

  // LLaMA: q, k, v, o, gate, up, down per block, the head; rope's concatenation of the rotated
  // halves is the one operator kept replicated.
  const auto llama = read_onnx(testdata("llama_tiny.onnx"), {.dims = {{"batch", 8}}});
  EXPECT_EQ(count(llama.graph, OpKind::matmul, true), 2 * 7 + 1);
  EXPECT_EQ(count(llama.graph, OpKind::matmul, false), 2 * 2);
  for (const auto& w : llama.warnings) {
    if (w.find("kept replicated") != std::string::npos) {
      EXPECT_NE(w.find("'Concat'"), std::string::npos) << w;
    }
  }
}

// 1024 images of 32 x 32 on a DGX A100's 4 devices: the convolutions' weights are a few thousand
// values and their activations tens of millions, so every convolution splits the batch (the
// data parallelism a CNN wants) rather than its channels. (At 256 images the convolutions are
// so small that replicating them beats the ~45 us a few-KiB all-reduce takes on NVLink --
// the measured curve, cluster.h.)
TEST(ExportedModels, TheCnnsConvolutionsRunDataParallel) {
  const auto cnn = read_onnx(testdata("wide_resnet.onnx"), {.dims = {{"batch", 1024}}});
  // Every convolution known, its bias read through the Identity PyTorch writes for initializers
  // equal to another (the zero biases batch norm folds into); the global pool a reduction.
  EXPECT_EQ(count(cnn.graph, OpKind::conv, true), 6);
  EXPECT_EQ(count(cnn.graph, OpKind::reduce, false), 1);
  for (const auto& w : cnn.warnings) EXPECT_EQ(w.find("kept replicated"), std::string::npos) << w;
  const auto costs = sharding_costs(ClusterSpec::preset("dgx-a100"), Precision::bf16);
  const ShardingSolution s = shard_graph(cnn.graph, 4, costs, {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal);
  for (int v = 0; v < cnn.graph.size(); ++v) {
    if (cnn.graph.node(v).kind == OpKind::conv) {
      EXPECT_EQ(s.chosen[size_t(v)].name, "batch(0)") << cnn.graph.node(v).name;
    }
  }
}

// The convolutions' batch split leaves each device part of their weights' gradients: they are
// all-reduced once per step, after the last micro-batch's backward (as data parallelism's are),
// not once per micro-batch.
TEST(ExportedModels, TheCnnsWeightGradientsAreAllReducedOncePerStep) {
  const auto cnn = read_onnx(testdata("wide_resnet.onnx"), {.dims = {{"batch", 1024}}});
  const auto cluster = ClusterSpec::preset("dgx-a100");
  GraphPlanRequest r;
  r.tp = 4;
  r.ilp.time_limit_s = 60;
  const GraphPlan one = plan_graph(cnn.graph, cluster, r);
  r.micro_batches = 4;
  const GraphPlan four = plan_graph(cnn.graph, cluster, r);
  const auto costs = sharding_costs(cluster, r.precision);
  double expected = 0;  // summed in node order, as plan_graph sums one rank's
  for (int v = 0; v < cnn.graph.size(); ++v)
    expected += weight_sync_cost(cnn.graph, v, one.sharding.chosen[size_t(v)], 4, costs);
  EXPECT_GT(expected, 0);
  EXPECT_EQ(one.tp_sync_s, expected);
  EXPECT_EQ(four.tp_sync_s, expected);
  EXPECT_GT(four.pipeline_s, 3 * one.pipeline_s);  // four micro-batches through one stage
  EXPECT_DOUBLE_EQ(four.step_s, four.pipeline_s + four.tp_sync_s + four.dp_s + four.optimizer_s);
}

// Eight experts of [32, 128] and [128, 32] stacked as [E, C, F] and [E, F, C]. With room for
// their training state, 64 sequences run data-parallel; with a quarter of the room, no device can
// hold them all, and each holds two experts: the expert matmuls split their expert dimension
// (weights and tokens alike).
TEST(ExportedModels, MoeExpertsAreShardedWhenTheyDoNotFitADevice) {
  const auto moe = read_onnx(testdata("moe.onnx"), {.dims = {{"batch", 64}}});
  std::vector<int> experts;
  for (int v = 0; v < moe.graph.size(); ++v)
    if (moe.graph.node(v).kind == OpKind::matmul && !moe.graph.node(v).weights.empty() &&
        moe.graph.node(v).weights.front().size() == 3)
      experts.push_back(v);
  ASSERT_EQ(experts.size(), 2u);
  auto costs = sharding_costs(ClusterSpec::preset("dgx-a100"), Precision::bf16);
  const double expert_state = 2.0 * 8 * 32 * 128 * costs.state_bytes_per_weight;
  const double other_state =
      double(moe.graph.total_parameters() - 2 * 8 * 32 * 128) * costs.state_bytes_per_weight;
  costs.memory_bytes = other_state + expert_state / 4 * 1.01;
  const ShardingSolution s = shard_graph(moe.graph, 4, costs, {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal) << ilp_status_name(s.status);
  for (int v : experts) {
    const OpStrategy& chosen = s.chosen[size_t(v)];
    SCOPED_TRACE(fmt::format("{}: {}", moe.graph.node(v).name, chosen.name));
    ASSERT_EQ(chosen.weights.front().kind, Shard::Kind::split);
    EXPECT_EQ(chosen.weights.front().dim, 0);  // the experts
    EXPECT_DOUBLE_EQ(chosen.weight_elements, 8 * 32 * 128 / 4.0);
  }
}

}  // namespace
}  // namespace tessel::planner
