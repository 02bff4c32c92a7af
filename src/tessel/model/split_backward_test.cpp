// Split backward (transformer.h: backward_input_stage, backward_weight_stage): an input pass (Bi)
// then, later, a weight pass (Bw) on a slot accumulate the same gradients as backward_stage, bit
// for bit, and Bi leaves the same input gradient -- whole models and pipeline stages (first,
// middle, head), both families, tied and untied heads, GQA and multi-query attention, every
// recompute mode, tensor parallelism, with the passes of several slots interleaved as zero-bubble
// schedules interleave them -- while holding exactly the activation memory transformer.h states.
//
// Bit-identity, not a tolerance: Bi and Bw run the kernels backward_stage runs, on the same
// operands (the weight-gradient kernels read copies of the same output gradients), and every
// gradient element gets the same additions in the same order when the weight passes run in the
// order the backward_stage calls ran. Any difference is a bug: an operand that another slot's
// pass overwrote in between, a gradient that Bi touched, a collective on the wrong side.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/batch_test_util.h"
#include "tessel/model/bit_identity_test_util.h"
#include "tessel/model/local_tp_group_test_util.h"
#include "tessel/model/recompute.h"
#include "tessel/model/transformer.h"

namespace tessel::model {
namespace {

using test_util::Batch;
using test_util::copy_of;

using test_util::same_bits;
using Case = test_util::ModelCase;
constexpr auto& kModes = test_util::kRecomputeModes;

std::vector<Case> cases() {
  return test_util::three_block_cases();
}

// ---- pipelines of stages with interleaved slots ------------------------------------------------

// One op of a stage-chain schedule on micro-batch `mb`, which lives in activation slot
// mb % slots of every stage: a forward, a fused backward (backward_stage), or one half of a
// split backward.
enum class Kind { F, B, Bi, Bw };
struct Op {
  Kind kind;
  int mb;
};

// The fused schedule a split one must equal: each Bw becomes a backward_stage, each Bi goes.
// Gradients then accumulate micro-batches in the same order.
std::vector<Op> fused(const std::vector<Op>& split) {
  std::vector<Op> out;
  for (const Op& op : split) {
    if (op.kind == Kind::Bi) continue;
    out.push_back({op.kind == Kind::Bw ? Kind::B : op.kind, op.mb});
  }
  return out;
}

struct PipelineRun {
  std::vector<kernels::CrossEntropyResult> losses;  // per micro-batch
  // input_grad() of every stage right after the backward (or Bi) of a micro-batch, by
  // (micro-batch, stage)
  std::map<std::pair<int, size_t>, std::vector<float>> input_grads;
  std::vector<std::vector<float>> grads;    // per stage, after the schedule
  std::vector<std::vector<int64_t>> ready;  // per stage: every grads_ready offset, in order
  std::vector<size_t> bytes;                // activation_bytes() per stage
  int grads_touched_by_bi = 0;              // Bi calls that changed the gradients
};

// Runs `schedule` on a chain of stages (ranges) built with `r` and `slots` activation slots,
// split backward when the schedule has Bi/Bw; hidden states and their gradients are copied
// between neighbours by hand, as the runtime's pipeline does. Weight passes run on the stages in
// forward order (any order would do: the stages are independent models).
PipelineRun run_pipeline(const ModelConfig& c, kernels::Backend& backend,
                         const std::vector<StageRange>& ranges, Recompute r, TpGroup* tp,
                         const std::vector<Op>& schedule, int slots) {
  const int B = 2, T = 8, N = B * T;
  bool split = false;
  int micro_batches = 0;
  for (const Op& op : schedule) {
    micro_batches = std::max(micro_batches, op.mb + 1);
    split = split || op.kind == Kind::Bi || op.kind == Kind::Bw;
  }
  std::vector<std::unique_ptr<Transformer>> st;
  for (const StageRange& range : ranges) {
    st.push_back(std::make_unique<Transformer>(c, backend, B, T, range, tp, slots, r));
    if (split) st.back()->set_split_backward(true);
    st.back()->init(9);
  }
  std::vector<Batch> mbs;
  for (int m = 0; m < micro_batches; ++m)
    mbs.push_back(test_util::random_batch(N, c.vocab_size, 20 + uint64_t(m), 3 + m));
  const size_t hidden_bytes = size_t(N) * size_t(c.n_embd) * sizeof(float);
  PipelineRun out;
  out.losses.resize(size_t(micro_batches));
  out.ready.resize(st.size());
  for (const Op& op : schedule) {
    const size_t m = size_t(op.mb);
    const int slot = op.mb % slots;
    switch (op.kind) {
      case Kind::F:
        for (size_t s = 0; s < st.size(); ++s) {
          if (s > 0) {
            std::memcpy(st[s]->input_hidden(slot).raw(), st[s - 1]->output_hidden(slot).raw(),
                        hidden_bytes);
          }
          const int32_t* tokens = s == 0 ? mbs[m].tokens.data() : nullptr;
          out.losses[m] = st[s]->forward_stage(tokens, mbs[m].targets.data(), 1.0f / 40, slot);
        }
        break;
      case Kind::B:
      case Kind::Bi:
        for (size_t s = st.size(); s-- > 0;) {
          if (s + 1 < st.size()) {
            std::memcpy(st[s]->output_grad(slot).raw(), st[s + 1]->input_grad(slot).raw(),
                        hidden_bytes);
          }
          if (op.kind == Kind::B) {
            st[s]->backward_stage(slot, [&, s](int64_t from) { out.ready[s].push_back(from); });
          } else {
            const std::vector<float> before = copy_of(st[s]->grads());
            st[s]->backward_input_stage(slot);
            EXPECT_TRUE(st[s]->weight_pass_pending(slot));
            out.grads_touched_by_bi += !same_bits(copy_of(st[s]->grads()), before);
          }
          out.input_grads[{op.mb, s}] = copy_of(st[s]->input_grad(slot));
        }
        break;
      case Kind::Bw:
        for (size_t s = 0; s < st.size(); ++s) {
          st[s]->backward_weight_stage(slot,
                                       [&, s](int64_t from) { out.ready[s].push_back(from); });
          EXPECT_FALSE(st[s]->weight_pass_pending(slot));
        }
        break;
    }
  }
  for (const auto& m : st) {
    out.grads.push_back(copy_of(m->grads()));
    out.bytes.push_back(m->activation_bytes());
  }
  return out;
}

void expect_same(const PipelineRun& got, const PipelineRun& want) {
  EXPECT_EQ(got.grads_touched_by_bi, 0);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t m = 0; m < want.losses.size(); ++m)
    EXPECT_TRUE(same_bits(got.losses[m], want.losses[m])) << "loss of micro-batch " << m;
  ASSERT_EQ(got.input_grads.size(), want.input_grads.size());
  for (const auto& [key, g] : want.input_grads) {
    EXPECT_TRUE(same_bits(got.input_grads.at(key), g))
        << "input_grad of micro-batch " << key.first << " on stage " << key.second;
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t s = 0; s < want.grads.size(); ++s) {
    EXPECT_TRUE(same_bits(got.grads[s], want.grads[s])) << "gradients of stage " << s;
    EXPECT_EQ(got.ready[s], want.ready[s]) << "grads_ready offsets of stage " << s;
  }
}

// Split schedules, three slots (micro-batch m in slot m % 3): the interleaving; Bi of
// every micro-batch before any Bw, weight passes in another order; a ZB-H1-like order in which
// micro-batch 3 reuses slot 0 right after slot 0's Bw; and Bi, Bw back to back.
std::vector<std::vector<Op>> split_schedules() {
  using K = Kind;
  return {
      {{K::F, 0},
       {K::F, 1},
       {K::Bi, 0},
       {K::Bi, 1},
       {K::Bw, 1},
       {K::F, 2},
       {K::Bw, 0},
       {K::Bi, 2},
       {K::Bw, 2}},
      {{K::F, 0},
       {K::F, 1},
       {K::F, 2},
       {K::Bi, 2},
       {K::Bi, 1},
       {K::Bi, 0},
       {K::Bw, 2},
       {K::Bw, 0},
       {K::Bw, 1}},
      {{K::F, 0},
       {K::Bi, 0},
       {K::F, 1},
       {K::Bi, 1},
       {K::Bw, 0},
       {K::F, 3},
       {K::F, 2},
       {K::Bi, 2},
       {K::Bw, 1},
       {K::Bi, 3},
       {K::Bw, 2},
       {K::Bw, 3}},
      {{K::F, 0}, {K::Bi, 0}, {K::Bw, 0}, {K::F, 1}, {K::Bi, 1}, {K::Bw, 1}},
  };
}

// Three stages of one block each -- the first (embedding), a middle one, the head -- for every
// case and recompute mode, each combination with one of the schedules in turn (every schedule
// meets both families and every mode); and the whole model as one stage.
TEST(SplitBackward, PipelineStagesAndWholeModelsAreBitIdenticalToBackwardStage) {
  auto backend = kernels::make_backend("cpu");
  const auto schedules = split_schedules();
  const std::vector<Case> all = cases();
  for (size_t ci = 0; ci < all.size(); ++ci) {
    const Case& k = all[ci];
    const ModelConfig& c = k.config;
    const std::vector<StageRange> stages = {
        StageRange::layers(c, 0, 1), StageRange::layers(c, 1, 2), StageRange::layers(c, 2, 3)};
    for (size_t mi = 0; mi < 3; ++mi) {
      const Recompute r = kModes[mi];
      const size_t i = (ci + mi) % schedules.size();
      SCOPED_TRACE(testing::Message() << k.name << " schedule " << i << " " << recompute_name(r));
      expect_same(run_pipeline(c, *backend, stages, r, nullptr, schedules[i], 3),
                  run_pipeline(c, *backend, stages, r, nullptr, fused(schedules[i]), 3));
      if (ci % 3 == 0) {
        SCOPED_TRACE("whole model");
        expect_same(run_pipeline(c, *backend, {StageRange{}}, r, nullptr, schedules[0], 3),
                    run_pipeline(c, *backend, {StageRange{}}, r, nullptr, fused(schedules[0]), 3));
      }
    }
  }
}

// The reference kernels too (double accumulation, other loops): the identity does not rest on one
// backend's kernels.
TEST(SplitBackward, ReferenceBackendIsBitIdenticalToBackwardStage) {
  auto backend = kernels::make_backend("reference");
  const std::vector<Op> schedule = split_schedules()[0];
  for (const Case& k : cases()) {
    const ModelConfig& c = k.config;
    const std::vector<StageRange> ranges = {StageRange::layers(c, 0, 2),
                                            StageRange::layers(c, 2, 3)};
    for (Recompute r : kModes) {
      SCOPED_TRACE(testing::Message() << k.name << " " << recompute_name(r));
      expect_same(run_pipeline(c, *backend, ranges, r, nullptr, schedule, 3),
                  run_pipeline(c, *backend, ranges, r, nullptr, fused(schedule), 3));
    }
  }
}

// Tensor parallelism: tp ranks as threads. Bi makes the input-gradient all-reduces (and full
// recomputation's), Bw the replicated-kv staging all-reduce; every rank runs the same passes in
// the same order, so each rank's results equal its own with backward_stage. gpt2, llama with
// kv heads split (tp 2) and replicated (tp 4 on 2 kv heads; multi-query at tp 2).
TEST(SplitBackward, TensorParallelRanksAreBitIdenticalToBackwardStage) {
  struct TpCase {
    std::string name;  // of cases()
    int tp;
  };
  std::map<std::string, ModelConfig> by_name;
  for (const Case& k : cases()) by_name[k.name] = k.config;
  const std::vector<TpCase> tp_cases = {
      {"gpt2_untied", 2}, {"llama_untied", 2}, {"llama_tied", 4}, {"llama_mqa", 2}};
  const auto schedules = split_schedules();
  for (const TpCase& tc : tp_cases) {
    const ModelConfig& c = by_name.at(tc.name);
    const std::vector<StageRange> ranges = {
        StageRange::layers(c, 0, 1), StageRange::layers(c, 1, 2), StageRange::layers(c, 2, 3)};
    for (size_t i : {size_t(0), size_t(2)}) {
      // [mode][rank]: {fused, split}
      std::vector<std::vector<std::pair<PipelineRun, PipelineRun>>> runs(
          3, std::vector<std::pair<PipelineRun, PipelineRun>>(size_t(tc.tp)));
      LocalTpGroup::run(tc.tp, [&](TpGroup& group) {
        auto backend = kernels::make_backend("cpu");
        for (size_t mi = 0; mi < 3; ++mi) {
          auto& [fused_run, split_run] = runs[mi][size_t(group.rank())];
          fused_run = run_pipeline(c, *backend, ranges, kModes[mi], &group, fused(schedules[i]), 3);
          split_run = run_pipeline(c, *backend, ranges, kModes[mi], &group, schedules[i], 3);
        }
      });
      for (size_t mi = 0; mi < 3; ++mi) {
        for (int rank = 0; rank < tc.tp; ++rank) {
          SCOPED_TRACE(testing::Message()
                       << tc.name << " tp " << tc.tp << " rank " << rank << " schedule " << i << " "
                       << recompute_name(kModes[mi]));
          const auto& [fused_run, split_run] = runs[mi][size_t(rank)];
          expect_same(split_run, fused_run);
        }
      }
    }
  }
}

// ---- the API's rules
// -----------------------------------------------------------------------------

TEST(SplitBackward, PassesNeedTheirPredecessorsAndASlotIsFreeAfterItsWeightPass) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  c.n_layer = 2;
  const int B = 2, T = 8;
  const Batch b = test_util::random_batch(B * T, c.vocab_size, 3, 4);
  const int32_t* tok = b.tokens.data();
  const int32_t* tgt = b.targets.data();

