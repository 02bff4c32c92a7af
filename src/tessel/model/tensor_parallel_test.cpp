// Tensor parallelism end to end: tp ranks as threads (LocalTpGroup), each building its shard of
// a Transformer, against the same model built whole (tp = 1).
//
// Tolerances. The shards compute the same sums as the whole model, split into tp partial sums
// that are rounded to float before the all-reduce adds them; the GEMMs also block differently
// at the smaller shapes. So results agree to float rounding, not bit for bit:
// - the loss to kLossTol relative (the acceptance bound; measured <= 2e-6 after 4 AdamW steps),
// - every gradient element to kGradTol of its tensor's largest gradient (measured <= 7.4e-7).
// - After AdamW steps: AdamW divides by the gradient's RMS, so an element whose true gradient is
//   below the rounding noise moves by up to lr per step following its noise, differently in the
//   two runs (the gpt2 key bias has an exactly zero gradient: softmax ignores a shift of all
//   scores). Those elements are left out; over the elements whose first gradient stands above
//   kGradNoise of the tensor's peak, parameters differ by at most kParamMaxTol of the largest
//   AdamW movement lr * steps (measured 0.24%), and by at most kParamRelTol of the norm of the
//   update itself (measured 2.4e-4).
// Initial parameters, and the gradients and parameters of copies of replicated elements across
// ranks, are compared bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/tp_group.h"
#include "tessel/model/tp_shard.h"
#include "tessel/model/transformer.h"
#include "tessel/tensor/box_copy.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

constexpr double kLossTol = 1e-5;
constexpr double kGradTol = 1e-5;
constexpr float kLr = 1e-2f;
constexpr double kParamMaxTol = 1e-2;
constexpr double kParamRelTol = 1e-3;
constexpr double kGradNoise = 1e-6;

struct Batch {
  std::vector<int32_t> tokens, targets;
  int64_t valid = 0;
};

// Random tokens and targets, every 5th target ignored; every vocabulary shard sees tokens.
Batch random_batch(int B, int T, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int i = 0; i < B * T; ++i) b.tokens.push_back(int32_t(rng() % uint64_t(V)));
  for (int i = 0; i < B * T; ++i) {
    const bool ignore = i % 5 == 4;
    b.targets.push_back(ignore ? -1 : int32_t(rng() % uint64_t(V)));
    b.valid += ignore ? 0 : 1;
  }
  b.tokens[0] = V - 1;  // the last real token, in the last shard holding real rows
  b.targets[1] = V - 1;
  return b;
}

struct Case {
  std::string name;
  ModelConfig config;
  int tp;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

ModelConfig small(const char* preset, int n_kv_head = 0) {
  ModelConfig c = ModelConfig::preset(preset);
  c.n_layer = 2;
  if (n_kv_head > 0) c.n_kv_head = n_kv_head;
  return c;
}

// gpt2 (fused QKV, biases, tied head), llama with 2 kv heads (split at tp 2, replicated at tp
// 4) and multi-query llama (one kv head, replicated on every rank).
std::vector<Case> cases() {
  std::vector<Case> out;
  for (int tp : {2, 4}) {
    out.push_back({"gpt2_tp" + std::to_string(tp), small("gpt2-tiny"), tp});
    out.push_back({"llama_tp" + std::to_string(tp), small("llama-tiny"), tp});
    out.push_back({"llama_mqa_tp" + std::to_string(tp), small("llama-tiny", 1), tp});
  }
  return out;
}

std::vector<float> to_vector(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// The elements of the global tensor `whole` that rank's shard holds, laid out like the shard.
std::vector<float> shard_of(const std::vector<float>& whole, const ParamSpec& spec,
                            const ModelConfig& c, int rank, int tp) {
  const Shape local = tp_local_shape(spec, c, rank, tp);
  std::vector<float> out(size_t(local.numel())), piece;
  for (const ShardPiece& pc : tp_shard_pieces(spec, c, rank, tp)) {
    piece.resize(size_t(pc.global.volume()));
    pack_box(whole.data(), spec.shape, pc.global, piece.data(), sizeof(float));
    unpack_box(piece.data(), pc.local, out.data(), local, sizeof(float));
  }
  return out;
}

// Adds the shard of a random global perturbation to every parameter, so that biases (zero at
// init) and norm weights (one) are not special values: a bias added by every rank instead of
// once, say, must show.
void perturb(Transformer& m) {
  for (const ParamView& v : m.param_views()) {
    const ParamSpec& ps = m.spec().at(v.name);
    const std::vector<float> whole =
        testing::random_normal(size_t(ps.numel()), std::hash<std::string>{}(ps.name), 0.02f);
    const std::vector<float> mine = shard_of(whole, ps, m.config(), m.tp_rank(), m.tp_size());
    float* dst = m.param(v.name).data<float>();
    for (size_t i = 0; i < mine.size(); ++i) dst[i] += mine[i];
  }
}

// What one rank (or the whole model) produced.
struct RankResult {
  std::vector<double> losses;                              // per step
  std::vector<std::vector<float>> initial, params, grads;  // per parameter
  std::vector<float> logits;
};

// Runs `steps` AdamW steps of one model on one batch (so that the loss falls); keeps the first
// step's gradients (before its update). steps = 0: one forward_backward, no update.
RankResult train(const ModelConfig& c, TpGroup* tp, int B, int T, int steps, uint64_t seed) {
  auto backend = kernels::make_backend("cpu");
  Transformer m(c, *backend, B, T, {}, tp);
  RankResult out;
  m.init(seed);
  perturb(m);
  const auto& views = m.param_views();
  for (const ParamView& v : views) out.initial.push_back(to_vector(m.param(v.name)));
  std::vector<float> adam_m(size_t(m.num_params()), 0.0f), adam_v(adam_m);
  for (int step = 0; step < std::max(steps, 1); ++step) {
    Batch b = random_batch(B, T, c.vocab_size, seed + 100);
    m.zero_grad();
    auto r = m.forward_backward(b.tokens.data(), b.targets.data(), 1.0f / float(b.valid));
    EXPECT_EQ(r.valid, b.valid);
    out.losses.push_back(r.loss_sum / double(r.valid));
    if (step == 0) {
      for (const ParamView& v : views) out.grads.push_back(to_vector(m.grad(v.name)));
    }
    if (steps == 0) break;
    for (const ParamView& v : views) {
      kernels::AdamWConfig cfg;
      cfg.lr = kLr;
      cfg.weight_decay = v.weight_decay ? 0.1f : 0.0f;
      cfg.step = step + 1;
      backend->adamw_update(m.params().data<float>() + v.offset, m.grads().data<float>() + v.offset,
                            adam_m.data() + v.offset, adam_v.data() + v.offset, v.numel, cfg);
    }
  }
  for (const ParamView& v : views) out.params.push_back(to_vector(m.param(v.name)));
  return out;
}

std::vector<RankResult> train_tp(const Case& tc, int B, int T, int steps, uint64_t seed) {
  std::vector<RankResult> ranks(static_cast<size_t>(tc.tp));
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    ranks[size_t(g.rank())] = train(tc.config, &g, B, T, steps, seed);
  });
  return ranks;
}

class TensorParallel : public ::testing::TestWithParam<Case> {};

INSTANTIATE_TEST_SUITE_P(Models, TensorParallel, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Shards are generated as boxes of the global tensors: bit-identical slices of the tp = 1 model.
TEST_P(TensorParallel, InitialShardsAreExactSlices) {
  const Case& tc = GetParam();
  auto backend = kernels::make_backend("cpu");
  Transformer whole(tc.config, *backend, 1, 4);
  whole.init(3);
  auto groups = LocalTpGroup::create(tc.tp);  // construction and init do not communicate
  int64_t total = 0;
  for (int r = 0; r < tc.tp; ++r) {
    Transformer shard(tc.config, *backend, 1, 4, {}, groups[size_t(r)].get());
    shard.init(3);
    EXPECT_EQ(shard.tp_rank(), r);
    EXPECT_EQ(shard.tp_size(), tc.tp);
    for (const ParamView& v : shard.param_views()) {
      const ParamSpec& spec = shard.spec().at(v.name);
      EXPECT_EQ(v.shape, tp_local_shape(spec, tc.config, r, tc.tp)) << v.name;
      EXPECT_EQ(v.tp_copies, tp_copies(spec, tc.config, tc.tp)) << v.name;
      EXPECT_EQ(v.tp_primary, tp_is_primary(spec, tc.config, r, tc.tp)) << v.name;
      if (v.tp_primary) total += v.numel;
      const std::vector<float> want =
          shard_of(to_vector(whole.param(v.name)), spec, tc.config, r, tc.tp);
      const std::vector<float> got = to_vector(shard.param(v.name));
      ASSERT_EQ(got.size(), want.size()) << v.name;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << v.name;
    }
  }
  // Counting each primary copy once gives the whole model.
  EXPECT_EQ(total, whole.num_params());
}

// The forward logits of the shards are the column slices of the whole model's logits.
TEST_P(TensorParallel, LogitsAreVocabularySlices) {
  const Case& tc = GetParam();
  const int B = 2, T = 5;
  const ModelConfig& c = tc.config;
  Batch b = random_batch(B, T, c.vocab_size, 9);
  auto backend = kernels::make_backend("cpu");
  Transformer whole(c, *backend, B, T);
  whole.init(4);
  whole.forward(b.tokens.data(), nullptr);
  const std::vector<float> full = to_vector(whole.logits());
  const double peak = max_abs(full);
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    auto be = kernels::make_backend("cpu");
    Transformer m(c, *be, B, T, {}, &g);
    m.init(4);
    m.forward(b.tokens.data(), nullptr);
    const TpVocabRange vr = tp_vocab_range(c, g.rank(), g.size());
    ASSERT_EQ(m.logits().shape(), (Shape{B, T, vr.rows}));
    const std::vector<float> mine = to_vector(m.logits());
    double err = 0;
    for (int n = 0; n < B * T; ++n) {
      for (int v = 0; v < vr.rows; ++v) {
        err = std::max(err, std::fabs(double(mine[size_t(n) * vr.rows + v]) -
                                      full[size_t(n) * c.padded_vocab() + vr.start + v]));
      }
    }
    EXPECT_LE(err, 1e-5 * peak) << "rank " << g.rank();
  });
}

