#include "tessel/planner/memory_model.h"

#include <gtest/gtest.h>

#include "tessel/core/error.h"

namespace tessel::planner {
namespace {

using layout::ScheduleKind;

// gpt2, 2 layers, h 64, 4 heads, F 256, vocabulary 128, 16 positions, tied embeddings.
model::ModelConfig small() {
  model::ModelConfig c = model::ModelConfig::preset("gpt2-tiny");
  c.name = "small";
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.n_kv_head = 4;
  c.ffn_hidden = 256;
  c.vocab_size = 128;
  c.max_seq_len = 16;
  c.validate();
  return c;
}

DeviceSpec device(double gib) {
  DeviceSpec d;
  d.name = "dev";
  d.peak_flops = {1e12, 1e12, 1e12};
  d.memory_bytes = int64_t(gib * 1024 * 1024 * 1024);
  return d;
}

TEST(MemoryModel, ParametersPerUnit) {
  const auto m = small();
  // Block: 12 h^2 + 13 h = 49152 + 832.
  EXPECT_EQ(unit_params(m, 1, 1), 49984);
  // tp 2: norms (256) and row-parallel biases (2 x 64) replicated, the rest halved:
  // 256 + (6144 + 96) + (2048 + 64) + (8192 + 128) + (8192 + 64).
  EXPECT_EQ(unit_params(m, 2, 2), 25184);
  EXPECT_EQ(unit_params(m, 0, 1), 128 * 64 + 16 * 64);  // tokens + positions
  EXPECT_EQ(unit_params(m, 0, 2), 64 * 64 + 16 * 64);   // vocabulary-parallel, positions whole
  EXPECT_EQ(unit_params(m, 3, 1), 128);                 // ln_f; the head is tied
  EXPECT_THROW(unit_params(m, 4, 1), InvalidArgumentError);
  for (const char* name : {"gpt2-124m", "llama2-7b", "llama3-8b", "gpt3-175b"}) {
    const auto c = model::ModelConfig::preset(name);
    int64_t sum = 0;
    for (int u = 0; u < c.n_layer + 2; ++u) sum += unit_params(c, u, 1);
    EXPECT_EQ(sum, c.num_params()) << name;
  }
}

TEST(MemoryModel, ActivationsPerMicroBatch) {
  const auto m = small();
  // b 2, s 16: n = 32. fp32.
  // 4 n h + n (2h + 2h) + a s n + 2 n F = 8192 + 8192 + 2048 + 16384 = 34816 elements.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 1, 2, 16, 1, Precision::fp32, false), 34816.0 * 4);
  // Recompute keeps the block input: n h.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 1, 2, 16, 1, Precision::fp32, true), 32.0 * 64 * 4);
  // Flash attention drops the a s n probabilities.
  EXPECT_DOUBLE_EQ(
      unit_activation_bytes(m, 1, 2, 16, 1, Precision::bf16, false, MemoryOptions{true}),
      (34816.0 - 2048) * 2);
  // tp 2 (bf16): 4 n h + (n (2h + 2h) + a s n + 2 n F) / 2.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 1, 2, 16, 2, Precision::bf16, false),
                   (8192.0 + (8192 + 2048 + 16384) / 2.0) * 2);
  // Head: 2 n h norm inputs + fp32 logits n V.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 3, 2, 16, 1, Precision::fp32, false),
                   2.0 * 32 * 64 * 4 + 4.0 * 32 * 128);
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 0, 2, 16, 1, Precision::fp32, false), 4.0 * 32);
}

