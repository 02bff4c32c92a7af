#include "tessel/model/transformer.h"
#include "tessel/model/rounding_test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/init.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

using kernels::Backend;

struct Batch {
  std::vector<int32_t> tokens, targets;
  int64_t valid = 0;
};

// Random tokens and next-token targets; every `ignore_every`-th target is the ignore index.
Batch random_batch(int B, int T, int V, uint64_t seed, int ignore_every = 0) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int i = 0; i < B * T; ++i) b.tokens.push_back(int32_t(rng() % uint64_t(V)));
  for (int i = 0; i < B * T; ++i) {
    const bool ignore = ignore_every > 0 && i % ignore_every == ignore_every - 1;
    b.targets.push_back(ignore ? -1 : int32_t(rng() % uint64_t(V)));
    b.valid += ignore ? 0 : 1;
  }
  return b;
}

ModelConfig tiny(const char* preset, int layers = 6) {
  ModelConfig c = ModelConfig::preset(preset);
  c.n_layer = layers;
  return c;
}

std::span<const float> span_of(const Tensor& t) {
  return {t.data<float>(), size_t(t.numel())};
}

double max_abs(std::span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// Overwrites the parameters with O(1)-scale random values so that every gradient is large
// enough for a finite-difference check to be meaningful (at the 0.02 init they are tiny).
void randomize(Transformer& m, uint64_t seed) {
  for (const ParamView& v : m.param_views()) {
    std::vector<float> r = testing::random_normal(size_t(v.numel), seed++, 1.0f);
    float* dst = m.params().data<float>() + v.offset;
    const bool norm = v.shape.rank() == 1 && v.name.find("bias") == std::string::npos;
    const bool embedding = v.name.find("wte") != std::string::npos ||
                           v.name.find("wpe") != std::string::npos ||
                           v.name.find("embed_tokens") != std::string::npos;
    const float scale = v.shape.rank() == 1 ? 0.3f
                        : embedding         ? 0.5f
                                            : 0.7f / std::sqrt(float(v.shape[1]));
    for (int64_t i = 0; i < v.numel; ++i) dst[i] = (norm ? 1.0f : 0.0f) + scale * r[size_t(i)];
  }
}

// ---- finite differences -------------------------------------------------------------------------

class TransformerGradcheck : public ::testing::TestWithParam<const char*> {};

TEST_P(TransformerGradcheck, AllParameterGradientsMatchFiniteDifferences) {
  auto backend = kernels::make_backend("reference");
  const int B = 2, T = 5;
  ModelConfig c = tiny(GetParam(), 2);
  Transformer m(c, *backend, B, T);
  m.init(1);
  randomize(m, 100);
  Batch batch = random_batch(B, T, c.vocab_size, 42, /*ignore_every=*/4);
  m.zero_grad();
  m.forward_backward(batch.tokens.data(), batch.targets.data(), 1.0f);  // d(loss_sum)
  auto loss = [&] { return m.forward(batch.tokens.data(), batch.targets.data()).loss_sum; };

  testing::GradcheckOptions opt;
  opt.samples = 12;
  opt.h = 1e-2f;
  opt.rtol = 2e-2;
  opt.atol = 2e-3;
  const int C = c.n_embd;
  for (const ParamView& v : m.param_views()) {
    float* x = m.params().data<float>() + v.offset;
    const float* g = m.grads().data<float>() + v.offset;
    int64_t begin = 0, n = v.numel;
    // Embedding tables: only rows of the batch's tokens / positions get gradient from the
    // lookup, so check a used row (the tied head gives the rest of wte a gradient too).
    if (v.name == "transformer.wpe.weight") n = int64_t(T) * C;
    if (v.name == "model.embed_tokens.weight" || v.name == "transformer.wte.weight") {
      begin = int64_t(batch.tokens[3]) * C;
      n = C;
    }
    std::span<float> xs(x + begin, size_t(n));
    std::span<const float> gs(g + begin, size_t(n));
    // The check must be able to fail: the gradient has to stand well above atol.
    EXPECT_GT(max_abs(gs), 20 * opt.atol) << v.name << " has a negligible gradient";
    testing::expect_gradient_matches(v.name, xs, gs, loss, opt);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TransformerGradcheck,
                         ::testing::Values("gpt2-tiny", "llama-tiny"), [](const auto& info) {
                           return std::string(info.param).substr(0, 4) == "gpt2" ? "gpt2" : "llama";
                         });

// ---- cpu vs reference backend ------------------------------------------------------------------

class TransformerBackends : public ::testing::TestWithParam<const char*> {};

// Both backends run the same model from the same init; the cpu kernels sum in other orders
// (GEMM blocking, SIMD lanes, threads), so results agree to float rounding (testing/rounding.h):
// the loss and the logits within the forward pass' chain_tolerance of their scale, every gradient
// element within the forward and backward pass' of its tensor's largest magnitude.
TEST_P(TransformerBackends, CpuMatchesReference) {
  auto ref = kernels::make_backend("reference");
  auto cpu = kernels::make_backend("cpu");
  const int B = 2, T = 16;
  ModelConfig c = tiny(GetParam());
  Transformer mr(c, *ref, B, T), mc(c, *cpu, B, T);
  mr.init(7);
  mc.init(7);
  Batch batch = random_batch(B, T, c.vocab_size, 3, 5);

  const double forward_tol = test_util::step_tolerance(c, B * T, T, /*backward=*/false);
  const double grad_tol = test_util::step_tolerance(c, B * T, T);
  auto lr = mr.forward(batch.tokens.data(), batch.targets.data());
  auto lc = mc.forward(batch.tokens.data(), batch.targets.data());
  EXPECT_EQ(lr.valid, batch.valid);
  EXPECT_EQ(lc.valid, batch.valid);
  EXPECT_NEAR(lc.loss_sum, lr.loss_sum, forward_tol * std::fabs(lr.loss_sum));
  EXPECT_LE(testing::max_abs_error(span_of(mc.logits()), span_of(mr.logits())),
            forward_tol * max_abs(span_of(mr.logits())));

  const float scale = 1.0f / float(batch.valid);
  mr.zero_grad();
  mc.zero_grad();
  lr = mr.forward_backward(batch.tokens.data(), batch.targets.data(), scale);
  lc = mc.forward_backward(batch.tokens.data(), batch.targets.data(), scale);
  EXPECT_NEAR(lc.loss_sum, lr.loss_sum, forward_tol * std::fabs(lr.loss_sum));
  for (const ParamView& v : mr.param_views()) {
    auto gr = span_of(mr.grad(v.name));
    auto gc = span_of(mc.grad(v.name));
    const double peak = max_abs(gr);
    EXPECT_GT(peak, 0.0) << v.name;
    EXPECT_LE(testing::max_abs_error(gc, gr), grad_tol * peak) << v.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TransformerBackends,
                         ::testing::Values("gpt2-tiny", "llama-tiny"), [](const auto& info) {
                           return std::string(info.param).substr(0, 4) == "gpt2" ? "gpt2" : "llama";
                         });

// ---- gradient accumulation and stages -----------------------------------------------------------

class TransformerFamilies : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Families, TransformerFamilies,
                         ::testing::Values("gpt2-tiny", "llama-tiny"), [](const auto& info) {
                           return std::string(info.param).substr(0, 4) == "gpt2" ? "gpt2" : "llama";
                         });

// Two micro-batches of 2 sequences, each with grad_scale 1/(valid tokens of both), give the
// gradient of one batch of all 4 sequences, up to summation order: within the step's
// chain_tolerance of each tensor's largest gradient (testing/rounding.h).
TEST_P(TransformerFamilies, GradientAccumulationEqualsOneBigBatch) {
  auto backend = kernels::make_backend("reference");
  const int T = 6;
  ModelConfig c = tiny(GetParam(), 3);
  Transformer big(c, *backend, 4, T), micro(c, *backend, 2, T);
  big.init(5);
  micro.init(5);
  Batch all = random_batch(4, T, c.vocab_size, 8, 3);
  const float scale = 1.0f / float(all.valid);

  big.zero_grad();
  auto lb = big.forward_backward(all.tokens.data(), all.targets.data(), scale);
  micro.zero_grad();
  const size_t half = size_t(2 * T);
  auto l0 = micro.forward_backward(all.tokens.data(), all.targets.data(), scale);
  auto l1 = micro.forward_backward(all.tokens.data() + half, all.targets.data() + half, scale);
  EXPECT_EQ(l0.valid + l1.valid, lb.valid);
  EXPECT_NEAR(l0.loss_sum + l1.loss_sum, lb.loss_sum, 1e-9 * lb.loss_sum);
  for (const ParamView& v : big.param_views()) {
    auto gb = span_of(big.grad(v.name));
    auto gm = span_of(micro.grad(v.name));
    EXPECT_LE(testing::max_abs_error(gm, gb), test_util::step_tolerance(c, 4 * T, T) * max_abs(gb))
        << v.name;
  }
}

TEST_P(TransformerFamilies, RepeatedBackwardAccumulatesAndZeroGradResets) {
  auto backend = kernels::make_backend("reference");
  ModelConfig c = tiny(GetParam(), 1);
  Transformer m(c, *backend, 1, 4);
  m.init(2);
  Batch b = random_batch(1, 4, c.vocab_size, 1);
  m.forward_backward(b.tokens.data(), b.targets.data(), 0.25f);
  std::vector<float> once(span_of(m.grads()).begin(), span_of(m.grads()).end());
  m.forward_backward(b.tokens.data(), b.targets.data(), 0.25f);
  auto twice = span_of(m.grads());
  for (size_t i = 0; i < once.size(); ++i) ASSERT_FLOAT_EQ(twice[i], 2 * once[i]) << i;
  m.zero_grad();
  EXPECT_EQ(max_abs(span_of(m.grads())), 0.0);
}

// Stages chained by hand (hidden states forward, their gradients backward) reproduce the whole
// model: same logits, loss and gradients. A tied embedding's gradient is the sum of the first
// stage's (lookup) and the last stage's (head) copies.
void expect_stages_match_whole(const ModelConfig& c, const std::vector<StageRange>& ranges) {
  auto backend = kernels::make_backend("reference");
  const int B = 2, T = 7;
  Transformer whole(c, *backend, B, T);
  whole.init(3);
  std::vector<std::unique_ptr<Transformer>> stages;
  for (const StageRange& r : ranges) {
    stages.push_back(std::make_unique<Transformer>(c, *backend, B, T, r));
    stages.back()->init(3);
  }
  Batch batch = random_batch(B, T, c.vocab_size, 4, 4);
  const size_t hidden_bytes = size_t(B) * T * size_t(c.n_embd) * sizeof(float);

  auto run_forward = [&](std::optional<float> scale) {
    kernels::CrossEntropyResult r;
    for (size_t s = 0; s < stages.size(); ++s) {
      if (s > 0) {
        std::memcpy(stages[s]->input_hidden().raw(), stages[s - 1]->output_hidden().raw(),
                    hidden_bytes);
      }
      r = stages[s]->forward_stage(s == 0 ? batch.tokens.data() : nullptr, batch.targets.data(),
                                   scale);
    }
    return r;
  };
  auto rw = whole.forward(batch.tokens.data(), batch.targets.data());
  auto rs = run_forward(std::nullopt);
  EXPECT_EQ(rs.valid, rw.valid);
  EXPECT_EQ(rs.loss_sum, rw.loss_sum);
  auto lw = span_of(whole.logits());
  auto ls = span_of(stages.back()->logits());
  ASSERT_TRUE(std::equal(lw.begin(), lw.end(), ls.begin()));

  const float scale = 1.0f / float(batch.valid);
  whole.zero_grad();
  rw = whole.forward_backward(batch.tokens.data(), batch.targets.data(), scale);
  for (auto& s : stages) s->zero_grad();
  rs = run_forward(scale);
  EXPECT_EQ(rs.loss_sum, rw.loss_sum);
  for (size_t s = stages.size(); s-- > 0;) {
    if (s + 1 < stages.size()) {
      std::memcpy(stages[s]->output_grad().raw(), stages[s + 1]->input_grad().raw(), hidden_bytes);
    }
    stages[s]->backward_stage();
  }

  for (const ParamView& v : whole.param_views()) {
    std::vector<float> sum(size_t(v.numel), 0.0f);
    int holders = 0;
    for (auto& s : stages) {
      if (!s->spec().contains(v.name)) continue;
      ++holders;
      auto g = span_of(s->grad(v.name));
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
    }
    EXPECT_GE(holders, 1) << v.name;
    auto gw = span_of(whole.grad(v.name));
    EXPECT_LE(testing::max_abs_error(sum, gw), 1e-6 * max_abs(gw)) << v.name;
  }
}

TEST_P(TransformerFamilies, TwoStagesChainedEqualWholeModel) {
  ModelConfig c = tiny(GetParam());
  expect_stages_match_whole(c, {StageRange::layers(c, 0, 3), StageRange::layers(c, 3, 6)});
}

TEST_P(TransformerFamilies, StagesWithoutLayersChainedEqualWholeModel) {
  ModelConfig c = tiny(GetParam(), 4);
  // An embedding-only first stage, a middle stage with neither end, a stage with the head.
  expect_stages_match_whole(c, {StageRange{0, 0, true, false}, StageRange{0, 2, false, false},
                                StageRange{2, 4, false, true}});
  // Layers with the embedding, a middle stage, a head-only last stage.
  expect_stages_match_whole(c, {StageRange{0, 1, true, false}, StageRange{1, 4, false, false},
                                StageRange{4, 4, false, true}});
}

// ---- numerics at init and shapes ----------------------------------------------------------------

TEST_P(TransformerFamilies, LossAtInitIsLogOfRealVocabulary) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset(GetParam());
  const int B = 4, T = 32;
  Transformer m(c, *backend, B, T);
  m.init(11);
  Batch b = random_batch(B, T, c.vocab_size, 12);
  auto r = m.forward(b.tokens.data(), b.targets.data());
  ASSERT_EQ(r.valid, B * T);
  // ln(257) = 5.549; the padded vocabulary would give ln(384) = 5.951.
  EXPECT_NEAR(r.loss_sum / double(r.valid), std::log(double(c.vocab_size)), 0.05);
}

TEST_P(TransformerFamilies, ShorterSequencesAreAPrefixOfLongerOnes) {
  // Causality: a model built for T = 5 gives the first 5 positions' logits of a T = 9 model.
  auto backend = kernels::make_backend("reference");
  ModelConfig c = tiny(GetParam(), 2);
  Transformer shorter(c, *backend, 1, 5), longer(c, *backend, 1, 9);
  shorter.init(4);
  longer.init(4);
  Batch b = random_batch(1, 9, c.vocab_size, 6);
  shorter.forward(b.tokens.data(), nullptr);
  longer.forward(b.tokens.data(), nullptr);
  const size_t n = 5 * size_t(c.padded_vocab());
  auto ls = span_of(shorter.logits());
  auto ll = span_of(longer.logits()).subspan(0, n);
  EXPECT_LE(testing::max_abs_error(ls, ll), 1e-6 * max_abs(ll));
}

TEST_P(TransformerFamilies, FullContextWorksAndLongerIsRejected) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = tiny(GetParam(), 1);
  Transformer m(c, *backend, 1, c.max_seq_len);
  m.init(1);
  Batch b = random_batch(1, c.max_seq_len, c.vocab_size, 2);
  auto r = m.forward_backward(b.tokens.data(), b.targets.data(), 1.0f / float(b.valid));
  EXPECT_TRUE(std::isfinite(r.loss_sum));
  EXPECT_THROW(Transformer(c, *backend, 1, c.max_seq_len + 1), ConfigError);
  EXPECT_THROW(Transformer(c, *backend, 0, 4), ConfigError);
}

