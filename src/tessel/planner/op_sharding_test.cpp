#include "tessel/planner/op_sharding.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "tessel/core/error.h"
#include "tessel/planner/sharding_test_util.h"
#include "tessel/planner/transformer_graph.h"

namespace tessel::planner {
namespace {

using namespace testing;  // the emulated matrices (sharding_test_util.h)

std::map<std::string, OpStrategy> by_name(const std::vector<OpStrategy>& s) {
  std::map<std::string, OpStrategy> m;
  for (const auto& x : s) m.emplace(x.name, x);
  return m;
}

// x[M, K] W[K, N] on t devices under every strategy, and a head reading a table [N, K].
TEST(OpSharding, LinearStrategiesComputeTheProduct) {
  std::mt19937 rng(1);
  const int64_t M = 6, K = 12, N = 6;
  for (int t : {2, 3}) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE(fmt::format("t={} tied={}", t, tied));
      OpGraph g;
      const int x = g.add({.name = "x", .kind = OpKind::input, .shape = {M, K}});
      int table = -1;
      if (tied)
        table = g.add({.name = "table",
                       .kind = OpKind::gather,
                       .inputs = {x},
                       .shape = {M, K},
                       .weights = {{N, K}}});
      const int y = g.add({.name = "y",
                           .kind = OpKind::matmul,
                           .inputs = {x},
                           .shape = {M, N},
                           .weights = tied ? std::vector<std::vector<int64_t>>{}
                                           : std::vector<std::vector<int64_t>>{{K, N}},
                           .weights_of = table,
                           .flops = 2.0 * M * K * N});
      const auto strategies = op_strategies(g, y, t);
      const auto names = by_name(strategies);
      ASSERT_TRUE(names.contains("replicated"));
      ASSERT_TRUE(names.contains("column"));
      ASSERT_TRUE(names.contains("row"));
      ASSERT_TRUE(names.contains("batch(0)"));
      const Mat X = random_mat(M, K, rng);
      const Mat stored = tied ? random_mat(N, K, rng) : random_mat(K, N, rng);
      const Mat W = tied ? transpose(stored) : stored;
      const Mat want = matmul(X, W);
      for (const OpStrategy& s : strategies) {
        std::vector<Mat> parts;
        for (int i = 0; i < t; ++i) {
          const Mat w = part(stored, s.weights[0], i, t);
          parts.push_back(matmul(part(X, s.in[0], i, t), tied ? transpose(w) : w));
        }
        expect_equal(whole(parts, s.out), want, s.name);
        const double full = double(K * N);
        EXPECT_DOUBLE_EQ(s.weight_elements,
                         s.weights[0].kind == Shard::Kind::split ? full / t : full)
            << s.name;
        EXPECT_DOUBLE_EQ(s.flops, s.name == "replicated" ? 2.0 * M * K * N : 2.0 * M * K * N / t);
      }
    }
  }
}

// Stacked experts: x[E, M, K] W[E, K, N] -> y[E, M, N] (a mixture of experts' batched matmul),
// each 3-D tensor a list of E matrices. Splitting E gives each device its experts, weights and
// tokens alike; column, row and the token split act within every expert.
TEST(OpSharding, StackedExpertWeightsSplitTheirExperts) {
  using Stack = std::vector<Mat>;
  std::mt19937 rng(3);
  const int64_t E = 4, M = 4, K = 6, N = 6;
  const int t = 2;
  OpGraph g;
  const int x = g.add({.name = "x", .kind = OpKind::input, .shape = {E, M, K}});
  const int y = g.add({.name = "y",
                       .kind = OpKind::matmul,
                       .inputs = {x},
                       .shape = {E, M, N},
                       .weights = {{E, K, N}},
                       .flops = 2.0 * E * M * K * N});
  const auto strategies = op_strategies(g, y, t);
  const auto names = by_name(strategies);
  ASSERT_TRUE(names.contains("batch(0)"));
  EXPECT_EQ(names.at("batch(0)").weights[0], Shard::S(0));
  EXPECT_EQ(names.at("batch(1)").weights[0], Shard::R());
  EXPECT_EQ(names.at("column").weights[0], Shard::S(2));
  EXPECT_EQ(names.at("row").weights[0], Shard::S(1));
  Stack X, W, want;
  for (int64_t e = 0; e < E; ++e) {
    X.push_back(random_mat(M, K, rng));
    W.push_back(random_mat(K, N, rng));
    want.push_back(matmul(X.back(), W.back()));
  }
  // Device i's part of a stack in layout s: a split of dimension 0 takes experts, of 1 or 2 a
  // part of every expert's matrix (its dimension 0 or 1).
  auto part3 = [&](const Stack& m, const Shard& s, int i) {
    if (s.kind == Shard::Kind::split && s.dim == 0)
      return Stack(m.begin() + i * (E / t), m.begin() + (i + 1) * (E / t));
    Stack out;
    for (const Mat& a : m)
      out.push_back(s.kind == Shard::Kind::split ? part(a, Shard::S(s.dim - 1), i, t)
                                                 : part(a, s, i, t));
    return out;
  };
  for (const OpStrategy& st : strategies) {
    SCOPED_TRACE(st.name);
    std::vector<Stack> parts;
    for (int i = 0; i < t; ++i) {
      const Stack xs = part3(X, st.in[0], i), ws = part3(W, st.weights[0], i);
      ASSERT_EQ(xs.size(), ws.size());
      Stack ys;
      for (size_t e = 0; e < xs.size(); ++e) ys.push_back(matmul(xs[e], ws[e]));
      parts.push_back(ys);
    }
    Stack got;
    if (st.out.kind == Shard::Kind::split && st.out.dim == 0) {
      for (const Stack& p : parts) got.insert(got.end(), p.begin(), p.end());
    } else {
      const Shard inner = st.out.kind == Shard::Kind::split ? Shard::S(st.out.dim - 1) : st.out;
      for (int64_t e = 0; e < E; ++e) {
        std::vector<Mat> of_e;
        for (const Stack& p : parts) of_e.push_back(p[size_t(e)]);
        got.push_back(whole(of_e, inner));
      }
    }
    ASSERT_EQ(got.size(), size_t(E));
    for (int64_t e = 0; e < E; ++e) expect_equal(got[size_t(e)], want[size_t(e)], st.name);
    const double full = double(E * K * N);
    EXPECT_DOUBLE_EQ(st.weight_elements,
                     st.weights[0].kind == Shard::Kind::split ? full / t : full);
  }
}

