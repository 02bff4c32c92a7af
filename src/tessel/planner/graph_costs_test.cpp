#include "tessel/planner/graph_costs.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/planner/graph_sharding.h"
#include "tessel/planner/transformer_graph.h"

namespace tessel::planner {
namespace {

int id_of(const OpGraph& g, const std::string& name) {
  for (int v = 0; v < g.size(); ++v)
    if (g.node(v).name == name) return v;
  ADD_FAILURE() << "no node " << name;
  return 0;
}

// A two-block LLaMA-2 7B at 2048 tokens, tp 2 on a DGX A100, under the sharding the programme
// chooses (Megatron-LM's: sharding_ilp_test). Every time below is rebuilt from the rules of
// graph_costs.h and the cluster's rates, so a rule that changes fails here.
class LlamaTp2 : public ::testing::Test {
 protected:
  void SetUp() override {
    model = model::ModelConfig::preset("llama2-7b");
    model.n_layer = 2;
    g = transformer_graph(model, 1, kSeq);
    s = shard_graph(g, kT, sharding_costs(cluster, Precision::bf16), {.time_limit_s = 60});
    ASSERT_EQ(s.status, IlpStatus::optimal);
    times = operator_times(g, s, kT, cluster, Precision::bf16);
  }
  const PassTimes& at(const std::string& name) { return times[size_t(id_of(g, name))]; }
  double gemm(const GemmShape& shape) const {
    return cluster.device.gemm_seconds(shape, Precision::bf16);
  }
  double stream(double elements) const { return elements * 2 / cluster.device.memory_bandwidth; }
  // One all-reduce of the residual stream (2048 x 4096 bf16, 16 MiB) over the 2 devices, as the
  // programme's rates cost it: 2 (t - 1) / t of the bytes over the NVLink's measured bus bandwidth
  // for a message of that size (cluster.h).
  double all_reduce() const {
    const double bytes = kTokens * 4096 * 2;
    return 2.0 * (kT - 1) / kT * bytes / bus_bandwidth(cluster.intra_host.bus_curve, bytes);
  }