// One forward_backward: the same loss on every rank as the whole model's, every local gradient
// equal to its slice of the whole model's gradient, replicated gradients identical across ranks.
TEST_P(TensorParallel, LossAndGradientsMatchTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 8;
  RankResult base = train(tc.config, nullptr, B, T, 0, 5);
  std::vector<RankResult> ranks = train_tp(tc, B, T, 0, 5);
  const ModelSpec spec = ModelSpec::from(tc.config);
  for (int r = 0; r < tc.tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_NEAR(ranks[size_t(r)].losses[0], base.losses[0], kLossTol * base.losses[0]);
    // Every rank computes the same loss from the same reduced statistics.
    EXPECT_EQ(ranks[size_t(r)].losses[0], ranks[0].losses[0]);
    for (size_t i = 0; i < spec.size(); ++i) {
      const ParamSpec& ps = spec[i];
      const std::vector<float> want = shard_of(base.grads[i], ps, tc.config, r, tc.tp);
      const std::vector<float>& got = ranks[size_t(r)].grads[i];
      const double peak = max_abs(base.grads[i]);
      EXPECT_GT(peak, 0.0) << ps.name;
      EXPECT_LE(testing::max_abs_error(got, want), kGradTol * peak) << ps.name;
      // Copies of the same elements carry bit-identical gradients (so identical updates keep
      // them in sync): compare with the first rank holding the same pieces.
      const auto pieces = tp_shard_pieces(ps, tc.config, r, tc.tp);
      for (int q = 0; q < r; ++q) {
        if (tp_shard_pieces(ps, tc.config, q, tc.tp) != pieces) continue;
        EXPECT_EQ(
            std::memcmp(got.data(), ranks[size_t(q)].grads[i].data(), got.size() * sizeof(float)),
            0)
            << ps.name << " differs between ranks " << q << " and " << r;
        break;
      }
    }
  }
}

// AdamW steps on every rank's shard follow the whole model: per-step losses and final
// parameters, and replicated parameters stay bit-identical across ranks.
TEST_P(TensorParallel, AdamWStepsFollowTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 8, steps = 4;
  RankResult base = train(tc.config, nullptr, B, T, steps, 6);
  std::vector<RankResult> ranks = train_tp(tc, B, T, steps, 6);
  const ModelSpec spec = ModelSpec::from(tc.config);
  // The losses must move, or the comparison says little.
  EXPECT_LT(base.losses.back(), base.losses.front() - 0.05);
  for (int r = 0; r < tc.tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    for (int s = 0; s < steps; ++s) {
      EXPECT_NEAR(ranks[size_t(r)].losses[size_t(s)], base.losses[size_t(s)],
                  kLossTol * base.losses[size_t(s)])
          << "step " << s;
    }
    for (size_t i = 0; i < spec.size(); ++i) {
      const ParamSpec& ps = spec[i];
      const std::vector<float> want = shard_of(base.params[i], ps, tc.config, r, tc.tp);
      const std::vector<float>& got = ranks[size_t(r)].params[i];
      // Elements whose gradient stands above the rounding noise follow closely.
      const std::vector<float> init = shard_of(base.initial[i], ps, tc.config, r, tc.tp);
      const std::vector<float> grad0 = shard_of(base.grads[i], ps, tc.config, r, tc.tp);
      const double noise = kGradNoise * max_abs(base.grads[i]);
      double diff = 0, update = 0, worst = 0;
      for (size_t k = 0; k < want.size(); ++k) {
        if (std::fabs(grad0[k]) <= noise) continue;
        diff += std::pow(double(got[k]) - want[k], 2);
        update += std::pow(double(want[k]) - init[k], 2);
        worst = std::max(worst, std::fabs(double(got[k]) - want[k]));
      }
      EXPECT_LE(worst, kParamMaxTol * kLr * steps) << ps.name;
      // (A shard of vocabulary padding only gets no update: then it must equal exactly.)
      EXPECT_LE(std::sqrt(diff), kParamRelTol * std::sqrt(update)) << ps.name;
      if (tp_copies(ps, tc.config, tc.tp) == tc.tp && r > 0) {
        EXPECT_EQ(ranks[size_t(r)].params[i], ranks[0].params[i]) << ps.name;
      }
    }
  }
}

