#include "tessel/planner/mesh_sharding.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tessel/core/error.h"
#include "tessel/planner/sharding_test_util.h"
#include "tessel/planner/transformer_graph.h"

namespace tessel::planner {
namespace {

// Hosts of 4 GPUs on NVLink (150 GB/s per GPU) joined by a 25 GB/s network per GPU; one
// GPT-2-style block of width 2048 (16 heads, 4 x 2048 MLP: W = 50.3M weights) in bf16; 8 samples
// of 2048 tokens (A = 2048 x 2048 x 2 bytes = 8.4 MB of activations each) on 2 x 4 devices. Per
// block, against the same compute, the two sensible layouts move:
//   Megatron within hosts, data across: 4 all-reduces of 4 samples' activations on NVLink,
//     4 x 1.5 x 4 A / 150 GB/s = 1.34 ms, and the 4-way split weights' gradients once over the
//     network, 2 W / 4 / 25 GB/s = 1.0 ms: 2.3 ms;
//   data within hosts, Megatron across: 4 all-reduces of 2 samples' activations over the network,
//     4 x 1 x 2 A / 25 GB/s = 2.7 ms, and the 2-way split weights' gradients on NVLink,
//     1.5 x 2 W / 2 / 150 GB/s = 0.5 ms: 3.2 ms;
// splitting the batch on both axes would send whole weights over the network (4 ms), and
// Megatron on both would all-reduce all 8 samples' activations across hosts. The programme,
// choosing per operator and axis together, finds the first.
TEST(MeshSharding, DataParallelAcrossHostsMegatronWithin) {
  auto m = model::ModelConfig::preset("gpt2-1.5b");
  m.n_layer = 1;
  m.n_embd = 2048;
  m.n_head = 16;
  m.n_kv_head = 16;
  m.ffn_hidden = 4 * 2048;
  m.max_seq_len = 2048;
  const OpGraph g = transformer_graph(m, 8, 2048);
  ShardingCosts nvlink = testing::nvlink_costs();
  nvlink.bytes_per_element = 2;
  ShardingCosts network = nvlink;
  network.bandwidth = 25e9;
  network.latency_s = 20e-6;
  const MeshCosts costs{Mesh{{2, 4}}, {network, nvlink}};
  const MeshSolution s = solve_mesh_sharding(g, costs, {.time_limit_s = 60});
  ASSERT_EQ(s.status, IlpStatus::optimal) << ilp_status_name(s.status);
  auto of = [&](const char* name) { return s.of(g, fmt::format("h.0.{}", name)).name; };
  EXPECT_EQ(of("attn.c_attn"), "batch(0) x column");
  EXPECT_EQ(of("attn.c_proj"), "batch(0) x row");
  EXPECT_EQ(of("mlp.c_fc"), "batch(0) x column");
  EXPECT_EQ(of("mlp.c_proj"), "batch(0) x row");
  EXPECT_EQ(of("qk"), "batch(0) x batch(1)");  // samples across hosts, heads within
}

// A mesh whose outer axis has one device is the one-axis programme: the same optimum.
TEST(MeshSharding, AnAxisOfOneIsTheOneAxisProgramme) {
  auto m = model::ModelConfig::preset("gpt2-124m");
  m.n_layer = 2;
  const OpGraph g = transformer_graph(m, 1, 256);
  const ShardingCosts nv = testing::nvlink_costs();
  const MeshSolution mesh =
      solve_mesh_sharding(g, MeshCosts{Mesh{{1, 4}}, {nv, nv}}, {.time_limit_s = 120});
  const ShardingSolution flat = solve_sharding(g, 4, nv, {.time_limit_s = 120});
  ASSERT_EQ(mesh.status, IlpStatus::optimal);
  ASSERT_EQ(flat.status, IlpStatus::optimal);
  EXPECT_NEAR(mesh.time_s, flat.time_s, 1e-9 * flat.time_s);

  EXPECT_THROW(solve_mesh_sharding(g, MeshCosts{Mesh{{2, 4}}, {nv}}), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner

namespace tessel::planner {
namespace {

// The decomposition at the critical nodes (a programme per segment and pair of boundary
// strategies, joined by dynamic programming, pairs skipped by their bounds) finds the whole
// programme's optimum on a mesh too: the segments meet only in the critical nodes, whose
// strategies the DP enumerates. Both programmes are solved to optimality (relative gap 0), so
// their objectives agree up to CBC's integrality and primal tolerances on microsecond terms
// (1e-6 relative covers them with room).
TEST(MeshSharding, SegmentsJoinedByDynamicProgrammingEqualTheWholeProgramme) {
  auto m = model::ModelConfig::preset("gpt2-124m");
  m.n_layer = 2;
  const OpGraph g = transformer_graph(m, 4, 256);
  ShardingCosts nvlink = testing::nvlink_costs();
  ShardingCosts network = nvlink;
  network.bandwidth = 25e9;
  network.latency_s = 20e-6;
  const MeshCosts costs{Mesh{{2, 2}}, {network, nvlink}};
  const MeshSolution whole = shard_mesh_graph(g, costs, {.time_limit_s = 120}, nullptr, g.size());
  GraphShardingStats st;
  const MeshSolution parts = shard_mesh_graph(g, costs, {.time_limit_s = 120}, &st, 0);
  ASSERT_EQ(whole.status, IlpStatus::optimal);
  ASSERT_EQ(parts.status, IlpStatus::optimal);
  EXPECT_GT(st.segments, 4);
  EXPECT_GT(st.pruned, 0);  // the bounds skipped pairs
  EXPECT_NEAR(parts.time_s, whole.time_s, 1e-6 * whole.time_s);
  fmt::print(
      "whole {:.6f} ms in {:.1f} s; {} segments, {} programmes, {} reused, {} pruned in "
      "{:.1f} s\n",
      whole.time_s * 1e3, whole.solve_s, st.segments, st.programmes, st.reused, st.pruned,
      st.seconds);
}

}  // namespace
}  // namespace tessel::planner
