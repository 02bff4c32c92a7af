// Activation slots: forwards of several micro-batches before their backwards give the same
// results as forward/backward pairs run one micro-batch at a time.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/kernels/backend.h"
#include "tessel/model/batch_test_util.h"
#include "tessel/model/transformer.h"

namespace tessel::model {
namespace {

using test_util::Batch;
using test_util::copy_of;

Batch random_batch(int n, int V, uint64_t seed) {
  return test_util::random_batch(n, V, seed, 5);
}

class ActivationSlots : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Families, ActivationSlots, ::testing::Values("gpt2-tiny", "llama-tiny"),
                         [](const auto& info) {
                           return std::string(info.param).substr(0, 4) == "gpt2" ? "gpt2" : "llama";
                         });

// Two pipeline stages (hidden states forward, their gradients backward by hand). Reference:
// one-slot stages running F(mb0) B(mb0) F(mb1) B(mb1). Under test: two-slot stages running
// F(mb0) F(mb1) B(mb0) B(mb1), mb0 in slot 1 and mb1 in slot 0. Gradients accumulate in the same
// order with the same operations, so everything must match bit for bit.
TEST_P(ActivationSlots, InterleavedMicroBatchesEqualSequentialPairs) {
  auto backend = kernels::make_backend("reference");
  ModelConfig c = ModelConfig::preset(GetParam());
  c.n_layer = 3;
  const int B = 2, T = 5, N = B * T;
  const std::vector<StageRange> ranges = {StageRange::layers(c, 0, 2), StageRange::layers(c, 2, 3)};
  const size_t hidden_bytes = size_t(N) * size_t(c.n_embd) * sizeof(float);
  const Batch mb[2] = {random_batch(N, c.vocab_size, 1), random_batch(N, c.vocab_size, 2)};
  const float scale = 1.0f / float(2 * N);

  auto make = [&](int slots) {
    std::vector<std::unique_ptr<Transformer>> st;
    for (const StageRange& r : ranges) {
      st.push_back(std::make_unique<Transformer>(c, *backend, B, T, r, nullptr, slots));
      st.back()->init(7);
    }
    return st;
  };
  auto forward = [&](std::vector<std::unique_ptr<Transformer>>& st, int m, int slot) {
    st[0]->forward_stage(mb[m].tokens.data(), nullptr, std::nullopt, slot);
    std::memcpy(st[1]->input_hidden(slot).raw(), st[0]->output_hidden(slot).raw(), hidden_bytes);
    return st[1]->forward_stage(nullptr, mb[m].targets.data(), scale, slot);
  };
  auto backward = [&](std::vector<std::unique_ptr<Transformer>>& st, int slot) {
    st[1]->backward_stage(slot);
    std::memcpy(st[0]->output_grad(slot).raw(), st[1]->input_grad(slot).raw(), hidden_bytes);
    st[0]->backward_stage(slot);
  };

  auto ref = make(1);
  kernels::CrossEntropyResult ref_loss[2];
  std::vector<float> ref_dlogits[2];
  for (int m = 0; m < 2; ++m) {
    ref_loss[m] = forward(ref, m, 0);
    ref_dlogits[m] = copy_of(ref[1]->logits());
    backward(ref, 0);
  }

  auto slotted = make(2);
  EXPECT_EQ(slotted[0]->activation_slots(), 2);
  const int slot_of[2] = {1, 0};
  kernels::CrossEntropyResult loss[2];
  for (int m = 0; m < 2; ++m) loss[m] = forward(slotted, m, slot_of[m]);
  for (int m = 0; m < 2; ++m) {
    EXPECT_EQ(loss[m].loss_sum, ref_loss[m].loss_sum) << m;
    EXPECT_EQ(loss[m].valid, ref_loss[m].valid) << m;
    EXPECT_EQ(copy_of(slotted[1]->logits(slot_of[m])), ref_dlogits[m]) << m;
  }
  for (int m = 0; m < 2; ++m) backward(slotted, slot_of[m]);

  for (size_t s = 0; s < ranges.size(); ++s) {
    for (const ParamView& v : ref[s]->param_views()) {
      EXPECT_EQ(copy_of(slotted[s]->grad(v.name)), copy_of(ref[s]->grad(v.name)))
          << "stage " << s << " " << v.name;
    }
  }
}

TEST_P(ActivationSlots, SlotsAreCheckedAndIndependent) {
  auto backend = kernels::make_backend("reference");
  ModelConfig c = ModelConfig::preset(GetParam());
  c.n_layer = 1;
  EXPECT_THROW(Transformer(c, *backend, 1, 3, {}, nullptr, 0), ConfigError);
  Transformer m(c, *backend, 1, 3, {}, nullptr, 2);
  Transformer one(c, *backend, 1, 3);
  EXPECT_GT(m.activation_bytes(), one.activation_bytes());
  m.init(1);
  std::vector<int32_t> tokens = {1, 2, 3}, targets = {1, -1, 2};
  EXPECT_THROW(m.forward_stage(tokens.data(), targets.data(), 1.0f, 2), InvalidArgumentError);
  EXPECT_THROW(m.input_hidden(-1), InvalidArgumentError);
  m.forward_stage(tokens.data(), targets.data(), 1.0f, 0);
  EXPECT_THROW(m.backward_stage(1), InvalidArgumentError);  // slot 1 holds no forward
  EXPECT_NO_THROW(m.backward_stage(0));
  EXPECT_THROW(m.backward_stage(0), InvalidArgumentError);  // one backward per forward
}

}  // namespace
}  // namespace tessel::model