TEST(MemoryModel, MicroBatchesInFlight) {
  using V = std::vector<int64_t>;
  // 1f1b: rank r of p holds min(m, p - r).
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::one_f_one_b, 4, 1, 8, 0), V{4});
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::one_f_one_b, 4, 1, 8, 3), V{1});
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::one_f_one_b, 4, 1, 2, 0), V{2});
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::gpipe, 4, 1, 8, 3), V{8});
  // Interleaved p 4, v 2, m 8, rank 0: warm-up 2*3 + 1*4 = 10 forwards, the 11th starts the
  // steady state; forwards run chunk 0 for 4 micro-batches, chunk 1 for 4, chunk 0 again: 7, 4.
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::interleaved_one_f_one_b, 4, 2, 8, 0), (V{7, 4}));
  // Rank 3: warm-up 4, then one more: 4 on chunk 0, 1 on chunk 1.
  EXPECT_EQ(in_flight_micro_batches(ScheduleKind::interleaved_one_f_one_b, 4, 2, 8, 3), (V{4, 1}));
  // Megatron's factor for rank 0: (p v + p - 1) chunk-micro-batches of 1/(p v) of the model each
  // = (1 + (p - 1) / (p v)) x the 1f1b amount (p stages' worth of 1/p).
  for (int p : {2, 4, 8}) {
    for (int v : {2, 3, 4}) {
      const auto alive =
          in_flight_micro_batches(ScheduleKind::interleaved_one_f_one_b, p, v, 4 * p, 0);
      int64_t sum = 0;
      for (auto a : alive) sum += a;
      EXPECT_NEAR(double(sum) / (p * v), 1.0 + double(p - 1) / (p * v), 1e-12) << p << " " << v;
    }
  }
  // Never more than all v * m.
  const auto few = in_flight_micro_batches(ScheduleKind::interleaved_one_f_one_b, 4, 2, 4, 0);
  EXPECT_EQ(few, (V{4, 4}));
  EXPECT_THROW(in_flight_micro_batches(ScheduleKind::one_f_one_b, 4, 1, 8, 4),
               InvalidArgumentError);
}

layout::Plan two_stage_plan(int zero) {
  layout::Plan p;
  p.dp = 2;
  p.pp = 2;
  p.micro_batch = 2;
  p.micro_batches = 4;
  p.schedule = ScheduleKind::one_f_one_b;
  p.zero_stage = zero;
  p.layers_per_stage = {2, 2};  // embedding + block 0 | block 1 + head
  return p;
}

TEST(MemoryModel, HandCountedTwoStagePlan) {
  const auto m = small();
  const auto est = estimate_memory(m, two_stage_plan(0), 16, Precision::fp32, device(1));
  ASSERT_EQ(est.ranks.size(), 2u);
  // Rank 0: embedding 9216 + block 49984 = 59200 parameters; 4 + 4 + 8 bytes each.
  const RankMemory& r0 = est.ranks[0];
  EXPECT_DOUBLE_EQ(r0.parameters, 59200.0 * 4);
  EXPECT_DOUBLE_EQ(r0.gradients, 59200.0 * 4);
  EXPECT_DOUBLE_EQ(r0.optimizer, 59200.0 * 8);
  // Two micro-batches in flight (1f1b, p - 0), each: token ids 128 + block 139264 bytes.
  EXPECT_DOUBLE_EQ(r0.activations, 2 * (128.0 + 139264));
  EXPECT_DOUBLE_EQ(r0.workspace, 139264.0);
  // Rank 1: block + ln_f + its copy of the tied embedding (128 x 64) = 49984 + 128 + 8192.
  const RankMemory& r1 = est.ranks[1];
  EXPECT_DOUBLE_EQ(r1.parameters, 58304.0 * 4);
  EXPECT_DOUBLE_EQ(r1.activations, 1 * (139264.0 + 32768));
  EXPECT_EQ(est.worst, 0);
  EXPECT_TRUE(est.fits());
  EXPECT_EQ(est.reason(), "");

  // ZeRO-1 in bf16: 2 + 2 bytes, optimizer 12 / dp.
  const auto z1 = estimate_memory(m, two_stage_plan(1), 16, Precision::bf16, device(1));
  EXPECT_DOUBLE_EQ(z1.ranks[0].parameters, 59200.0 * 2);
  EXPECT_DOUBLE_EQ(z1.ranks[0].optimizer, 59200.0 * 6);
  EXPECT_DOUBLE_EQ(z1.ranks[0].activations, 2 * (128.0 + 34816 * 2));
  // Recompute: inputs kept, the block's activations re-made (and their gradients) in workspace.
  auto plan = two_stage_plan(0);
  plan.recompute = model::Recompute::full;
  const auto rc = estimate_memory(m, plan, 16, Precision::fp32, device(1));
  EXPECT_DOUBLE_EQ(rc.ranks[0].activations, 2 * (128.0 + 32 * 64 * 4));
  EXPECT_DOUBLE_EQ(rc.ranks[0].workspace, 2 * 139264.0);
  // GPipe keeps all four.
  plan = two_stage_plan(0);
  plan.schedule = ScheduleKind::gpipe;
  EXPECT_DOUBLE_EQ(estimate_memory(m, plan, 16, Precision::fp32, device(1)).ranks[1].activations,
                   4 * (139264.0 + 32768));
}

