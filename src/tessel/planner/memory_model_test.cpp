#include "tessel/planner/memory_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/kernels/op_harness.h"
#include "tessel/model/stage_range.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/transformer.h"

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

// small(), b 2, s 16: n = 32 tokens, h 64, 4 heads of D 16, F 256, Vp 128 (fp32 floats):
//   O = n h = 2048; A = n (3h + 3h + h + 2F + 4) = 32 x 964 = 30848; P = b Hq s^2 = 2048;
//   X = n (2h + h + F) = 32 x 448 = 14336; split G = n (2h + 3h + F) + 4h = 18688.
constexpr double kO = 2048, kA = 30848, kP = 2048, kX = 14336, kG = 18688;

TEST(MemoryModel, ActivationsPerMicroBatch) {
  const auto m = small();
  using model::Recompute;
  auto block = [&](Recompute r, bool split = false) {
    return unit_activation_bytes(m, 1, 2, 16, 1, Precision::fp32, r, split) / 4;
  };
  EXPECT_DOUBLE_EQ(block(Recompute::none), kO + kA + kP);
  EXPECT_DOUBLE_EQ(block(Recompute::selective), kO + kA);  // P is shared by blocks and slots
  EXPECT_DOUBLE_EQ(block(Recompute::full), kO);            // the block's input for the next
  EXPECT_DOUBLE_EQ(block(Recompute::none, true), kO + kA + kP + kG);
  EXPECT_DOUBLE_EQ(block(Recompute::full, true), kO + kX + kG);
  // Flash attention drops the probabilities; bf16 halves every element.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 1, 2, 16, 1, Precision::bf16, Recompute::none, false,
                                         MemoryOptions{true}),
                   (kO + kA) * 2);
  // tp 2 (bf16): Hq = Hkv = 2, F 128, qkv 96: A = 32 (192 + 96 + 32 + 256 + 4) = 18560, P 1024.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 1, 2, 16, 2, Precision::bf16, Recompute::none),
                   (kO + 18560 + 1024) * 2);
  // Head: final norm n h + 2n, losses n, logits n Vp (fp32 even in bf16); split: ln_f's 2h grads.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 3, 2, 16, 1, Precision::fp32, Recompute::none),
                   (2048.0 + 64 + 32 + 32 * 128) * 4);
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 3, 2, 16, 1, Precision::bf16, Recompute::full, true),
                   (2048.0 + 64 + 128) * 2 + (32.0 + 32 * 128) * 4);
  // The embedding keeps nothing per slot of its own but d(x0) for a split backward's weight pass.
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 0, 2, 16, 1, Precision::fp32, Recompute::none), 0);
  EXPECT_DOUBLE_EQ(unit_activation_bytes(m, 0, 2, 16, 1, Precision::fp32, Recompute::none, true),
                   2048.0 * 4);
}