  Transformer m(c, *backend, B, T, {}, nullptr, 2);
  EXPECT_FALSE(m.split_backward());
  m.forward_stage(tok, tgt, 0.1f, 0);
  EXPECT_THROW(m.backward_input_stage(0), InvalidArgumentError) << "not built for split backward";
  EXPECT_THROW(m.backward_weight_stage(0), InvalidArgumentError);

  m.set_split_backward(true);
  EXPECT_TRUE(m.split_backward());
  EXPECT_THROW(m.backward_input_stage(0), InvalidArgumentError) << "the forward was dropped";
  EXPECT_THROW(m.backward_weight_stage(0), InvalidArgumentError) << "no input pass";
  EXPECT_THROW(m.backward_input_stage(2), InvalidArgumentError) << "slot out of range";
  EXPECT_THROW(m.weight_pass_pending(-1), InvalidArgumentError);
  m.forward_stage(tok, tgt, 0.1f, 0);
  m.forward_stage(tok, tgt, 0.1f, 1);
  m.backward_input_stage(0);
  EXPECT_TRUE(m.weight_pass_pending(0));
  EXPECT_FALSE(m.weight_pass_pending(1));
  EXPECT_THROW(m.backward_input_stage(0), InvalidArgumentError) << "one input pass per forward";
  EXPECT_THROW(m.forward_stage(tok, tgt, 0.1f, 0), InvalidArgumentError) << "Bw pending";
  // The other slot is independent.
  m.backward_input_stage(1);
  m.backward_weight_stage(1);
  m.forward_stage(tok, tgt, 0.1f, 1);
  m.backward_weight_stage(0);
  EXPECT_THROW(m.backward_weight_stage(0), InvalidArgumentError) << "one weight pass per input";
  m.forward_stage(tok, tgt, 0.1f, 0);  // free again

