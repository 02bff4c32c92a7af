// The decoder against the training Transformer: the same logits at every position, whether the
// prompt is prefilled in one call, in chunks, or fed token by token through the KV cache.
//
// Tolerance. The decoder and Transformer::forward evaluate the same function with the same
// float32 reductions (the embedding sum; per block the norm's sums over C, the projections' dot
// products over C or F, the attention scores over head_dim, the softmax and the weighted sum over
// at most T positions, the residual adds; the final norm and the head over C), in other orders:
// GEMMs of 1 or n rows instead of T (other blocking, GEMV kernels), the decoder's own attention
// (std::exp, its own summation order) instead of the training kernel's (fast_exp, register tiles),
// RoPE in double instead of the cpu kernel's float table. That is the comparison of
// testing/rounding.h's chain_tolerance, with the forward pass' reductions of both sides listed
// (test_util::step_tolerance(c, T, T, backward = false), which also lists the loss' reductions
// over the vocabulary and the tokens: a few more terms, so slightly looser): every logit within
// tol times the largest |logit| of the sequence. The same bound holds between two decoder runs
// (prefill in one call vs token by token): again two float32 evaluations of the same reductions
// in different orders.
#include "tessel/model/decoder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/rounding_test_util.h"
#include "tessel/model/transformer.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::model {
namespace {

using ::testing::HasSubstr;

struct Case {
  const char* name;
  const char* preset;
  int n_kv_head;  // 0: the preset's
  bool tie;
  const char* backend;
};

void PrintTo(const Case& k, std::ostream* os) {
  *os << k.name;
}

ModelConfig config_of(const Case& k) {
  ModelConfig c = ModelConfig::preset(k.preset);
  c.n_layer = 3;
  if (k.n_kv_head > 0) c.n_kv_head = k.n_kv_head;
  c.tie_embeddings = k.tie;
  return c;
}

// init(seed), then weights large enough that attention is far from uniform (scores of a few
// units), so that a key at the wrong position or a missing rotation changes the logits far beyond
// the tolerance; at the 0.02 init every position looks alike.
void randomize(Transformer& m, uint64_t seed) {
  m.init(seed);
  for (const ParamView& v : m.param_views()) {
    const std::vector<float> r = testing::random_normal(size_t(v.numel), seed++, 1.0f);
    float* dst = m.params().data<float>() + v.offset;
    const bool norm = v.shape.rank() == 1 && v.name.find("bias") == std::string::npos;
    const bool embedding = v.name.find("wte") != std::string::npos ||
                           v.name.find("wpe") != std::string::npos ||
                           v.name.find("embed_tokens") != std::string::npos;
    const float scale = v.shape.rank() == 1 ? 0.3f
                        : embedding         ? 1.0f
                                            : 1.5f / std::sqrt(float(v.shape[1]));
    for (int64_t i = 0; i < v.numel; ++i) dst[i] = (norm ? 1.0f : 0.0f) + scale * r[size_t(i)];
  }
}

std::vector<int32_t> random_tokens(int n, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t(rng() % uint64_t(V)));
  return t;
}