// A stage adds its input x0 per slot; recomputed buffers and the scratch exist once.
TEST(MemoryModel, StageSharesRecomputedBuffersAndScratch) {
  const auto m = small();
  using model::Recompute;
  auto stage = [&](Recompute r, bool split = false) {
    return stage_activation_bytes(m, 0, 2, 2, 16, 1, Precision::fp32, r, split);
  };
  // Scratch: proj, dres, dln 3 n h = 6144; d(atty) n h, dqkv 3 n h, MLP 2 n F: 32 x 768.
  const double scratch = 6144 + 32 * 768, split_scratch = 6144 + 32 * (64 + 256);
  const auto none = stage(Recompute::none);
  EXPECT_DOUBLE_EQ(none.per_slot, (kO + kO + kA + kP) * 4);
  EXPECT_DOUBLE_EQ(none.recomputed, 0);
  EXPECT_DOUBLE_EQ(none.scratch, scratch * 4);
  EXPECT_DOUBLE_EQ(none.token_ids, 32.0 * 4);
  EXPECT_DOUBLE_EQ(none.model_bytes(3), 3 * none.per_slot + none.scratch);
  EXPECT_DOUBLE_EQ(none.workspace(), none.scratch + none.token_ids);
  EXPECT_DOUBLE_EQ(stage(Recompute::selective).recomputed, kP * 4);
  EXPECT_DOUBLE_EQ(stage(Recompute::full).recomputed, (kA + kP) * 4);
  EXPECT_DOUBLE_EQ(stage(Recompute::full).per_slot, (kO + kO) * 4);
  // Split backward under full: the linears' inputs move from the shared buffer to the slots;
  // the first stage keeps d(x0); the scratch loses dqkv and one MLP gradient.
  const auto full_split = stage(Recompute::full, true);
  EXPECT_DOUBLE_EQ(full_split.per_slot, (kO + kO + kO + kX + kG) * 4);
  EXPECT_DOUBLE_EQ(full_split.recomputed, (kA - kX + kP) * 4);
  EXPECT_DOUBLE_EQ(full_split.scratch, split_scratch * 4);
  // A stage of the head alone: no block scratch, nothing recomputed.
  const auto head =
      stage_activation_bytes(m, 3, 4, 2, 16, 1, Precision::fp32, Recompute::full, false);
  EXPECT_DOUBLE_EQ(head.per_slot, (kO + 2048 + 64 + 32 + 32 * 128) * 4);
  EXPECT_DOUBLE_EQ(head.recomputed, 0);
  EXPECT_DOUBLE_EQ(head.scratch, 6144.0 * 4);
  EXPECT_THROW(stage_activation_bytes(m, 2, 2, 2, 16, 1, Precision::fp32, Recompute::none, false),
               InvalidArgumentError);
  EXPECT_THROW(stage_activation_bytes(m, 0, 5, 2, 16, 1, Precision::fp32, Recompute::none, false),
               InvalidArgumentError);
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
  // Two micro-batches in flight (1f1b, p - 0), each: x0 + the block, and 128 bytes of token ids.
  const double ids = 128, block = (kO + kA + kP) * 4;
  EXPECT_DOUBLE_EQ(r0.activations, 2 * (kO * 4 + block + ids));
  // Workspace: the scratch (StageSharesRecomputedBuffersAndScratch), the targets, and the
  // pipeline's boundary buffers: 4 receives posted ahead + 2, and 2 micro-batches in flight + 2
  // sends, of n h = 32 x 64 floats each.
  const double scratch = (6144 + 32 * 768) * 4, boundary = (6 + 4) * 32 * 64 * 4.0;
  EXPECT_EQ(receive_buffer_bound(two_stage_plan(0), 0), 6);
  EXPECT_EQ(send_buffer_bound(two_stage_plan(0), 0), 4);
  EXPECT_DOUBLE_EQ(r0.workspace, scratch + ids + boundary);
  // Rank 1: block + ln_f + its copy of the tied embedding (128 x 64) = 49984 + 128 + 8192.
  const RankMemory& r1 = est.ranks[1];
  EXPECT_DOUBLE_EQ(r1.parameters, 58304.0 * 4);
  const double head = (2048.0 + 64 + 32 + 32 * 128) * 4;
  EXPECT_DOUBLE_EQ(r1.activations, 1 * (kO * 4 + block + head + ids));
  EXPECT_EQ(est.worst, 0);
  EXPECT_TRUE(est.fits());
  EXPECT_EQ(est.reason(), "");

  // ZeRO-1 in bf16: 2 + 2 bytes, optimizer 12 / dp.
  const auto z1 = estimate_memory(m, two_stage_plan(1), 16, Precision::bf16, device(1));
  EXPECT_DOUBLE_EQ(z1.ranks[0].parameters, 59200.0 * 2);
  EXPECT_DOUBLE_EQ(z1.ranks[0].optimizer, 59200.0 * 6);
  EXPECT_DOUBLE_EQ(z1.ranks[0].activations, 2 * ((kO + kO + kA + kP) * 2 + ids));
  // Full recompute: inputs kept per slot, the rest of one block once, in the workspace.
  auto plan = two_stage_plan(0);
  plan.recompute = model::Recompute::full;
  const auto rc = estimate_memory(m, plan, 16, Precision::fp32, device(1));
  EXPECT_DOUBLE_EQ(rc.ranks[0].activations, 2 * (2 * kO * 4 + ids));
  EXPECT_DOUBLE_EQ(rc.ranks[0].workspace, (kA + kP) * 4 + scratch + ids + boundary);
  // GPipe keeps all four.
  plan = two_stage_plan(0);
  plan.schedule = ScheduleKind::gpipe;
  EXPECT_DOUBLE_EQ(estimate_memory(m, plan, 16, Precision::fp32, device(1)).ranks[1].activations,
                   4 * (kO * 4 + block + head + ids));
}