  // A reshape (here to the same shape, as a recovery does) drops a pending weight pass.
  m.backward_input_stage(0);
  m.reshape(B, 2);
  EXPECT_FALSE(m.weight_pass_pending(0));
  EXPECT_TRUE(m.split_backward());
  m.forward_stage(tok, tgt, 0.1f, 0);

  // set_split_backward(false) goes back to the plain layout.
  m.set_split_backward(false);
  const Transformer plain(c, *backend, B, T, {}, nullptr, 2);
  EXPECT_EQ(m.activation_bytes(), plain.activation_bytes());
}

// forward_backward / backward_stage on a split model run Bi then Bw: the same gradients.
TEST(SplitBackward, BackwardStageOfASplitModelIsUnchanged) {
  auto backend = kernels::make_backend("cpu");
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.name);
    const int B = 2, T = 8;
    const Batch b0 = test_util::random_batch(B * T, k.config.vocab_size, 1, 5);
    const Batch b1 = test_util::random_batch(B * T, k.config.vocab_size, 2, 4);
    std::vector<float> grads[2];
    for (int split = 0; split < 2; ++split) {
      Transformer m(k.config, *backend, B, T);
      m.set_split_backward(split == 1);
      m.init(5);
      m.forward_backward(b0.tokens.data(), b0.targets.data(), 1.0f / 32);
      m.forward_backward(b1.tokens.data(), b1.targets.data(), 1.0f / 32);
      grads[split] = copy_of(m.grads());
    }
    EXPECT_TRUE(same_bits(grads[1], grads[0]));
  }
}