// Pipeline stages of tensor-parallel shards, chained by hand, reproduce the whole model: every
// tp rank builds both stages and passes its (replicated) boundary activations and gradients.
TEST_P(TensorParallel, PipelineStagesOfShardsMatchTheWholeModel) {
  const Case& tc = GetParam();
  const int B = 2, T = 6;
  const ModelConfig& c = tc.config;
  RankResult base = train(c, nullptr, B, T, 0, 7);
  Batch b = random_batch(B, T, c.vocab_size, 7 + 100);
  const ModelSpec spec = ModelSpec::from(c);
  std::vector<double> losses(static_cast<size_t>(tc.tp));
  std::vector<std::vector<std::vector<float>>> grads(static_cast<size_t>(tc.tp));
  LocalTpGroup::run(tc.tp, [&](TpGroup& g) {
    auto be = kernels::make_backend("cpu");
    Transformer s0(c, *be, B, T, StageRange::layers(c, 0, 1), &g);
    Transformer s1(c, *be, B, T, StageRange::layers(c, 1, 2), &g);
    s0.init(7);
    s1.init(7);
    perturb(s0);
    perturb(s1);
    s0.zero_grad();
    s1.zero_grad();
    s0.forward_stage(b.tokens.data(), nullptr);
    std::memcpy(s1.input_hidden().data<float>(), s0.output_hidden().data<float>(),
                size_t(s0.output_hidden().numel()) * sizeof(float));
    auto r = s1.forward_stage(nullptr, b.targets.data(), 1.0f / float(b.valid));
    losses[size_t(g.rank())] = r.loss_sum / double(r.valid);
    s1.backward_stage();
    std::memcpy(s0.output_grad().data<float>(), s1.input_grad().data<float>(),
                size_t(s1.input_grad().numel()) * sizeof(float));
    s0.backward_stage();
    // A tied embedding is in both stages; its gradient is the sum of the two.
    for (const ParamSpec& ps : spec) {
      std::vector<float> sum;
      for (Transformer* s : {&s0, &s1}) {
        if (!s->spec().contains(ps.name)) continue;
        std::vector<float> part = to_vector(s->grad(ps.name));
        if (sum.empty()) sum.assign(part.size(), 0.0f);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
      }
      grads[size_t(g.rank())].push_back(std::move(sum));
    }
  });
  for (int r = 0; r < tc.tp; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    EXPECT_NEAR(losses[size_t(r)], base.losses[0], kLossTol * base.losses[0]);
    for (size_t i = 0; i < spec.size(); ++i) {
      const std::vector<float> want = shard_of(base.grads[i], spec[i], c, r, tc.tp);
      EXPECT_LE(testing::max_abs_error(grads[size_t(r)][i], want),
                kGradTol * max_abs(base.grads[i]))
          << spec[i].name;
    }
  }
}

TEST(TensorParallelErrors, RejectsModelsThatDoNotSplit) {
  auto backend = kernels::make_backend("cpu");
  auto three = LocalTpGroup::create(3);
  EXPECT_THROW(Transformer(small("gpt2-tiny"), *backend, 1, 4, {}, three[0].get()), ConfigError);
  // A group of one is plain single-rank execution.
  auto one = LocalTpGroup::create(1);
  Transformer m(small("llama-tiny"), *backend, 1, 4, {}, one[0].get());
  EXPECT_EQ(m.tp_group(), nullptr);
  EXPECT_EQ(m.num_params(), small("llama-tiny").num_params());
}

}  // namespace
}  // namespace tessel::model