// ZB-H1 holds up to min(p, m) micro-batches on every rank, and a split backward keeps per block
// and micro-batch what the weight pass needs (kG), d(x0) on the first stage and ln_f's weight
// gradients (2h) on the last.
TEST(MemoryModel, SplitBackwardKeepsTheWeightPassInputs) {
  const auto m = small();
  auto plan = two_stage_plan(0);
  plan.schedule = ScheduleKind::zb_h1;
  const auto est = estimate_memory(m, plan, 16, Precision::fp32, device(1));
  const double ids = 128, block = kO + kA + kP + kG;
  EXPECT_DOUBLE_EQ(est.ranks[0].activations, 2 * ((kO + kO + block) * 4 + ids));
  EXPECT_DOUBLE_EQ(est.ranks[1].activations,
                   2 * ((kO + block + 2048 + 64 + 32 + 32 * 128 + 128) * 4 + ids));
  // The scratch keeps d(atty) and d(activation) only: 3 n h + n (h + F); 6 + 4 boundary buffers.
  EXPECT_DOUBLE_EQ(est.ranks[0].workspace, (6144 + 32 * 320) * 4 + ids + 10 * 32 * 64 * 4.0);
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
  // n = 16: x0 n h = 1024, a block O + A + P = 1024 + 16 x 964 + 1024 = 17472 floats.
  const double ids = 4.0 * 16, x0 = 1024.0 * 4, block = 17472.0 * 4;
  EXPECT_DOUBLE_EQ(est.ranks[0].activations, 3 * (x0 + ids) + 2 * (x0 + block + ids));
  // Each chunk is a model with its own scratch (3 n h, plus 16 x 768 with a block) and targets;
  // the rank's boundary buffers: 4 receives posted ahead per chunk + 2, and the 5 micro-batches
  // alive + 2 per chunk sends, of n h = 1024 floats.
  EXPECT_EQ(receive_buffer_bound(p, 0), 10);
  EXPECT_EQ(send_buffer_bound(p, 0), 9);
  EXPECT_DOUBLE_EQ(est.ranks[0].workspace,
                   (3072 + 3072 + 16 * 768) * 4.0 + 2 * ids + 19 * 1024 * 4.0);
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

// ---- the model's real storage ------------------------------------------------------------------

// Sizes a tensor-parallel shard. Building a model runs no collective, so none is implemented.
class ShardShapeGroup final : public model::TpGroup {
 public:
  ShardShapeGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(float*, size_t) override { unused(); }
  void all_reduce_max(float*, size_t) override { unused(); }

 private:
  [[noreturn]] static void unused() {
    throw InvalidArgumentError("ShardShapeGroup only sizes a model; it runs no collective");
  }
  int rank_, size_;
};

// The reference backend, zeroing on the calling thread. The host backends zero large buffers
// with OpenMP, and a process that has started OpenMP's threads hangs in OpenMP in the children
// it forks (libgomp is not fork-safe) -- which the profiler tests in this binary then do.
class SerialZeroBackend final : public kernels::harness::ForwardingBackend {
 public:
  SerialZeroBackend() : ForwardingBackend(kernels::make_backend("reference")) {}
  void memset_zero(void* d, size_t n) override { std::memset(d, 0, n); }
};

struct StageCase {
  model::ModelConfig config;
  int B, T;
};

// gpt2-tiny and llama-tiny at odd N (buffers not multiples of 16 floats), and wider configs with N
// and C multiples of 16 (no rounding at all): gpt2 with biases, gpt2 without (2h norm gradients),
// llama with one kv head (replicated over tp 2).
std::vector<StageCase> stage_cases() {
  std::vector<StageCase> cases;
  for (const char* name : {"gpt2-tiny", "llama-tiny"}) {
    model::ModelConfig c = model::ModelConfig::preset(name);
    c.n_layer = 4;
    cases.push_back({c, 1, 7});
  }
  model::ModelConfig g = model::ModelConfig::preset("gpt2-tiny");
  g.name = "gpt2-wide";
  g.n_layer = 4;
  g.n_embd = 128;
  g.n_head = 4;
  g.n_kv_head = 4;
  g.ffn_hidden = 512;
  g.max_seq_len = 64;
  g.validate();
  cases.push_back({g, 2, 64});
  g.name = "gpt2-wide-nobias";
  g.bias = false;
  g.validate();
  cases.push_back({g, 1, 32});
  model::ModelConfig l = model::ModelConfig::preset("llama-tiny");
  l.name = "llama-wide";
  l.n_layer = 4;
  l.n_embd = 128;
  l.n_head = 4;
  l.n_kv_head = 1;
  l.ffn_hidden = 352;
  l.max_seq_len = 64;
  l.validate();
  cases.push_back({l, 2, 48});
  return cases;
}

// How far activation_bytes() may exceed the memory model's figure: the model carves every buffer
// rounded up to 16 floats (transformer.cpp, Carver), at most 15 floats = 60 bytes more per
// buffer. When N = B T and C are multiples of 16 every buffer is a multiple of 16 floats (each is
// N times a count, B Hq T^2 = N Hq T, or a multiple of C: 2C, 4C, 2 n_kv_head D C), so the
// bound is 0. Buffers: at most 9 scratch (proj, dres, dln, datty, dqkv, 3 MLP gradients,
// kv_stage), 12 recomputed (a gpt2 block's 4 linear inputs and 8 others), and per slot x0,
// d(x0), d(ln_f), 7 head buffers (lnf, mean, rstd, logits, losses, ce max and sums) and per block
// 13 activations and 6 split-backward gradients (dout, dmid, d0, d1, dqkv, dnorm).
double rounding_bound(const StageCase& c, int blocks, int slots) {
  const int64_t N = int64_t(c.B) * c.T;
  if (N % 16 == 0 && c.config.n_embd % 16 == 0) return 0;
  return 60.0 * (9 + 12 + double(slots) * (10 + 19 * blocks));
}

model::StageRange range_of(const model::ModelConfig& c, int begin, int end) {
  const int head = c.n_layer + 1;
  return model::StageRange{std::max(begin, 1) - 1, std::min(end, head) - 1, begin == 0,
                           end == head + 1}
      .resolved(c);
}

// Every family, tp 1 and 2, first / middle / head / head-only stages, 1 and 3 slots, every
// recompute mode, with and without split backward: the model's activation_bytes() is the memory
// model's figure up to the rounding, and grows by exactly per_slot per slot (the scratch and the
// recomputed buffers exist once).
TEST(MemoryModel, MatchesTheModelsActivationStorage) {
  SerialZeroBackend backend;
  int checked = 0, exact = 0;
  for (const StageCase& c : stage_cases()) {
    const int L = c.config.n_layer;
    // Units: embedding + 2 blocks | 1 block | the last block + head | the head alone.
    const std::vector<std::pair<int, int>> stages = {{0, 3}, {3, 4}, {L, L + 2}, {L + 1, L + 2}};
    for (int tp : {1, 2}) {
      ShardShapeGroup group(tp - 1, tp);
      for (const auto& [begin, end] : stages) {
        const model::StageRange range = range_of(c.config, begin, end);
        for (model::Recompute r :
             {model::Recompute::none, model::Recompute::selective, model::Recompute::full}) {
          for (bool split : {false, true}) {
            const StageActivation want = stage_activation_bytes(c.config, begin, end, c.B, c.T, tp,
                                                                Precision::fp32, r, split);
            double measured[2];
            const int slot_counts[2] = {1, 3};
            for (int i = 0; i < 2; ++i) {
              model::Transformer t(c.config, backend, c.B, c.T, range, &group, slot_counts[i], r);
              t.set_split_backward(split);
              measured[i] = double(t.activation_bytes());
            }
            const std::string what =
                fmt::format("{} units [{}, {}) tp {} {}{}", c.config.name, begin, end, tp,
                            model::recompute_name(r), split ? " split" : "");
            for (int i = 0; i < 2; ++i) {
              const double excess = measured[i] - want.model_bytes(slot_counts[i]);
              EXPECT_GE(excess, 0) << what << ", " << slot_counts[i] << " slots";
              EXPECT_LE(excess, rounding_bound(c, range.num_layers(), slot_counts[i]))
                  << what << ", " << slot_counts[i] << " slots";
            }
            // Two more slots add 2 per_slot (up to the slots' rounding); the rest is the
            // workspace, shared by every slot.
            const double per_slot_bound =
                rounding_bound(c, range.num_layers(), 2) - rounding_bound(c, range.num_layers(), 0);
            EXPECT_NEAR(measured[1] - measured[0], 2 * want.per_slot, per_slot_bound) << what;
            exact += rounding_bound(c, range.num_layers(), 3) == 0;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 2 * 4 * 3 * 2);
  EXPECT_EQ(exact, 3 * 2 * 4 * 3 * 2);  // the wide configs are checked without tolerance
}

// A plan's estimate for a pipeline rank is what its stage's model allocates (activations and
// workspace: activation_bytes() and the int32 token ids per slot and the targets), in fp32.
TEST(MemoryModel, EstimateIsTheStageModelsStorage) {
  SerialZeroBackend backend;
  const StageCase c = stage_cases()[2];  // gpt2-wide: no rounding
  for (model::Recompute r :
       {model::Recompute::none, model::Recompute::selective, model::Recompute::full}) {
    for (ScheduleKind kind : {ScheduleKind::one_f_one_b, ScheduleKind::zb_h1}) {
      layout::Plan plan;
      plan.pp = 2;
      plan.tp = 2;
      plan.micro_batch = c.B;
      plan.micro_batches = 4;
      plan.schedule = kind;
      plan.recompute = r;
      plan.layers_per_stage = {3, 3};
      const auto est = estimate_memory(c.config, plan, c.T, Precision::fp32, device(80));
      ShardShapeGroup group(1, 2);
      for (int rank = 0; rank < 2; ++rank) {
        const int begin = rank * 3, end = begin + 3;
        const int slots = int(in_flight_micro_batches(kind, 2, 1, 4, rank)[0]);
        model::Transformer t(c.config, backend, c.B, c.T, range_of(c.config, begin, end), &group,
                             slots, r);
        t.set_split_backward(plan.split_backward());
        const double ids = 4.0 * c.B * c.T * (slots + 1);
        // The executor's boundary buffers are workspace too, outside the model.
        const double boundary =
            double(receive_buffer_bound(plan, rank) + send_buffer_bound(plan, rank)) * c.B * c.T *
            double(c.config.n_embd) * 4;
        const RankMemory& rm = est.ranks[size_t(rank)];
        EXPECT_DOUBLE_EQ(rm.activations + rm.workspace,
                         double(t.activation_bytes()) + ids + boundary)
            << model::recompute_name(r) << " " << layout::schedule_name(kind) << " rank " << rank;
      }
    }
  }
}

}  // namespace
}  // namespace tessel::planner