// An operand broadcast along a batch dimension (size 1 there) is read whole when the batch
// splits it: the expert-choice MoE's dispatch [b, E, cap, t] x tokens [b, 1, t, C].
TEST(OpSharding, ABroadcastBatchDimensionIsReadWhole) {
  OpGraph g;
  const int dispatch = g.add({.name = "dispatch", .kind = OpKind::input, .shape = {2, 8, 4, 16}});
  const int tokens = g.add({.name = "tokens", .kind = OpKind::input, .shape = {2, 1, 16, 32}});
  const int y = g.add({.name = "y",
                       .kind = OpKind::matmul,
                       .inputs = {dispatch, tokens},
                       .shape = {2, 8, 4, 32},
                       .flops = 2.0 * 2 * 8 * 4 * 16 * 32});
  const auto names = by_name(op_strategies(g, y, 2));
  ASSERT_TRUE(names.contains("batch(1)"));
  EXPECT_EQ(names.at("batch(1)").in, (std::vector<Shard>{Shard::S(1), Shard::R()}));
  EXPECT_EQ(names.at("batch(0)").in, (std::vector<Shard>{Shard::S(0), Shard::S(0)}));
}

// q k^T (b given as [N, K]) and p v (b as [K, N]): batch-free 2-D cases of the contraction split.
TEST(OpSharding, ContractionOfTwoActivationsLeavesPartialSums) {
  std::mt19937 rng(2);
  for (bool transposed : {true, false}) {
    const int64_t M = 4, K = 6, N = 4;
    OpGraph g;
    const int a = g.add({.name = "a", .kind = OpKind::input, .shape = {M, K}});
    const int b = g.add(
        {.name = "b",
         .kind = OpKind::input,
         .shape = transposed ? std::vector<int64_t>{N + 1, K} : std::vector<int64_t>{K, N + 1}});
    const int y =
        g.add({.name = "y", .kind = OpKind::matmul, .inputs = {a, b}, .shape = {M, N + 1}});
    const auto names = by_name(op_strategies(g, y, 2));
    ASSERT_TRUE(names.contains("contraction"));
    const OpStrategy& s = names.at("contraction");
    const Mat A = random_mat(M, K, rng);
    const Mat B = transposed ? random_mat(N + 1, K, rng) : random_mat(K, N + 1, rng);
    std::vector<Mat> parts;
    for (int i = 0; i < 2; ++i) {
      const Mat bi = part(B, s.in[1], i, 2);
      parts.push_back(matmul(part(A, s.in[0], i, 2), transposed ? transpose(bi) : bi));
    }
    EXPECT_EQ(s.out, Shard::P());
    expect_equal(whole(parts, s.out), matmul(A, transposed ? transpose(B) : B), "contraction");
  }
}