// The hook runs before each block's and the head's Bi and Bw; a pass it stops leaves a model
// that computes what an untouched one does (the slot is free: its forward runs again).
TEST(SplitBackward, LayerHookSeesEachLayerInEachPassAndMayStopIt) {
  auto backend = kernels::make_backend("cpu");
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig c = ModelConfig::preset(preset);
    c.n_layer = 2;
    const int B = 2, T = 8;
    const Batch b = test_util::random_batch(B * T, c.vocab_size, 6, 5);
    for (Recompute r : kModes) {
      SCOPED_TRACE(testing::Message() << preset << " " << recompute_name(r));
      Transformer m(c, *backend, B, T, {}, nullptr, 1, r);
      m.set_split_backward(true);
      m.init(2);
      auto step = [&] {
        m.zero_grad();
        m.forward_stage(b.tokens.data(), b.targets.data(), 0.05f);
        m.backward_input_stage();
        m.backward_weight_stage();
        return copy_of(m.grads());
      };
      const std::vector<float> want = step();
      const int per_pass = c.n_layer + 1;
      int calls = 0;
      m.set_layer_hook([&] { ++calls; });
      EXPECT_TRUE(same_bits(step(), want));
      EXPECT_EQ(calls, 3 * per_pass);
      for (int stop_at = 1; stop_at <= 3 * per_pass; ++stop_at) {
        SCOPED_TRACE(testing::Message() << "stopped at call " << stop_at);
        calls = 0;
        m.set_layer_hook([&] {
          if (++calls == stop_at) throw std::runtime_error("stop");
        });
        EXPECT_THROW(step(), std::runtime_error);
        EXPECT_FALSE(m.weight_pass_pending(0));
        m.set_layer_hook({});
        EXPECT_TRUE(same_bits(step(), want));
      }
    }
  }
}

