// A model kept across a change of micro-batching (Transformer::reshape), and a pass stopped
// between layers (Transformer::set_layer_hook): either way the model then computes exactly what a
// freshly built one does.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
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
  return test_util::random_batch(n, V, seed, 7);
}

struct Result {
  double loss_sum = 0;
  std::vector<float> grads;
};

// One forward and backward of `b` in slot `slot`, from zero gradients.
Result step(Transformer& m, const Batch& b, int slot) {
  m.zero_grad();
  const auto r = m.forward_stage(b.tokens.data(), b.targets.data(), 1.0f / 64, slot);
  m.backward_stage(slot);
  return {r.loss_sum, copy_of(m.grads())};
}

class Reshape : public ::testing::TestWithParam<const char*> {
 protected:
  ModelConfig config() const {
    ModelConfig c = ModelConfig::preset(GetParam());
    c.n_layer = 2;
    return c;
  }
  std::unique_ptr<kernels::Backend> backend = kernels::make_backend("cpu");
  static constexpr int T = 8;
};

INSTANTIATE_TEST_SUITE_P(Families, Reshape, ::testing::Values("gpt2-tiny", "llama-tiny"),
                         [](const auto& info) {
                           return std::string(info.param).substr(0, 4) == "gpt2" ? "gpt2" : "llama";
                         });

// The same kernels on the same shapes and parameters: bit for bit, whichever way the size goes.
TEST_P(Reshape, KeepsTheParametersAndComputesWhatAFreshModelDoes) {
  const ModelConfig c = config();
  for (auto [from_b, from_slots, to_b, to_slots] :
       std::vector<std::array<int, 4>>{{2, 1, 4, 3}, {4, 3, 1, 1}, {3, 2, 3, 1}}) {
    SCOPED_TRACE(testing::Message()
                 << from_b << "x" << from_slots << " -> " << to_b << "x" << to_slots);
    Transformer kept(c, *backend, from_b, T, {}, nullptr, from_slots);
    kept.init(7);
    // Leave saved activations and gradients behind, as a step before a switch does.
    step(kept, random_batch(from_b * T, c.vocab_size, 3), from_slots - 1);
    const float* params = kept.params().data<float>();
    kept.reshape(to_b, to_slots);
    EXPECT_EQ(kept.params().data<float>(), params) << "the parameters stay in place";
    EXPECT_EQ(kept.batch_size(), to_b);
    EXPECT_EQ(kept.activation_slots(), to_slots);

    Transformer fresh(c, *backend, to_b, T, {}, nullptr, to_slots);
    fresh.init(7);
    EXPECT_EQ(fresh.activation_bytes(), kept.activation_bytes());
    const Batch b = random_batch(to_b * T, c.vocab_size, 11);
    for (int slot = 0; slot < to_slots; ++slot) {
      const Result want = step(fresh, b, slot), got = step(kept, b, slot);
      EXPECT_EQ(got.loss_sum, want.loss_sum);
      ASSERT_EQ(got.grads.size(), want.grads.size());
      for (size_t i = 0; i < want.grads.size(); ++i)
        ASSERT_EQ(got.grads[i], want.grads[i]) << "gradient element " << i << ", slot " << slot;
    }
  }
}

TEST_P(Reshape, DropsTheSavedActivations) {
  const ModelConfig c = config();
  Transformer m(c, *backend, 2, T);
  const Batch b = random_batch(2 * T, c.vocab_size, 1);
  m.forward_stage(b.tokens.data(), b.targets.data(), 0.1f);
  m.reshape(2, 1);  // same shape: nothing reallocated, but the forward is forgotten
  EXPECT_THROW(m.backward_stage(), InvalidArgumentError);
}

TEST_P(Reshape, RejectsBadSizesAndReleasedModels) {
  const ModelConfig c = config();
  Transformer m(c, *backend, 2, T);
  EXPECT_THROW(m.reshape(0, 1), ConfigError);
  EXPECT_THROW(m.reshape(2, 0), ConfigError);
  m.release_training_buffers();
  EXPECT_THROW(m.reshape(2, 1), InvalidArgumentError);
}

// The hook runs at every layer of both passes (blocks and head); a throw from it leaves a model
// that, after zero_grad, computes what an untouched one does.
TEST_P(Reshape, APassStoppedByTheLayerHookLeavesAUsableModel) {
  const ModelConfig c = config();
  const Batch b = random_batch(2 * T, c.vocab_size, 5);
  Transformer reference(c, *backend, 2, T);
  reference.init(3);
  const Result want = step(reference, b, 0);

  const int layers_per_pass = c.n_layer + 1;  // the blocks and the head
  for (int stop_at = 1; stop_at <= 2 * layers_per_pass; ++stop_at) {
    SCOPED_TRACE(testing::Message() << "stopped at layer call " << stop_at);
    Transformer m(c, *backend, 2, T);
    m.init(3);
    int calls = 0;
    m.set_layer_hook([&] {
      if (++calls == stop_at) throw std::runtime_error("stop");
    });
    EXPECT_THROW(step(m, b, 0), std::runtime_error);
    EXPECT_EQ(calls, stop_at);
    calls = -1000;  // no more stops
    const Result got = step(m, b, 0);
    EXPECT_EQ(got.loss_sum, want.loss_sum);
    ASSERT_EQ(got.grads, want.grads);
  }
  // Without a throw the hook is called once per layer of each pass.
  Transformer m(c, *backend, 2, T);
  int calls = 0;
  m.set_layer_hook([&] { ++calls; });
  step(m, b, 0);
  EXPECT_EQ(calls, 2 * layers_per_pass);
}

}  // namespace
}  // namespace tessel::model