// The embedding: vocab-parallel rows leave each device the rows it holds and zeros elsewhere,
// whose sum is the lookup; hidden-parallel columns leave the output split along C.
TEST(OpSharding, GatherStrategiesLookUpTheTable) {
  std::mt19937 rng(3);
  const int64_t V = 8, C = 6, M = 5;
  const std::vector<int> ids = {7, 0, 3, 3, 5};
  OpGraph g;
  const int x = g.add({.name = "ids", .kind = OpKind::input, .shape = {M}});
  const int e = g.add(
      {.name = "wte", .kind = OpKind::gather, .inputs = {x}, .shape = {M, C}, .weights = {{V, C}}});
  const Mat table = random_mat(V, C, rng);
  Mat want = zeros(M, C);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) want.at(m, c) = table.at(ids[size_t(m)], c);
  for (int t : {2}) {
    const auto names = by_name(op_strategies(g, e, t));
    for (const std::string name : {"vocab", "hidden"}) {
      ASSERT_TRUE(names.contains(name)) << name;
      const OpStrategy& s = names.at(name);
      std::vector<Mat> parts;
      for (int i = 0; i < t; ++i) {
        const Mat rows = part(table, s.weights[0], i, t);
        const int64_t offset = s.weights[0].dim == 0 ? i * rows.rows : 0;
        Mat y = zeros(M, rows.cols);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t r = ids[size_t(m)] - offset;
          if (r < 0 || r >= rows.rows) continue;
          for (int64_t c = 0; c < rows.cols; ++c) y.at(m, c) = rows.at(r, c);
        }
        parts.push_back(y);
      }
      expect_equal(whole(parts, s.out), want, name);
    }
  }
}

TEST(OpSharding, ElementwiseNormsAndLayoutOperators) {
  const auto m = model::ModelConfig::preset("gpt2-124m");
  const OpGraph g = transformer_graph(m, 4, 64);
  std::map<std::string, int> id;
  for (int i = 0; i < g.size(); ++i) id[g.node(i).name] = i;
  auto names = [&](const std::string& node, int t) {
    return by_name(op_strategies(g, id.at(node), t));
  };
  // A residual add: split along any dimension, or partial in and out (row-parallel outputs).
  auto add = names("h.0.residual_1", 4);
  for (const char* s : {"replicated", "split(0)", "split(1)", "split(2)", "partial"})
    EXPECT_TRUE(add.contains(s)) << s;
  // gelu is not linear: no partial. LayerNorm normalises the last dimension: no split there.
  EXPECT_FALSE(names("h.0.gelu", 4).contains("partial"));
  EXPECT_FALSE(names("h.0.ln_1", 4).contains("split(2)"));
  EXPECT_TRUE(names("h.0.ln_1", 4).contains("split(1)"));
  // Heads: a split of C (the hidden dimension) is a split of the heads dimension.
  const auto heads = names("h.0.heads.q", 4);
  ASSERT_TRUE(heads.contains("split(2)"));
  EXPECT_EQ(heads.at("split(2)").out, Shard::S(1));
  // 12 heads do not split 5 ways; the batch of 4 does not either.
  EXPECT_FALSE(names("h.0.heads.q", 5).contains("split(2)"));
  EXPECT_FALSE(names("h.0.ln_1", 5).contains("split(0)"));
  // The loss: vocab-parallel, with its small all-reduces.
  const auto loss = names("loss", 2);
  ASSERT_TRUE(loss.contains("vocab"));
  EXPECT_DOUBLE_EQ(loss.at("vocab").comm_bytes, 3 * 2.0 * 0.5 * 4 * 64 * 4);
  // One device: one strategy, all of it.
  const auto one = op_strategies(g, id.at("h.0.attn.c_attn"), 1);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_DOUBLE_EQ(one[0].weight_elements, 768.0 * 3 * 768 + 3 * 768);
  EXPECT_THROW(op_strategies(g, -1, 2), InvalidArgumentError);
  EXPECT_THROW(op_strategies(g, 0, 0), InvalidArgumentError);
}

TEST(OpSharding, ReshardCostsAreTheRingCollectives) {
  const double B = 1000;
  EXPECT_EQ(reshard(Shard::S(1), Shard::S(1), B, 4).collective, "");
  EXPECT_EQ(reshard(Shard::R(), Shard::S(0), B, 4).collective, "");
  EXPECT_EQ(reshard(Shard::S(0), Shard::P(), B, 4).collective, "");
  const Reshard ag = reshard(Shard::S(0), Shard::R(), B, 4);
  EXPECT_EQ(ag.collective, "all-gather");
  EXPECT_DOUBLE_EQ(ag.bytes_per_device, 750);
  const Reshard rs = reshard(Shard::P(), Shard::S(2), B, 4);
  EXPECT_EQ(rs.collective, "reduce-scatter");
  EXPECT_DOUBLE_EQ(rs.bytes_per_device, 750);
  const Reshard ar = reshard(Shard::P(), Shard::R(), B, 4);
  EXPECT_EQ(ar.collective, "all-reduce");
  EXPECT_DOUBLE_EQ(ar.bytes_per_device, 1500);
  const Reshard a2a = reshard(Shard::S(0), Shard::S(1), B, 4);
  EXPECT_EQ(a2a.collective, "all-to-all");
  EXPECT_DOUBLE_EQ(a2a.bytes_per_device, 187.5);
  EXPECT_EQ(reshard(Shard::P(), Shard::R(), B, 1).collective, "");
}

}  // namespace
}  // namespace tessel::planner