// ZB-H1 holds up to min(p, m) micro-batches on every rank, and a split backward keeps per block
// and micro-batch what the weight pass needs (transformer.h): for this gpt2 block (h 64, F 256,
// n = 2 x 16 = 32 rows) n (2h + 3h + F) + 4h = 32 x 576 + 256 = 18688 floats = 74752 bytes.
TEST(MemoryModel, SplitBackwardKeepsTheWeightPassInputs) {
  const auto m = small();
  auto plan = two_stage_plan(0);
  plan.schedule = ScheduleKind::zb_h1;
  const auto est = estimate_memory(m, plan, 16, Precision::fp32, device(1));
  EXPECT_DOUBLE_EQ(est.ranks[0].activations, 2 * (128.0 + 139264 + 74752));
  EXPECT_DOUBLE_EQ(est.ranks[1].activations, 2 * (139264.0 + 74752 + 32768));
}

TEST(MemoryModel, InterleavedChunksSumPerRank) {
  const auto m = small();
  layout::Plan p;
  p.pp = 2;
  p.virtual_stages = 2;
  p.micro_batch = 1;
  p.micro_batches = 4;
  p.schedule = ScheduleKind::interleaved_one_f_one_b;
  p.layers_per_stage = {1, 1, 1, 1};  // rank 0: embedding, block 1; rank 1: block 0, head
  const auto est = estimate_memory(m, p, 16, Precision::fp32, device(1));
  EXPECT_DOUBLE_EQ(est.ranks[0].parameters, (9216.0 + 49984) * 4);
  EXPECT_DOUBLE_EQ(est.ranks[1].parameters, (49984.0 + 128 + 8192) * 4);
  // Rank 0 (p 2, v 2, m 4): warm-up 2 + 2 = 4 forwards, 5 alive: chunk 0 x3, chunk 1 x2.
  const double ids = 4.0 * 16, block = 17408.0 * 4;  // n = 16: 4nh+4nh+asn+2nF = 17408
  EXPECT_DOUBLE_EQ(est.ranks[0].activations, 3 * ids + 2 * block);
}

TEST(MemoryModel, ReasonNamesTheParts) {
  const auto m = small();
  DeviceSpec d = device(1.0 / 1024);  // 1 MiB
  d.reserved_bytes = 512 * 1024;
  const auto est = estimate_memory(m, two_stage_plan(0), 16, Precision::fp32, d);
  EXPECT_FALSE(est.fits());
  const std::string r = est.reason();
  EXPECT_NE(r.find("needs 0.0 GiB per device on stage 0"), std::string::npos) << r;
  EXPECT_NE(r.find("has 0.0 GiB (0.0 GiB less 0.0 GiB reserved)"), std::string::npos) << r;
  // Largest part first.
  EXPECT_LT(r.find("optimizer"), r.find("parameters")) << r;
  EXPECT_NE(r.find("activations"), std::string::npos) << r;
  EXPECT_NE(r.find("workspace"), std::string::npos) << r;
  EXPECT_EQ(format_gib(93.1 * 1024 * 1024 * 1024), "93.1 GiB");

  auto bad = two_stage_plan(0);
  bad.layers_per_stage = {3, 2};
  EXPECT_THROW(estimate_memory(m, bad, 16, Precision::fp32, d), ConfigError);
}

}  // namespace
}  // namespace tessel::planner