// ---- memory ------------------------------------------------------------------------------------

// transformer.h's statement of the activation memory, term by term, in floats; every buffer is
// rounded up to 16 floats (64 bytes).
int64_t expected_activation_floats(const ModelConfig& c, int B, int T, const StageRange& range,
                                   int tp, int slots, Recompute r, bool split) {
  auto r16 = [](int64_t n) { return (n + 15) / 16 * 16; };
  const bool gpt2 = c.family == Family::gpt2;
  const int64_t N = int64_t(B) * T, C = c.n_embd, D = c.head_dim(), F = c.ffn_hidden / tp;
  const int64_t Hq = c.n_head / tp;
  const bool kv_replicated = c.n_kv_head % tp != 0;
  const int64_t Hkv = kv_replicated ? 1 : c.n_kv_head / tp;
  const int64_t Vp = c.padded_vocab() / tp;
  const int64_t L = range.num_layers();
  const int64_t stats = gpt2 ? 2 : 1;  // floats per row of a norm's statistics (mean, rstd)
  const int64_t qkv = (Hq + 2 * Hkv) * D;
  const bool norm_bias = gpt2 && c.bias;
  // A: a block's activations but its output and attention probabilities; X: the inputs of its
  // linears (part of A); G: what a split backward keeps for the weight pass.
  const int64_t A = 3 * r16(N * C) + 2 * stats * r16(N) + r16(N * qkv) + r16(N * Hq * D) +
                    (gpt2 ? 2 : 3) * r16(N * F);
  const int64_t X = 2 * r16(N * C) + r16(N * Hq * D) + r16(N * F);
  const int64_t G =
      2 * r16(N * C) + r16(N * qkv) + (gpt2 ? 1 : 2) * r16(N * F) + r16((norm_bias ? 4 : 2) * C);
  const int64_t O = r16(N * C), P = r16(int64_t(B) * Hq * T * T);
  int64_t per_block_slot = 0, once = 0;
  switch (r) {
    case Recompute::none:
      per_block_slot = O + A + P;
      break;
    case Recompute::selective:
      per_block_slot = O + A;
      once = P;
      break;
    case Recompute::full:
      per_block_slot = split ? O + X : O;
      once = split ? A - X + P : A + P;
      break;
  }
  if (split) per_block_slot += G;
  if (L == 0) once = 0;
  int64_t per_slot = r16(N * C);  // x0
  if (range.has_head) {
    per_slot += r16(N * C) + stats * r16(N) + r16(N * Vp) + r16(N);
    if (tp > 1) per_slot += r16(N) + r16(2 * N);
    if (split) per_slot += r16(norm_bias ? 2 * C : C);
  }
  if (range.has_embedding && split) per_slot += r16(N * C);
  int64_t scratch = 3 * r16(N * C);
  if (L > 0) {
    scratch += r16(N * Hq * D);
    scratch += split ? r16(N * F) : r16(N * qkv) + (gpt2 ? 2 : 3) * r16(N * F);
    if (kv_replicated) scratch += r16(2 * int64_t(c.n_kv_head) * D * C);
  }
  return scratch + once + slots * (per_slot + L * per_block_slot);
}