  static constexpr int kT = 2, kSeq = 2048;
  static constexpr double kTokens = kSeq;
  ClusterSpec cluster = ClusterSpec::preset("dgx-a100");
  model::ModelConfig model;
  OpGraph g;
  ShardingSolution s;
  std::vector<PassTimes> times;
};

TEST_F(LlamaTp2, MatmulsTakeOneGemmPerPassAndAttentionTwoInItsBackward) {
  // Column-parallel q_proj: 2048 tokens x half of 4096 outputs over 4096 inputs; its input
  // gradient (2048 x 4096 over 2048) and weight gradient (4096 x 2048 over the tokens), each by
  // its shape (the A100's model, gemm_model.h).
  EXPECT_EQ(s.of(g, "h.0.self_attn.q_proj").name, "column");
  EXPECT_DOUBLE_EQ(at("h.0.self_attn.q_proj").forward, gemm({kTokens, 4096 / kT, 4096}));
  EXPECT_DOUBLE_EQ(at("h.0.self_attn.q_proj").backward_input, gemm({kTokens, 4096, 4096 / kT}));
  EXPECT_DOUBLE_EQ(at("h.0.self_attn.q_proj").backward_weight, gemm({4096, 4096 / kT, kTokens}));
  // Q K^T over half of the 32 heads: a batch of 16 GEMMs of 2048 x 2048 over 128; its backward
  // both operands' gradients.
  const GemmShape qk{kSeq, kSeq, 128, 32 / kT};
  EXPECT_DOUBLE_EQ(at("h.0.qk").forward, gemm(qk));
  EXPECT_DOUBLE_EQ(at("h.0.qk").backward_input,
                   gemm({kSeq, 128, kSeq, 32 / kT}) + gemm({128, kSeq, kSeq, 32 / kT}));
  EXPECT_EQ(at("h.0.qk").backward_weight, 0);
  // The scale by 1/sqrt(d) is fused into the softmax; the softmax streams half the scores.
  EXPECT_EQ(at("h.0.scale").forward, 0);
  const double scores = 32.0 * kSeq * kSeq / kT;
  EXPECT_DOUBLE_EQ(at("h.0.softmax").forward, stream(2 * scores));
  EXPECT_DOUBLE_EQ(at("h.0.softmax").backward_input, stream(4 * scores));
}

// Megatron-LM's communication: the row-parallel output's partial sums are all-reduced once in
// the forward, and the norm whose output the q, k and v projections all read sums their three
// partial input gradients locally and all-reduces once in the backward -- not three times.
// The forward's all-reduce is either the residual add's (into a replicated residual stream) or
// the next norm's (the add keeping the sum's terms apart, the skip connection's on one device):
// equal optima, and which one CBC returns depends on its search, so the test takes the pair.
TEST_F(LlamaTp2, ABlockAllReducesOncePerDirectionAtEachHalf) {
  const double residual = kTokens * 4096;
  EXPECT_EQ(s.of(g, "h.0.self_attn.o_proj").name, "row");
  EXPECT_DOUBLE_EQ(at("h.0.residual_1").forward + at("h.0.post_attention_layernorm").forward,
                   stream(3 * residual) + stream(2 * residual) + all_reduce());
  EXPECT_DOUBLE_EQ(at("h.0.input_layernorm").forward, stream(2 * residual));
  EXPECT_DOUBLE_EQ(at("h.0.input_layernorm").backward_input, stream(4 * residual) + all_reduce());
}

// The mesh's costing (node_work and node_comm over the mesh's space) on a mesh whose outer axis
// has one device is the one axis's: the same strategies, expressed as "replicated x <strategy>",
// cost every operator the same in every pass, and sync the same weights.
TEST_F(LlamaTp2, AMeshWithAnOuterAxisOfOneDeviceCostsAsTheOneAxis) {
  const Mesh mesh{{1, kT}};
  const ShardingCosts rates = sharding_costs(cluster, Precision::bf16);
  const MeshCosts costs{mesh, {rates, rates}};
  MeshSolution on_mesh;
  for (int v = 0; v < g.size(); ++v) {
    const auto all = mesh_strategies(g, v, mesh);
    int at = -1;
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i].axis[0].name == "replicated" && all[i].axis[1].name == s.chosen[size_t(v)].name)
        at = int(i);
    ASSERT_GE(at, 0) << g.node(v).name << " " << s.chosen[size_t(v)].name;
    on_mesh.index.push_back(at);
    on_mesh.chosen.push_back(all[size_t(at)]);
  }
  std::vector<double> sync, mesh_sync;
  const auto flat = operator_times(g, s, kT, cluster, Precision::bf16, &sync);
  const auto meshed = operator_times(g, on_mesh, costs, cluster, Precision::bf16, &mesh_sync);
  for (int v = 0; v < g.size(); ++v) {
    SCOPED_TRACE(g.node(v).name);
    EXPECT_DOUBLE_EQ(meshed[size_t(v)].forward, flat[size_t(v)].forward);
    EXPECT_DOUBLE_EQ(meshed[size_t(v)].backward_input, flat[size_t(v)].backward_input);
    EXPECT_DOUBLE_EQ(meshed[size_t(v)].backward_weight, flat[size_t(v)].backward_weight);
    EXPECT_DOUBLE_EQ(mesh_sync[size_t(v)], sync[size_t(v)]);
  }
}

TEST_F(LlamaTp2, StagesSumTheirOperatorsAndCarryTheResidualStream) {
  // Stage 0: everything through the first block; stage 1: the rest.
  std::vector<int> stage(size_t(g.size()), 0);
  bool second = false;
  for (int v : g.validate()) {
    second = second || g.node(v).layer == 1;
    stage[size_t(v)] = second ? 1 : 0;
  }
  const auto stages = graph_stage_costs(g, s, times, stage, 2, kT, Precision::bf16);
  ASSERT_EQ(stages.size(), 2u);
  double f0 = 0, bw1 = 0;
  for (int v = 0; v < g.size(); ++v) {
    if (stage[size_t(v)] == 0) f0 += times[size_t(v)].forward;
    if (stage[size_t(v)] == 1) bw1 += times[size_t(v)].backward_weight;
  }
  EXPECT_DOUBLE_EQ(stages[0].forward, f0);
  EXPECT_DOUBLE_EQ(stages[1].backward_weight, bw1);
  EXPECT_DOUBLE_EQ(stages[1].backward, stages[1].backward_input + stages[1].backward_weight);
  // One residual stream, whole on every device (bf16), crosses; nothing leaves the last stage.
  EXPECT_DOUBLE_EQ(stages[0].output_bytes, kTokens * 4096 * 2);
  EXPECT_EQ(stages[1].output_bytes, 0);
  EXPECT_GT(stages[0].activation_bytes, 0);

  EXPECT_THROW(graph_stage_costs(g, s, times, stage, 1, kT, Precision::bf16), InvalidArgumentError);
  EXPECT_THROW(graph_stage_costs(g, s, {}, stage, 2, kT, Precision::bf16), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner
