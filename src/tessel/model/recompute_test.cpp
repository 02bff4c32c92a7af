// Activation recomputation (recompute.h): selective and full recomputation give losses, logits and
// gradients bit-identical to keeping every activation -- whole models and pipeline stages, with
// activation slots whose forwards and backwards interleave, with tensor parallelism -- while
// holding exactly the activation memory transformer.h states.
//
// Bit-identity, not a tolerance: a recomputation runs the same kernels on the same inputs as the
// forward did (and, with tensor parallelism, the same collectives in the same order on every
// rank), so any difference is a bug (a buffer read after another block or slot overwrote it, a
// missed or misplaced recomputation).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
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

// ---- whole models ------------------------------------------------------------------------------

struct WholeRun {
  kernels::CrossEntropyResult forward_loss;
  std::vector<float> logits;
  std::vector<kernels::CrossEntropyResult> losses;
  std::vector<float> dlogits, grads;
};

// forward() (loss and logits), then two forward_backward calls on different batches, gradients
// accumulating.
WholeRun run_whole(const ModelConfig& c, kernels::Backend& backend, Recompute r) {
  const int B = 2, T = 8;
  Transformer m(c, backend, B, T, {}, nullptr, 1, r);
  EXPECT_EQ(m.recompute(), r);
  m.init(5);
  const Batch b0 = test_util::random_batch(B * T, c.vocab_size, 1, 5);
  const Batch b1 = test_util::random_batch(B * T, c.vocab_size, 2, 4);
  WholeRun out;
  out.forward_loss = m.forward(b0.tokens.data(), b0.targets.data());
  out.logits = copy_of(m.logits());
  out.losses.push_back(m.forward_backward(b0.tokens.data(), b0.targets.data(), 1.0f / 32));
  out.losses.push_back(m.forward_backward(b1.tokens.data(), b1.targets.data(), 1.0f / 32));
  out.dlogits = copy_of(m.logits());
  out.grads = copy_of(m.grads());
  return out;
}

TEST(ActivationRecompute, WholeModelsAreBitIdenticalToKeepingEverything) {
  for (const char* backend_name : {"reference", "cpu"}) {
    auto backend = kernels::make_backend(backend_name);
    for (const Case& k : cases()) {
      const WholeRun want = run_whole(k.config, *backend, Recompute::none);
      for (Recompute r : {Recompute::selective, Recompute::full}) {
        SCOPED_TRACE(testing::Message()
                     << backend_name << " " << k.name << " " << recompute_name(r));
        const WholeRun got = run_whole(k.config, *backend, r);
        EXPECT_TRUE(same_bits(got.forward_loss, want.forward_loss));
        EXPECT_TRUE(same_bits(got.logits, want.logits));
        for (size_t i = 0; i < want.losses.size(); ++i)
          EXPECT_TRUE(same_bits(got.losses[i], want.losses[i])) << "forward_backward " << i;
        EXPECT_TRUE(same_bits(got.dlogits, want.dlogits));
        EXPECT_TRUE(same_bits(got.grads, want.grads));
      }
    }
  }
}

// ---- pipeline stages with activation slots -----------------------------------------------------

// One op of a stage-chain schedule: the forward or the backward of micro-batch `mb`, which lives
// in activation slot `mb` of every stage.
struct Op {
  bool forward;
  int mb;
};

struct PipelineRun {
  std::vector<kernels::CrossEntropyResult> losses;  // per micro-batch
  std::vector<std::vector<float>> dlogits;          // per micro-batch, right after its forward
  std::vector<std::vector<float>> grads;            // per stage, after the schedule
  std::vector<size_t> bytes;                        // activation_bytes() per stage
};

// Runs `schedule` on a chain of stages (ranges) built with `r`, hidden states and their
// gradients copied between neighbours by hand, as the runtime's pipeline does.
PipelineRun run_pipeline(const ModelConfig& c, kernels::Backend& backend,
                         const std::vector<StageRange>& ranges, Recompute r, TpGroup* tp,
                         const std::vector<Op>& schedule) {
  const int B = 2, T = 8, N = B * T;
  int micro_batches = 0;
  for (const Op& op : schedule) micro_batches = std::max(micro_batches, op.mb + 1);
  std::vector<std::unique_ptr<Transformer>> st;
  for (const StageRange& range : ranges) {
    st.push_back(std::make_unique<Transformer>(c, backend, B, T, range, tp, micro_batches, r));
    st.back()->init(9);
  }
  std::vector<Batch> mbs;
  for (int m = 0; m < micro_batches; ++m)
    mbs.push_back(test_util::random_batch(N, c.vocab_size, 20 + uint64_t(m), 3 + m));
  const size_t hidden_bytes = size_t(N) * size_t(c.n_embd) * sizeof(float);
  PipelineRun out;
  out.losses.resize(size_t(micro_batches));
  out.dlogits.resize(size_t(micro_batches));
  for (const Op& op : schedule) {
    const size_t m = size_t(op.mb);
    if (op.forward) {
      for (size_t s = 0; s < st.size(); ++s) {
        if (s > 0) {
          std::memcpy(st[s]->input_hidden(op.mb).raw(), st[s - 1]->output_hidden(op.mb).raw(),
                      hidden_bytes);
        }
        const int32_t* tokens = s == 0 ? mbs[m].tokens.data() : nullptr;
        out.losses[m] = st[s]->forward_stage(tokens, mbs[m].targets.data(), 1.0f / 40, op.mb);
      }
      out.dlogits[m] = copy_of(st.back()->logits(op.mb));
    } else {
      for (size_t s = st.size(); s-- > 0;) {
        if (s + 1 < st.size()) {
          std::memcpy(st[s]->output_grad(op.mb).raw(), st[s + 1]->input_grad(op.mb).raw(),
                      hidden_bytes);
        }
        st[s]->backward_stage(op.mb);
      }
    }
  }
  for (const auto& m : st) {
    out.grads.push_back(copy_of(m->grads()));
    out.bytes.push_back(m->activation_bytes());
  }
  return out;
}

void expect_same(const PipelineRun& got, const PipelineRun& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t m = 0; m < want.losses.size(); ++m) {
    EXPECT_TRUE(same_bits(got.losses[m], want.losses[m])) << "loss of micro-batch " << m;
    EXPECT_TRUE(same_bits(got.dlogits[m], want.dlogits[m])) << "dlogits of micro-batch " << m;
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t s = 0; s < want.grads.size(); ++s)
    EXPECT_TRUE(same_bits(got.grads[s], want.grads[s])) << "gradients of stage " << s;
}

// Three stages of one block each -- the first (embedding), a middle one, the head -- and three
// slots: forwards of slots 0, 1, 2, then backwards in the order 1, 0, 2; and a schedule mixing
// forwards and backwards. Recomputation in one slot's backward must not depend on, or disturb,
// what the other slots hold.
TEST(ActivationRecompute, InterleavedSlotsOnPipelineStagesAreBitIdentical) {
  auto backend = kernels::make_backend("cpu");
  const std::vector<std::vector<Op>> schedules = {
      {{true, 0}, {true, 1}, {true, 2}, {false, 1}, {false, 0}, {false, 2}},
      {{true, 0}, {true, 1}, {false, 0}, {true, 2}, {false, 2}, {false, 1}}};
  for (const Case& k : cases()) {
    const ModelConfig& c = k.config;
    const std::vector<StageRange> ranges = {
        StageRange::layers(c, 0, 1), StageRange::layers(c, 1, 2), StageRange::layers(c, 2, 3)};
    for (size_t i = 0; i < schedules.size(); ++i) {
      const PipelineRun want =
          run_pipeline(c, *backend, ranges, Recompute::none, nullptr, schedules[i]);
      for (Recompute r : {Recompute::selective, Recompute::full}) {
        SCOPED_TRACE(testing::Message() << k.name << " schedule " << i << " " << recompute_name(r));
        const PipelineRun got = run_pipeline(c, *backend, ranges, r, nullptr, schedules[i]);
        expect_same(got, want);
        for (size_t s = 0; s < ranges.size(); ++s)
          EXPECT_LT(got.bytes[s], want.bytes[s]) << "stage " << s;
      }
    }
  }
}

// Tensor parallelism: tp ranks as threads. Every rank recomputes the row-parallel all-reduces of
// its blocks in the same order, so each rank's results equal its own without recomputation. A
// whole model, and two stages (blocks 0-1 with the embedding, block 2 with the head) with two
// interleaved slots. The llama cases split kv heads (tp 2) and replicate them (tp 4 on 2 kv
// heads, and multi-query), which adds the kv-gradient all-reduce to the backward.
TEST(ActivationRecompute, TensorParallelRanksAreBitIdentical) {
  struct TpCase {
    size_t case_index;  // into cases()
    int tp;
  };
  const std::vector<Case> all = cases();
  const std::vector<TpCase> tp_cases = {{0, 2}, {3, 2}, {3, 4}, {4, 2}};
  const std::vector<Op> schedule = {{true, 0}, {true, 1}, {false, 1}, {false, 0}};
  for (const TpCase& tc : tp_cases) {
    const ModelConfig& c = all[tc.case_index].config;
    const std::vector<std::vector<StageRange>> layouts = {
        {StageRange{}}, {StageRange::layers(c, 0, 2), StageRange::layers(c, 2, 3)}};
    for (size_t li = 0; li < layouts.size(); ++li) {
      // [mode][rank]
      std::vector<std::vector<PipelineRun>> runs(3, std::vector<PipelineRun>(size_t(tc.tp)));
      LocalTpGroup::run(tc.tp, [&](TpGroup& group) {
        auto backend = kernels::make_backend("cpu");
        for (size_t mi = 0; mi < 3; ++mi) {
          runs[mi][size_t(group.rank())] =
              run_pipeline(c, *backend, layouts[li], kModes[mi], &group, schedule);
        }
      });
      for (size_t mi = 1; mi < 3; ++mi) {
        for (int rank = 0; rank < tc.tp; ++rank) {
          SCOPED_TRACE(testing::Message() << all[tc.case_index].name << " tp " << tc.tp << " rank "
                                          << rank << (li == 0 ? " whole" : " two stages") << " "
                                          << recompute_name(kModes[mi]));
          expect_same(runs[mi][size_t(rank)], runs[0][size_t(rank)]);
        }
      }
    }
  }
}

// ---- memory ------------------------------------------------------------------------------------

// transformer.h's statement of the activation memory, term by term, in floats; every buffer is
// rounded up to 16 floats (64 bytes).
int64_t expected_activation_floats(const ModelConfig& c, int B, int T, const StageRange& range,
                                   int tp, int slots, Recompute r) {
  auto r16 = [](int64_t n) { return (n + 15) / 16 * 16; };
  const bool gpt2 = c.family == Family::gpt2;
  const int64_t N = int64_t(B) * T, C = c.n_embd, D = c.head_dim(), F = c.ffn_hidden / tp;
  const int64_t Hq = c.n_head / tp;
  const bool kv_replicated = c.n_kv_head % tp != 0;
  const int64_t Hkv = kv_replicated ? 1 : c.n_kv_head / tp;
  const int64_t Vp = c.padded_vocab() / tp;
  const int64_t L = range.num_layers();
  const int64_t stats = gpt2 ? 2 : 1;  // floats per row of a norm's statistics (mean, rstd)
  // A: a block's activations but its output and attention probabilities.
  const int64_t A = 3 * r16(N * C) + 2 * stats * r16(N) + r16(N * (Hq + 2 * Hkv) * D) +
                    r16(N * Hq * D) + (gpt2 ? 2 : 3) * r16(N * F);
  const int64_t O = r16(N * C), P = r16(int64_t(B) * Hq * T * T);
  int64_t per_block_slot = 0, once = 0;
  switch (r) {
    case Recompute::none:
      per_block_slot = O + A + P;
      break;
    case Recompute::selective:
      per_block_slot = O + A;
      once = L > 0 ? P : 0;
      break;
    case Recompute::full:
      per_block_slot = O;
      once = L > 0 ? A + P : 0;
      break;
  }
  int64_t per_slot = r16(N * C);  // x0
  if (range.has_head) {
    per_slot += r16(N * C) + stats * r16(N) + r16(N * Vp) + r16(N);
    if (tp > 1) per_slot += r16(N) + r16(2 * N);
  }
  int64_t scratch = 3 * r16(N * C);
  if (L > 0) {
    scratch += r16(N * Hq * D) + r16(N * (Hq + 2 * Hkv) * D) + (gpt2 ? 2 : 3) * r16(N * F);
    if (kv_replicated) scratch += r16(2 * int64_t(c.n_kv_head) * D * C);
  }
  return scratch + once + slots * (per_slot + L * per_block_slot);
}

// Odd B and T so that buffers are not multiples of 64 bytes and the rounding counts.
TEST(ActivationRecompute, ActivationBytesAreExactlyTheStatedFormula) {
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
          size_t previous = 0;
          for (Recompute r : kModes) {
            SCOPED_TRACE(testing::Message()
                         << k.name << " tp " << tp << " layers [" << range.layer_begin << ", "
                         << range.layer_end << ") slots " << slots << " " << recompute_name(r));
            const Transformer m(c, *backend, B, T, range, group, slots, r);
            const int64_t floats = expected_activation_floats(c, B, T, m.stage(), tp, slots, r);
            EXPECT_EQ(m.activation_bytes(), size_t(floats) * sizeof(float));
            // Each mode keeps less than the one before, unless there is only one block and slot
            // (a shared buffer is then the same size as the one it replaces).
            if (r != Recompute::none && slots * m.stage().num_layers() > 1) {
              EXPECT_LT(m.activation_bytes(), previous);
            } else if (r != Recompute::none) {
              EXPECT_EQ(m.activation_bytes(), previous);
            }
            previous = m.activation_bytes();
          }
        }
      }
    }
  }
}

// ---- reshape, the layer hook, names
// --------------------------------------------------------------

// The loss and gradients of one forward_backward from zero gradients.
struct StepResult {
  kernels::CrossEntropyResult loss;
  std::vector<float> grads;
  bool same_as(const StepResult& o) const {
    return same_bits(loss, o.loss) && same_bits(grads, o.grads);
  }
};

// reshape keeps the mode; set_recompute changes it (dropping saved activations); either way the
// model computes what a freshly built one does.
TEST(ActivationRecompute, ReshapeKeepsTheModeAndSetRecomputeChangesIt) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset("llama-tiny");
  c.n_layer = 2;
  const int T = 8;
  auto step = [&](Transformer& m, const Batch& b) {
    m.zero_grad();
    return StepResult{m.forward_backward(b.tokens.data(), b.targets.data(), 0.05f),
                      copy_of(m.grads())};
  };

  Transformer m(c, *backend, 2, T, {}, nullptr, 2, Recompute::full);
  m.init(4);
  m.reshape(3, 1);
  EXPECT_EQ(m.recompute(), Recompute::full);
  {
    const Transformer fresh(c, *backend, 3, T, {}, nullptr, 1, Recompute::full);
    EXPECT_EQ(m.activation_bytes(), fresh.activation_bytes());
  }
  const Batch b = test_util::random_batch(3 * T, c.vocab_size, 8, 5);
  Transformer none(c, *backend, 3, T);
  none.init(4);
  const auto want = step(none, b);
  EXPECT_TRUE(step(m, b).same_as(want));

  for (Recompute r : {Recompute::selective, Recompute::none, Recompute::full}) {
    SCOPED_TRACE(recompute_name(r));
    m.forward_stage(b.tokens.data(), b.targets.data(), 0.05f);
    m.set_recompute(r);
    EXPECT_EQ(m.recompute(), r);
    EXPECT_THROW(m.backward_stage(), InvalidArgumentError) << "the forward is forgotten";
    const Transformer fresh(c, *backend, 3, T, {}, nullptr, 1, r);
    EXPECT_EQ(m.activation_bytes(), fresh.activation_bytes());
    EXPECT_TRUE(step(m, b).same_as(want));
  }
  m.reshape(2, 2, Recompute::selective);
  EXPECT_EQ(m.recompute(), Recompute::selective);
  EXPECT_EQ(m.activation_slots(), 2);
}

// The hook is called once per block and head in each pass, as without recomputation (a block's
// recomputation is part of its backward); a pass it stops leaves a model that computes what an
// untouched one does.
TEST(ActivationRecompute, LayerHookSeesEachLayerOncePerPass) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  c.n_layer = 2;
  const int B = 2, T = 8;
  const Batch b = test_util::random_batch(B * T, c.vocab_size, 6, 5);
  auto step = [&](Transformer& m) {
    m.zero_grad();
    return StepResult{m.forward_backward(b.tokens.data(), b.targets.data(), 0.05f),
                      copy_of(m.grads())};
  };
  Transformer none(c, *backend, B, T);
  none.init(2);
  const auto want = step(none);
  const int calls_per_step = 2 * (c.n_layer + 1);
  for (Recompute r : {Recompute::selective, Recompute::full}) {
    Transformer m(c, *backend, B, T, {}, nullptr, 1, r);
    m.init(2);
    int calls = 0;
    m.set_layer_hook([&] { ++calls; });
    step(m);
    EXPECT_EQ(calls, calls_per_step) << recompute_name(r);
    for (int stop_at = 1; stop_at <= calls_per_step; ++stop_at) {
      SCOPED_TRACE(testing::Message() << recompute_name(r) << " stopped at call " << stop_at);
      calls = 0;
      m.set_layer_hook([&] {
        if (++calls == stop_at) throw std::runtime_error("stop");
      });
      EXPECT_THROW(step(m), std::runtime_error);
      m.set_layer_hook({});
      EXPECT_TRUE(step(m).same_as(want));
    }
  }
}

TEST(ActivationRecompute, NamesRoundTripAndUnknownNamesAreConfigErrors) {
  for (Recompute r : kModes) EXPECT_EQ(parse_recompute(recompute_name(r)), r);
  EXPECT_THROW(parse_recompute("partial"), ConfigError);
  EXPECT_THROW(parse_recompute(""), ConfigError);
}

}  // namespace
}  // namespace tessel::model