// Odd B and T so that buffers are not multiples of 64 bytes and the rounding counts.
TEST(SplitBackward, ActivationBytesAreExactlyTheStatedFormula) {
  auto backend = kernels::make_backend("reference");
  const int B = 3, T = 7;
  for (const Case& k : cases()) {
    const ModelConfig& c = k.config;
    const std::vector<StageRange> ranges = {StageRange{}, StageRange::layers(c, 0, 1),
                                            StageRange::layers(c, 1, 2),
                                            StageRange::layers(c, 1, 3)};
    for (int tp : {1, 2, 4}) {
      // Only the sizes are checked: the tp model is built, never run, so no peer is needed.
      auto groups = LocalTpGroup::create(tp);
      TpGroup* group = groups[0].get();
      for (const StageRange& range : ranges) {
        for (int slots : {1, 3}) {
          for (Recompute r : kModes) {
            SCOPED_TRACE(testing::Message()
                         << k.name << " tp " << tp << " layers [" << range.layer_begin << ", "
                         << range.layer_end << ") slots " << slots << " " << recompute_name(r));
            Transformer m(c, *backend, B, T, range, group, slots, r);
            const size_t plain = m.activation_bytes();
            EXPECT_EQ(plain,
                      size_t(expected_activation_floats(c, B, T, m.stage(), tp, slots, r, false)) *
                          sizeof(float));
            m.set_split_backward(true);
            EXPECT_EQ(m.activation_bytes(),
                      size_t(expected_activation_floats(c, B, T, m.stage(), tp, slots, r, true)) *
                          sizeof(float));
            EXPECT_GT(m.activation_bytes(), plain);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace tessel::model
