#include "tessel/planner/cost_model.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tessel/core/error.h"

namespace tessel::planner {
namespace {

// A device with round numbers and no memory-bandwidth term, so times are the GEMM terms alone.
ClusterSpec simple_cluster(int hosts = 1, int per_host = 8) {
  ClusterSpec c;
  c.name = "test";
  c.hosts = hosts;
  c.devices_per_host = per_host;
  c.device.name = "dev";
  c.device.peak_flops = {1e12, 1e12, 1e12};
  c.device.memory_bytes = int64_t(1) << 34;
  c.device.gemm = EfficiencyCurve{0.5, 1e-5};
  c.intra_host = LinkSpec{100e9, 1e-5, 0, 0, {}};
  c.inter_host = LinkSpec{10e9, 2e-5, 0, 0, {}};
  return c;
}

model::ModelConfig gpt2_124m() {
  return model::ModelConfig::preset("gpt2-124m");
}

TEST(CostModel, BlockFlopsMatchHandCounts) {
  // gpt2-124m, b = 2, s = 64: n = 128 tokens, h = 768, F = 4h.
  // GEMMs 24 n h^2 = 24 * 128 * 768^2; attention 4 n s h = 4 * 128 * 64 * 768.
  const auto f = block_forward_flops(gpt2_124m(), 2, 64, 1);
  EXPECT_DOUBLE_EQ(f.gemm, 1811939328.0);
  EXPECT_DOUBLE_EQ(f.attention, 25165824.0);
  EXPECT_EQ(f.gemm_calls, 4);
  EXPECT_EQ(f.attention_calls, 2);
  const auto half = block_forward_flops(gpt2_124m(), 2, 64, 2);
  EXPECT_DOUBLE_EQ(half.gemm, 1811939328.0 / 2);
  EXPECT_DOUBLE_EQ(half.attention, 25165824.0 / 2);
}

TEST(CostModel, LlamaFlopsWithGroupedKvHeads) {
  // llama3-8b: h 4096, F 14336, 8 kv heads of D = 128. b = 1, s = 128 (n = 128).
  const auto m = model::ModelConfig::preset("llama3-8b");
  // tp 2: 4 kv heads per rank: 2n (2h^2/2 + 2 h 4D + 3hF/2).
  EXPECT_DOUBLE_EQ(block_forward_flops(m, 1, 128, 2).gemm, 27917287424.0);
  // tp 16 > 8 kv heads: each rank computes the one kv head its queries use: 2n (2h^2/16 + 2hD +
  // 3hF/16).
  EXPECT_DOUBLE_EQ(block_forward_flops(m, 1, 128, 16).gemm, 3623878656.0);
  EXPECT_EQ(block_forward_flops(m, 1, 128, 16).gemm_calls, 7);
}

TEST(CostModel, ModelFlopsAreMegatronsFormula) {
  // Forward + backward per sample: 72 s L h^2 (1 + s / (6h) + V / (12 L h)).
  const auto m = model::ModelConfig::preset("gpt3-175b");
  const double s = 2048, L = m.n_layer, h = m.n_embd, V = m.padded_vocab();
  const double megatron = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h));
  EXPECT_NEAR(model_flops_per_sample(m, 2048) / megatron, 1.0, 1e-12);
  const auto head = head_forward_flops(m, 1, 2048, 8);
  EXPECT_DOUBLE_EQ(head.gemm, 2.0 * 2048 * 12288 * 50304 / 8);
}

