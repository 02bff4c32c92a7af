#include "tessel/planner/mesh_strategies.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "tessel/core/error.h"
#include "tessel/planner/sharding_test_util.h"

namespace tessel::planner {
namespace {

using namespace testing;  // the emulated matrices

// x[M, K] W[K, N] on meshes of 2 x 2 and 2 x 3 under every mesh strategy: device (i, j) takes
// part i of each operand along axis 0's layout and part j of that along axis 1's, multiplies, and
// the products read back axis 1 first, then axis 0, give x W. Checks the composition rule (outer
// axis first), the per-device FLOPs and weight elements, and which combinations exist.
TEST(MeshStrategies, AMatmulOnTwoAxesComputesTheProduct) {
  std::mt19937 rng(5);
  const int64_t M = 12, K = 12, N = 6;
  for (const Mesh& mesh : {Mesh{{2, 2}}, Mesh{{2, 3}}}) {
    SCOPED_TRACE(fmt::format("mesh {} x {}", mesh.sizes[0], mesh.sizes[1]));
    OpGraph g;
    const int x = g.add({.name = "x", .kind = OpKind::input, .shape = {M, K}});
    const int y = g.add({.name = "y",
                         .kind = OpKind::matmul,
                         .inputs = {x},
                         .shape = {M, N},
                         .weights = {{K, N}},
                         .flops = 2.0 * M * K * N});
    const auto strategies = mesh_strategies(g, y, mesh);
    std::set<std::string> names;
    for (const auto& s : strategies) names.insert(s.name);
    // Data parallel outside, Megatron inside; and the batch cut on both axes (12 rows divide
    // by 4 and by 6).
    EXPECT_TRUE(names.contains("batch(0) x column"));
    EXPECT_TRUE(names.contains("batch(0) x row"));
    EXPECT_TRUE(names.contains("batch(0) x batch(0)"));
    EXPECT_TRUE(names.contains("replicated x replicated"));
    // N = 6 columns cut by 2 then by 3: 6 parts of 1 divide; by 2 then by 2: 4 do not.
    EXPECT_EQ(names.contains("column x column"), mesh.sizes[1] == 3);
    const Mat X = random_mat(M, K, rng);
    const Mat W = random_mat(K, N, rng);
    const Mat want = matmul(X, W);
    const int d0 = mesh.sizes[0], d1 = mesh.sizes[1];
    for (const MeshStrategy& s : strategies) {
      SCOPED_TRACE(s.name);
      std::vector<Mat> outer;
      for (int i = 0; i < d0; ++i) {
        std::vector<Mat> inner;
        for (int j = 0; j < d1; ++j) {
          const Mat xs = part(part(X, s.axis[0].in[0], i, d0), s.axis[1].in[0], j, d1);
          const Mat ws = part(part(W, s.axis[0].weights[0], i, d0), s.axis[1].weights[0], j, d1);
          inner.push_back(matmul(xs, ws));
        }
        outer.push_back(whole(inner, s.axis[1].out));
      }
      expect_equal(whole(outer, s.axis[0].out), want, s.name);
      // Each split axis divides the work and the weight.
      int work = 1, weight = 1;
      for (size_t a = 0; a < 2; ++a) {
        if (s.axis[a].name != "replicated") work *= mesh.sizes[a];
        if (s.axis[a].weights[0].kind == Shard::Kind::split) weight *= mesh.sizes[a];
      }
      EXPECT_DOUBLE_EQ(s.flops, 2.0 * M * K * N / work);
      EXPECT_DOUBLE_EQ(s.weight_elements, double(K * N) / weight);
    }
  }
}

// One axis: exactly op_sharding's strategies.
TEST(MeshStrategies, OneAxisIsTheOneAxisStrategies) {
  OpGraph g;
  const int x = g.add({.name = "x", .kind = OpKind::input, .shape = {8, 16, 32}});
  const int y = g.add({.name = "y",
                       .kind = OpKind::matmul,
                       .inputs = {x},
                       .shape = {8, 16, 64},
                       .weights = {{32, 64}},
                       .flops = 2.0 * 8 * 16 * 32 * 64});
  const auto one = mesh_strategies(g, y, Mesh{{4}});
  const auto flat = op_strategies(g, y, 4);
  ASSERT_EQ(one.size(), flat.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(one[i].name, flat[i].name);
    EXPECT_DOUBLE_EQ(one[i].flops, flat[i].flops);
    EXPECT_DOUBLE_EQ(one[i].weight_elements, flat[i].weight_elements);
  }
}

// Axis by axis, on what each device holds: gathering axis 0's rows of a tensor whose columns
// axis 1 splits moves a quarter as much per group as the whole tensor.
TEST(MeshStrategies, ReshardsGoAxisByAxisOnWhatEachDeviceHolds) {
  const Mesh mesh{{2, 4}};
  const double bytes = 1 << 20;
  auto r = mesh_reshard({Shard::S(0), Shard::R()}, {Shard::R(), Shard::R()}, bytes, mesh);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].collective, "all-gather");
  EXPECT_DOUBLE_EQ(r[0].bytes_per_device, 0.5 * bytes);
  EXPECT_EQ(r[1].collective, "");
  r = mesh_reshard({Shard::S(0), Shard::S(1)}, {Shard::R(), Shard::S(1)}, bytes, mesh);
  EXPECT_EQ(r[0].collective, "all-gather");
  EXPECT_DOUBLE_EQ(r[0].bytes_per_device, 0.5 * bytes / 4);
  // Both axes change: gathering axis 0 first moves a quarter of the tensor per device on axis 0
  // (axis 1 still splits it) and then all of it on axis 1; axis 1 first, half on each.
  const auto first0 =
      mesh_reshard({Shard::S(0), Shard::S(1)}, {Shard::R(), Shard::R()}, bytes, mesh, 0);
  EXPECT_DOUBLE_EQ(first0[0].bytes_per_device, 0.5 * bytes / 4);
  EXPECT_DOUBLE_EQ(first0[1].bytes_per_device, 0.75 * bytes);
  const auto first1 =
      mesh_reshard({Shard::S(0), Shard::S(1)}, {Shard::R(), Shard::R()}, bytes, mesh, 1);
  EXPECT_DOUBLE_EQ(first1[1].bytes_per_device, 0.75 * bytes / 2);
  EXPECT_DOUBLE_EQ(first1[0].bytes_per_device, 0.5 * bytes);
  // Megatron's row output summed within the host, the batch split kept across hosts.
  r = mesh_reshard({Shard::S(0), Shard::P()}, {Shard::S(0), Shard::R()}, bytes, mesh);
  EXPECT_EQ(r[0].collective, "");
  EXPECT_EQ(r[1].collective, "all-reduce");
  EXPECT_DOUBLE_EQ(r[1].bytes_per_device, 2 * 0.75 * bytes / 2);

  EXPECT_THROW(mesh_reshard({Shard::R()}, {Shard::R(), Shard::R()}, bytes, mesh),
               InvalidArgumentError);
  OpGraph g;
  g.add({.name = "x", .kind = OpKind::input, .shape = {8}});
  EXPECT_THROW(mesh_strategies(g, 0, Mesh{{2, 2, 2}}), InvalidArgumentError);
  EXPECT_THROW(mesh_strategies(g, 0, Mesh{{0}}), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::planner
