// Mixed precision in the model (set_bf16_matmuls): the linear layers read a bf16 copy of the
// weights that refresh_compute_weights() makes; the float state is untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/model_config.h"
#include "tessel/model/transformer.h"

namespace tessel::model {
namespace {

class Bf16Matmuls : public ::testing::TestWithParam<const char*> {};

// A linear layer's weight in block 0 (a name the family's first block has).
const ParamView& block0_linear(const Transformer& m, const char* family) {
  const std::string want = std::string(family) == std::string("gpt2-tiny")
                               ? "transformer.h.0.mlp.c_fc.weight"
                               : "model.layers.0.mlp.gate_proj.weight";
  for (const auto& v : m.param_views())
    if (v.name == want) return v;
  throw std::runtime_error("no parameter " + want);
}

TEST_P(Bf16Matmuls, PassesReadTheRefreshedCopyAndTheStateStaysFloat) {
  auto backend = kernels::make_backend("cpu");
  ModelConfig c = ModelConfig::preset(GetParam());
  c.n_layer = 2;
  const int B = 2, T = 16;
  Transformer m(c, *backend, B, T);
  m.init(11);
  std::mt19937_64 rng(5);
  std::vector<int32_t> tokens(size_t(B * T)), targets(tokens.size());
  for (auto& t : tokens) t = int32_t(rng() % uint64_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint64_t(c.vocab_size));
  const double fp32 = m.forward(tokens.data(), targets.data()).loss_sum;
  const std::vector<float> params(m.params().data<float>(),
                                  m.params().data<float>() + m.num_params());

  m.set_bf16_matmuls(true);
  ASSERT_TRUE(m.bf16_matmuls());
  // No copy yet: one clear error instead of a pass on uninitialised weights.
  EXPECT_THROW(m.forward(tokens.data(), targets.data()), InvalidArgumentError);
  m.refresh_compute_weights();
  const double bf16 = m.forward(tokens.data(), targets.data()).loss_sum;
  // The bf16 arithmetic is used (rounding every linear operand to 8 significant bits moves the
  // loss), and nothing of the float state changed.
  EXPECT_TRUE(std::isfinite(bf16));
  EXPECT_NE(bf16, fp32);
  EXPECT_EQ(std::vector<float>(m.params().data<float>(), m.params().data<float>() + m.num_params()),
            params);

  // A changed weight reaches the passes through the next refresh only.
  const ParamView& w = block0_linear(m, GetParam());
  float* p = m.params().data<float>() + w.offset;
  for (int64_t i = 0; i < w.numel; ++i) p[i] *= 2.0f;
  EXPECT_EQ(m.forward(tokens.data(), targets.data()).loss_sum, bf16);
  m.refresh_compute_weights();
  EXPECT_NE(m.forward(tokens.data(), targets.data()).loss_sum, bf16);

  // Back to float, the weight restored (halving undoes doubling exactly): the float pass again.
  m.set_bf16_matmuls(false);
  EXPECT_FALSE(m.bf16_matmuls());
  for (int64_t i = 0; i < w.numel; ++i) p[i] /= 2.0f;
  EXPECT_EQ(m.forward(tokens.data(), targets.data()).loss_sum, fp32);
}

INSTANTIATE_TEST_SUITE_P(Families, Bf16Matmuls, ::testing::Values("gpt2-tiny", "llama-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
}  // namespace tessel::model