double max_abs(std::span<const float> x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

// A decoder holding the Transformer's parameters, read through load() as from a checkpoint.
std::unique_ptr<Decoder> decoder_of(const Transformer& m, kernels::Backend& backend,
                                    DecoderOptions opt = {}) {
  auto d = std::make_unique<Decoder>(m.config(), backend, opt);
  d->load([&](const ParamSpec& p, float* out) {
    const Tensor t = m.param(p.name);
    std::memcpy(out, t.data<float>(), size_t(p.numel()) * sizeof(float));
  });
  return d;
}

class DecoderVsTransformer : public ::testing::TestWithParam<Case> {
 protected:
  static constexpr int T = 24;
  void SetUp() override {
    c_ = config_of(GetParam());
    backend_ = kernels::make_backend(GetParam().backend);
    model_ = std::make_unique<Transformer>(c_, *backend_, 1, T);
    randomize(*model_, 11);
    tokens_ = random_tokens(T, c_.vocab_size, 5);
    model_->forward(tokens_.data(), nullptr);
    const Tensor logits = model_->logits();
    const int Vp = c_.padded_vocab();
    for (int t = 0; t < T; ++t) {
      const float* row = logits.data<float>() + int64_t(t) * Vp;
      expected_.emplace_back(row, row + c_.vocab_size);
    }
    scale_ = 0;
    for (const auto& row : expected_) scale_ = std::max(scale_, max_abs(row));
    tol_ = test_util::step_tolerance(c_, T, T, /*backward=*/false) * scale_;
  }

  ::testing::AssertionResult matches(std::span<const float> got, int t, const char* what) {
    const std::vector<double> bound(got.size(), tol_);
    return testing::within_bounds(got, expected_[size_t(t)], bound, what);
  }

  ModelConfig c_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Transformer> model_;
  std::vector<int32_t> tokens_;
  std::vector<std::vector<float>> expected_;  // [T][vocab_size]
  double scale_ = 0, tol_ = 0;
};

// Prefill of a prefix (in chunks of 5 rows or in one pass), then step() token by token: the
// logits of every position from the prefix's last on equal the Transformer's.
TEST_P(DecoderVsTransformer, PrefillThenStepsGiveTheTransformersLogits) {
  for (int chunk : {5, 256}) {
    auto d = decoder_of(*model_, *backend_, {.max_len = 0, .prefill_chunk = chunk});
    EXPECT_EQ(d->max_len(), c_.max_seq_len);
    for (int prefix : {1, 7, T}) {
      SCOPED_TRACE("prefill chunk " + std::to_string(chunk) + ", prefix " + std::to_string(prefix));
      auto logits = d->prefill(std::span(tokens_).first(size_t(prefix)));
      EXPECT_EQ(d->position(), prefix);
      ASSERT_EQ(logits.size(), size_t(c_.vocab_size));
      EXPECT_TRUE(matches(logits, prefix - 1, "prefill"));
      for (int t = prefix; t < T; ++t) {
        logits = d->step(tokens_[size_t(t)]);
        EXPECT_EQ(d->position(), t + 1);
        EXPECT_TRUE(matches(logits, t, "step")) << "position " << t;
      }
    }
  }
}

// Each prefix prefilled on its own gives the logits of its last position: every position through
// prefill alone.
TEST_P(DecoderVsTransformer, PrefillOfEveryPrefix) {
  auto d = decoder_of(*model_, *backend_, {.max_len = 0, .prefill_chunk = 4});
  for (int n = 1; n <= T; ++n) {
    EXPECT_TRUE(matches(d->prefill(std::span(tokens_).first(size_t(n))), n - 1, "prefill"))
        << "prefix " << n;
  }
}

// One prefill of the whole sequence against one token of prefill and T - 1 steps, at the last
// position (bound: see the top of the file). The comparison can fail: the last logits move by far
// more than the bound when the first token changes, so the cache's early entries are used.
TEST_P(DecoderVsTransformer, PrefillInOneCallEqualsTokenByToken) {
  auto d = decoder_of(*model_, *backend_);
  const auto first = d->prefill(tokens_);
  const std::vector<float> whole(first.begin(), first.end());
  d->prefill(std::span(tokens_).first(1));
  std::span<const float> stepped;
  for (int t = 1; t < T; ++t) stepped = d->step(tokens_[size_t(t)]);
  const std::vector<double> bound(whole.size(), tol_);
  EXPECT_TRUE(testing::within_bounds(stepped, whole, bound, "prefill vs steps"));

  std::vector<int32_t> other = tokens_;
  other[0] = (other[0] + 1) % c_.vocab_size;
  const auto moved = d->prefill(other);
  const std::vector<float> changed(moved.begin(), moved.end());
  EXPECT_GT(testing::max_abs_error(changed, whole), 100 * tol_)
      << "the first token hardly reaches the last position's logits: the test has no power";
}

// A prefill starts again from position 0 whatever the cache held: bit for bit the same logits as
// a fresh decoder's.
TEST_P(DecoderVsTransformer, PrefillStartsFromAnEmptyCache) {
  auto fresh = decoder_of(*model_, *backend_);
  const auto prompt = std::span(tokens_).first(9);
  const auto once = fresh->prefill(prompt);
  const std::vector<float> expected(once.begin(), once.end());
  auto used = decoder_of(*model_, *backend_);
  used->prefill(std::span(tokens_).last(12));
  used->step(3);
  const auto got = used->prefill(prompt);
  EXPECT_EQ(used->position(), 9);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), expected.begin(), expected.end()));
}