TEST(CostModel, BlockTimesFromTheEfficiencyCurve) {
  const CostModel cm(gpt2_124m(), simple_cluster(), CostOptions{Precision::fp32});
  const PassTimes t = cm.block_compute(2, 64, 1);
  // Per call: flops / (1e12 * 0.5) + 1e-5 / 0.5. Forward: 4 GEMM calls + 2 attention calls.
  // forward        = 1811939328 / 5e11 + 4 * 2e-5 + 25165824 / 5e11 + 2 * 2e-5
  // backward_input = 1811939328 / 5e11 + 4 * 2e-5 + 2 * 25165824 / 5e11 + 4 * 2e-5
  // backward_weight= 1811939328 / 5e11 + 4 * 2e-5
  EXPECT_NEAR(t.forward, 0.003794210304, 1e-15);
  EXPECT_NEAR(t.backward_input, 0.003884541952, 1e-15);
  EXPECT_NEAR(t.backward_weight, 0.003703878656, 1e-15);
  EXPECT_DOUBLE_EQ(t.recompute, t.forward);
  EXPECT_DOUBLE_EQ(t.step(false), t.forward + t.backward_input + t.backward_weight);
  EXPECT_DOUBLE_EQ(t.step(true), t.step(false) + t.forward);
  // The embedding has no FLOPs; without a memory-bandwidth figure it is free.
  EXPECT_EQ(cm.embedding_compute(2, 64, 1).step(false), 0);
}

// The GEMMs by shape are the FLOPs counted above, call by call: GPT-2's four linear layers, and
// LLaMA's seven with grouped kv heads, at tp 1, 2 and 16 (replicated kv heads), plus attention's
// two batched GEMMs. (Sums of a handful of exact products of integers below 2^53: equal.)
TEST(CostModel, BlockGemmsByShapeAreTheCountedFlops) {
  for (const auto& m : {gpt2_124m(), model::ModelConfig::preset("llama3-8b")}) {
    for (int tp : {1, 2, 16}) {
      if (m.n_head % tp != 0) continue;
      const auto f = block_forward_flops(m, 2, 128, tp);
      const auto g = block_gemms(m, 2, 128, tp);
      double linear = 0, attention = 0;
      for (const auto& s : g.linear) linear += s.flops();
      for (const auto& s : g.attention) attention += s.flops();
      EXPECT_EQ(int(g.linear.size()), f.gemm_calls) << m.name << " tp " << tp;
      EXPECT_EQ(int(g.attention.size()), f.attention_calls);
      EXPECT_DOUBLE_EQ(linear, f.gemm) << m.name << " tp " << tp;
      EXPECT_DOUBLE_EQ(attention, f.attention) << m.name << " tp " << tp;
    }
  }
}

// On an A100 in bf16 each call is timed by its shape (gemm_model.h), the passes being the forward
// GEMMs, their input gradients (attention: both operands'), and the weights' gradients; fp32 has
// no measurements behind the shape model and keeps the curve.
TEST(CostModel, TheA100TimesEachGemmByItsShape) {
  const auto cluster = ClusterSpec::preset("dgx-a100");
  ASSERT_TRUE(cluster.device.shape.defined());
  const auto m = gpt2_124m();
  const CostModel cm(m, cluster, CostOptions{Precision::bf16});
  const auto g = block_gemms(m, 4, 1024, 2);
  double bw = 0;
  for (const auto& s : g.linear)
    bw += cluster.device.gemm_seconds(weight_gradient_gemm(s), Precision::bf16);
  EXPECT_DOUBLE_EQ(cm.block_compute(4, 1024, 2).backward_weight, bw);
  // A shape the curve cannot tell apart: the same FLOPs as one square GEMM, but 64 columns wide.
  const auto& d = cluster.device;
  const double square = d.gemm_seconds({4096, 4096, 4096}, Precision::bf16);
  const double skinny = d.gemm_seconds({4096 * 64, 64, 4096}, Precision::bf16);
  EXPECT_GT(skinny, 1.5 * square);
  EXPECT_DOUBLE_EQ(d.gemm_seconds({4096, 4096, 4096}, Precision::fp32),
                   d.gemm.gemm_time(2.0 * 4096 * 4096 * 4096, d.peak(Precision::fp32)));
}

TEST(CostModel, LargerGemmsRunCloserToPeak) {
  const CostModel cm(gpt2_124m(), simple_cluster(), CostOptions{Precision::fp32});
  // Time per sample falls as the micro-batch grows: the per-call overhead is shared.
  double last = 1e30;
  for (int64_t b : {1, 2, 4, 8, 16}) {
    const double per_sample = cm.block_compute(b, 64, 1).step(false) / double(b);
    EXPECT_LT(per_sample, last) << b;
    last = per_sample;
  }
}

TEST(CostModel, MemoryBoundTerms) {
  ClusterSpec c = simple_cluster();
  const CostModel base(gpt2_124m(), c, CostOptions{Precision::bf16});
  c.device.memory_bandwidth = 1e12;
  const CostModel with_bw(gpt2_124m(), c, CostOptions{Precision::bf16});
  // Head forward streams the final norm (2 n h elements, 2 bytes) and fp32 logits (2 n V / t).
  const double n = 4 * 64, h = 768, V = 50304;
  const double head_extra =
      with_bw.head_compute(4, 64, 2).forward - base.head_compute(4, 64, 2).forward;
  EXPECT_NEAR(head_extra, (2 * n * h * 2 + 2 * n * V / 2 * 4) / 1e12, 1e-15);
  // Block forward: 10 n h + 2 n F / t + 2 n s a / t elements of 2 bytes.
  const double block_extra =
      with_bw.block_compute(4, 64, 2).forward - base.block_compute(4, 64, 2).forward;
  EXPECT_NEAR(block_extra, (10 * n * h + 2 * n * 3072 / 2 + 2 * n * 64 * 12 / 2) * 2 / 1e12, 1e-15);
  // Backward streams twice the forward's elements.
  const double back_extra =
      with_bw.block_compute(4, 64, 2).backward_input - base.block_compute(4, 64, 2).backward_input;
  EXPECT_NEAR(back_extra, 2 * block_extra, 1e-15);
  // Adam: 28 bytes + the gradient per parameter.
  EXPECT_NEAR(with_bw.optimizer_step(1e9), 1e9 * 30 / 1e12, 1e-15);
  EXPECT_EQ(base.optimizer_step(1e9), 0);
}

TEST(CostModel, RingCollectives) {
  const GroupLink link{100e9, 1e-5, false, {}};
  EXPECT_NEAR(CostModel::all_reduce_time(1e9, 8, link), 2.0 * 7 / 8 * 1e9 / 100e9 + 1e-5, 1e-15);
  EXPECT_NEAR(CostModel::reduce_scatter_time(1e9, 8, link), 7.0 / 8 * 1e9 / 100e9 + 1e-5, 1e-15);
  EXPECT_EQ(CostModel::all_reduce_time(1e9, 1, link), 0);
}

TEST(CostModel, TensorParallelAllReducesInEveryPass) {
  const CostModel cm(gpt2_124m(), simple_cluster(), CostOptions{Precision::bf16});
  // One all-reduce of n h bf16 over 2 ranks on the host link: 2 (1/2) S / 100e9 + 1e-5.
  const double S = 2.0 * 64 * 768 * 2;
  const double ar = S / 100e9 + 1e-5;
  EXPECT_NEAR(cm.tp_all_reduce(2, 64, 2), ar, 1e-15);
  const PassTimes with = cm.block(2, 64, 2), without = cm.block_compute(2, 64, 2);
  EXPECT_NEAR(with.forward - without.forward, 2 * ar, 1e-15);
  EXPECT_NEAR(with.backward_input - without.backward_input, 2 * ar, 1e-15);
  EXPECT_NEAR(with.recompute - without.recompute, 2 * ar, 1e-15);
  EXPECT_EQ(with.backward_weight, without.backward_weight);
  EXPECT_NEAR(cm.embedding(2, 64, 2).forward - cm.embedding_compute(2, 64, 2).forward, ar, 1e-15);
  EXPECT_NEAR(cm.head(2, 64, 2).backward_input - cm.head_compute(2, 64, 2).backward_input, ar,
              1e-15);
  // tp 1: no communication.
  EXPECT_EQ(cm.block(2, 64, 1).forward, cm.block_compute(2, 64, 1).forward);
  EXPECT_EQ(cm.unit(0, 2, 64, 1).forward, cm.embedding(2, 64, 1).forward);
  EXPECT_EQ(cm.unit(13, 2, 64, 1).forward, cm.head(2, 64, 1).forward);
  EXPECT_THROW(cm.unit(14, 2, 64, 1), InvalidArgumentError);
}