TEST_P(TransformerFamilies, LogitsOnlyForwardWithoutTargets) {
  auto backend = kernels::make_backend("reference");
  ModelConfig c = tiny(GetParam(), 1);
  Transformer m(c, *backend, 2, 3);
  m.init(1);
  Batch b = random_batch(2, 3, c.vocab_size, 2);
  auto r = m.forward(b.tokens.data(), nullptr);
  EXPECT_EQ(r.valid, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  EXPECT_EQ(m.logits().shape(), (Shape{2, 3, c.padded_vocab()}));
  // Padding rows of the head are zero at init, so padding logits are exactly zero.
  auto l = span_of(m.logits());
  EXPECT_EQ(l[size_t(c.padded_vocab() - 1)], 0.0f);
  EXPECT_NE(l[0], 0.0f);
}

// ---- parameter buffer and errors ----------------------------------------------------------------

TEST_P(TransformerFamilies, ParametersAreNamedViewsOfOneBuffer) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset(GetParam());
  Transformer m(c, *backend, 1, 4);
  EXPECT_EQ(m.num_params(), c.num_params());
  int64_t next = 0;
  for (const ParamView& v : m.param_views()) {
    EXPECT_EQ(v.offset, next) << v.name;
    EXPECT_EQ(v.numel, v.shape.numel());
    EXPECT_EQ(v.weight_decay, m.spec().at(v.name).weight_decay);
    EXPECT_EQ(m.param(v.name).data<float>(), m.params().data<float>() + v.offset);
    EXPECT_EQ(m.grad(v.name).data<float>(), m.grads().data<float>() + v.offset);
    EXPECT_EQ(m.param(v.name).shape(), v.shape);
    next += v.numel;
  }
  EXPECT_EQ(next, m.num_params());
  EXPECT_THROW(m.param("transformer.h.99.ln_1.weight"), InvalidArgumentError);
  // init writes the same values as init.h for each tensor.
  m.init(21);
  const ParamView& v = m.param_views()[1];
  EXPECT_EQ(m.params().data<float>()[v.offset + 3], init_value(m.spec()[1], 21, 3));
}