// The parameters read through load() are those of the Transformer, in the same flat layout.
TEST_P(DecoderVsTransformer, LoadFillsTheTransformersLayout) {
  auto d = decoder_of(*model_, *backend_);
  ASSERT_EQ(d->num_params(), model_->num_params());
  const Tensor a = d->params(), b = model_->params();
  EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), size_t(a.numel()) * sizeof(float)), 0);
  const std::string name = model_->param_views().back().name;
  EXPECT_EQ(d->param(name).shape(), model_->param(name).shape());
  EXPECT_THROW(d->param("no.such.weight"), InvalidArgumentError);
}

INSTANTIATE_TEST_SUITE_P(
    Models, DecoderVsTransformer,
    ::testing::Values(Case{"gpt2_tied_cpu", "gpt2-tiny", 0, true, "cpu"},
                      Case{"gpt2_untied_cpu", "gpt2-tiny", 0, false, "cpu"},
                      Case{"llama_gqa_untied_cpu", "llama-tiny", 2, false, "cpu"},
                      Case{"llama_gqa4_tied_cpu", "llama-tiny", 1, true, "cpu"},
                      Case{"gpt2_untied_reference", "gpt2-tiny", 0, false, "reference"},
                      Case{"llama_gqa_untied_reference", "llama-tiny", 2, false, "reference"}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- limits and errors --------------------------------------------------------------------------

TEST(Decoder, TheContextLimitIsAnErrorNamingBothNumbers) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset("llama-tiny");
  c.n_layer = 1;
  Decoder d(c, *backend, {.max_len = 8, .prefill_chunk = 3});
  EXPECT_EQ(d.max_len(), 8);
  const std::vector<int32_t> nine(9, 1);
  std::string what =
      testing::error_of<InvalidArgumentError>([&] { d.prefill(std::span(nine).first(9)); });
  EXPECT_THAT(what, HasSubstr("the prompt has 9 tokens but the context holds 8"));
  EXPECT_EQ(d.position(), 0);
  d.prefill(std::span(nine).first(6));
  d.step(2);
  d.step(2);
  EXPECT_EQ(d.position(), 8);
  what = testing::error_of<InvalidArgumentError>([&] { d.step(2); });
  EXPECT_THAT(what, HasSubstr("the context is full: 8 tokens of at most 8"));
  EXPECT_EQ(d.position(), 8);

  // The model's own limit: the cache holds max_seq_len positions by default.
  Decoder whole(c, *backend);
  const std::vector<int32_t> too_long(size_t(c.max_seq_len) + 1, 1);
  what = testing::error_of<InvalidArgumentError>([&] { whole.prefill(too_long); });
  EXPECT_THAT(what, HasSubstr("the prompt has 65 tokens but the context holds 64"));
}

TEST(Decoder, RejectsBadTokensAndOptions) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset("gpt2-tiny");
  c.n_layer = 1;
  Decoder d(c, *backend);
  EXPECT_THAT(testing::error_of<InvalidArgumentError>([&] { d.prefill({}); }),
              HasSubstr("the prompt is empty"));
  const std::vector<int32_t> bad = {1, 2, 257};
  EXPECT_THAT(testing::error_of<InvalidArgumentError>([&] { d.prefill(bad); }),
              HasSubstr("token id 257 at position 2 is outside the vocabulary [0, 257)"));
  d.prefill(std::span(bad).first(2));
  EXPECT_THAT(testing::error_of<InvalidArgumentError>([&] { d.step(-1); }),
              HasSubstr("token id -1 at position 2"));
  EXPECT_EQ(d.position(), 2);
  EXPECT_THROW(Decoder(c, *backend, {.max_len = 65}), ConfigError);
  EXPECT_THROW(Decoder(c, *backend, {.max_len = -1}), ConfigError);
  EXPECT_THROW(Decoder(c, *backend, {.max_len = 0, .prefill_chunk = 0}), ConfigError);
  // A backend by name, owned by the decoder.
  Decoder by_name(c, "cpu", {.max_len = 4});
  EXPECT_EQ(by_name.prefill(std::span(bad).first(2)).size(), size_t(c.vocab_size));
  EXPECT_THROW(Decoder(c, "no-such-backend"), ConfigError);
}

}  // namespace
}  // namespace tessel::model