TEST(CostModel, GroupLinksFollowHosts) {
  // 16 hosts of 8: inter-host 10 GB/s per device, intra 100 GB/s.
  const CostModel cm(gpt2_124m(), simple_cluster(16, 8), CostOptions{Precision::bf16});
  EXPECT_FALSE(cm.tp_link(8).cross_host);
  EXPECT_DOUBLE_EQ(cm.tp_link(8).bandwidth, 100e9);
  // dp 2 x tp 4 = one host.
  EXPECT_FALSE(cm.dp_link(2, 4).cross_host);
  // dp 8 x tp 4 spans 4 hosts with 2 members each: 2 NICs' worth.
  EXPECT_TRUE(cm.dp_link(8, 4).cross_host);
  EXPECT_DOUBLE_EQ(cm.dp_link(8, 4).bandwidth, 20e9);
  EXPECT_DOUBLE_EQ(cm.dp_link(8, 4).latency, 2e-5);
  // dp 16 x tp 1: 8 members per host, capped by the host link.
  EXPECT_DOUBLE_EQ(cm.dp_link(16, 1).bandwidth, 80e9);
  // Pipelines of more than one host send across hosts.
  EXPECT_FALSE(cm.pp_link(8).cross_host);
  EXPECT_TRUE(cm.pp_link(16).cross_host);
  EXPECT_NEAR(cm.p2p(1, 64, 16), 64.0 * 768 * 2 / 10e9 + 2e-5, 1e-15);
}

TEST(CostModel, DataParallelSyncAndOverlap) {
  const CostModel cm(gpt2_124m(), simple_cluster(4, 8), CostOptions{Precision::bf16, 0.8});
  const GroupLink l = cm.dp_link(4, 8);  // one member per host: 10 GB/s
  ASSERT_DOUBLE_EQ(l.bandwidth, 10e9);
  const double params = 1e8, bytes = 2e8;
  const auto z0 = cm.dp_sync(params, 4, 8, 0);
  EXPECT_NEAR(z0.overlappable, 2 * 0.75 * bytes / 10e9 + 2e-5, 1e-15);
  EXPECT_EQ(z0.exposed, 0);
  const auto z1 = cm.dp_sync(params, 4, 8, 1);
  EXPECT_NEAR(z1.overlappable, 0.75 * bytes / 10e9 + 2e-5, 1e-15);  // reduce-scatter
  EXPECT_NEAR(z1.exposed, 0.75 * bytes / 10e9 + 2e-5, 1e-15);       // all-gather
  // Up to 80% hides behind a long enough backward; nothing behind none.
  EXPECT_NEAR(cm.dp_exposed(z0, 10.0), 0.2 * z0.overlappable, 1e-15);
  EXPECT_NEAR(cm.dp_exposed(z0, 0.0), z0.overlappable, 1e-15);
  EXPECT_NEAR(cm.dp_exposed(z0, 0.01), z0.overlappable - 0.01, 1e-15);
  EXPECT_NEAR(cm.dp_exposed(z1, 10.0), z1.exposed + 0.2 * z1.overlappable, 1e-15);
  EXPECT_EQ(cm.dp_sync(params, 1, 8, 0).overlappable, 0);
  // Tied embedding: V h / t bf16 between two ranks on different hosts.
  EXPECT_NEAR(cm.tied_embedding_sync(8, 4, 32), 50304.0 * 768 / 8 * 2 / 10e9 + 2e-5, 1e-15);
  EXPECT_EQ(cm.tied_embedding_sync(8, 1, 32), 0);
}

TEST(CostModel, NeedsAPeakForThePrecision) {
  ClusterSpec c = simple_cluster();
  c.device.peak_flops = {1e12, 0, 0};
  EXPECT_THROW(CostModel(gpt2_124m(), c, CostOptions{Precision::bf16}), ConfigError);
  EXPECT_NO_THROW(CostModel(gpt2_124m(), c, CostOptions{Precision::fp32}));
}