TEST_P(TransformerFamilies, RejectsBadIdsAndMisuse) {
  auto backend = kernels::make_backend("reference");
  ModelConfig c = tiny(GetParam(), 1);
  Transformer m(c, *backend, 1, 3);
  m.init(1);
  std::vector<int32_t> tokens = {1, 2, 3}, targets = {1, -1, 2};
  std::vector<int32_t> bad_token = {1, 257, 3}, bad_target = {1, -2, 3};
  EXPECT_NO_THROW(m.forward(tokens.data(), targets.data()));
  EXPECT_THROW(m.forward(bad_token.data(), targets.data()), InvalidArgumentError);
  EXPECT_THROW(m.forward(tokens.data(), bad_target.data()), InvalidArgumentError);
  EXPECT_THROW(m.forward_backward(tokens.data(), nullptr, 1.0f), InvalidArgumentError);
  m.forward(tokens.data(), targets.data());
  EXPECT_THROW(m.backward_stage(), InvalidArgumentError);  // that forward seeded no dlogits
  m.forward_stage(tokens.data(), targets.data(), 1.0f);
  EXPECT_NO_THROW(m.backward_stage());
  EXPECT_THROW(m.backward_stage(), InvalidArgumentError);  // one backward per forward

  Transformer first(c, *backend, 1, 3, StageRange{0, 1, true, false});
  EXPECT_THROW(first.forward(tokens.data(), targets.data()), InvalidArgumentError);
  EXPECT_THROW(first.logits(), InvalidArgumentError);
  EXPECT_THROW(first.backward_stage(), InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::model