nlohmann::json layer_times() {
  return nlohmann::json::parse(R"({"layer_times": {"seq": 64, "tp": 1, "points": [
    {"micro_batch": 4, "forward_s": 0.4, "backward_s": 0.8,
     "embedding_forward_s": 0.01, "embedding_backward_s": 0.02,
     "head_forward_s": 0.2, "head_backward_s": 0.4},
    {"micro_batch": 2, "forward_s": 0.25, "backward_input_s": 0.25, "backward_weight_s": 0.25,
     "backward_s": 0.5, "embedding_forward_s": 0.005, "embedding_backward_s": 0.01,
     "head_forward_s": 0.1, "head_backward_s": 0.2}]}})");
}

TEST(CostModel, ProfileInterpolates) {
  const auto m = gpt2_124m();
  const ComputeProfile p = compute_profile_from_json(layer_times(), m);
  ASSERT_EQ(p.points.size(), 2u);
  EXPECT_EQ(p.points[0].micro_batch, 2);  // sorted
  // Measured split kept; otherwise split in the analytic ratio (GEMMs + 2 x attention) : GEMMs.
  EXPECT_DOUBLE_EQ(p.points[0].block.backward_input, 0.25);
  const double g = 24.0 * 64 * 768 * 768, a = 4.0 * 64 * 64 * 768;
  EXPECT_NEAR(p.points[1].block.backward_input, 0.8 * (g + 2 * a) / (2 * g + 2 * a), 1e-12);
  EXPECT_DOUBLE_EQ(p.points[1].block.recompute, 0.4);
  EXPECT_DOUBLE_EQ(p.points[1].embedding.backward_weight, 0.02);
  EXPECT_DOUBLE_EQ(p.points[1].head.backward_input, 0.2);
  // Between points: linear. Below: proportional. Above: along the last segment.
  EXPECT_NEAR(p.at(3).block.forward, 0.325, 1e-12);
  EXPECT_NEAR(p.at(1).block.forward, 0.125, 1e-12);
  EXPECT_NEAR(p.at(8).block.forward, 0.7, 1e-12);
  EXPECT_NEAR(p.at(6).head.forward, 0.3, 1e-12);
}

TEST(CostModel, ProfileReplacesTheFlopEstimate) {
  const auto m = gpt2_124m();
  ClusterSpec c = simple_cluster();
  const ComputeProfile p = compute_profile_from_json(layer_times(), m);
  const CostModel cm(m, c, CostOptions{Precision::fp32}, p);
  const CostModel analytic(m, c, CostOptions{Precision::fp32});
  EXPECT_DOUBLE_EQ(cm.block(2, 64, 1).forward, 0.25);
  EXPECT_DOUBLE_EQ(cm.head(4, 64, 1).backward_weight, 0.2);
  // Another sequence length: scaled by the analytic model's ratio.
  const double ratio =
      analytic.block_compute(2, 128, 1).forward / analytic.block_compute(2, 64, 1).forward;
  EXPECT_NEAR(cm.block(2, 128, 1).forward, 0.25 * ratio, 1e-12);
  // tp 2: compute scaled, plus the all-reduces.
  const double tp_ratio =
      analytic.block_compute(2, 64, 2).forward / analytic.block_compute(2, 64, 1).forward;
  EXPECT_NEAR(cm.block(2, 64, 2).forward, 0.25 * tp_ratio + 2 * cm.tp_all_reduce(2, 64, 2), 1e-12);
}

TEST(CostModel, ProfileErrorsNameTheField) {
  const auto m = gpt2_124m();
  auto doc = layer_times();
  doc["layer_times"]["points"][0].erase("head_forward_s");
  try {
    compute_profile_from_json(doc, m);
    ADD_FAILURE();
  } catch (const CorruptDataError& e) {
    EXPECT_NE(std::string(e.what()).find("head_forward_s"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("points[0]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(compute_profile_from_json(nlohmann::json::object(), m), CorruptDataError);
  doc = layer_times();
  doc["layer_times"]["points"][1]["micro_batch"] = 4;
  EXPECT_THROW(compute_profile_from_json(doc, m), CorruptDataError);  // duplicate
}

}  // namespace
}  // namespace tessel::planner
