// Helpers of the tests that hold two ways of computing the same thing bit-identical (activation
// recomputation against keeping activations, split backward against the fused one): exact
// comparisons and the model configurations both run.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "tessel/kernels/cross_entropy.h"
#include "tessel/model/model_config.h"
#include "tessel/model/recompute.h"

namespace tessel::model::test_util {

inline constexpr Recompute kRecomputeModes[] = {Recompute::none, Recompute::selective,
                                                Recompute::full};

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline bool same_bits(const kernels::CrossEntropyResult& a, const kernels::CrossEntropyResult& b) {
  return a.valid == b.valid && std::memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)) == 0;
}

struct ModelCase {
  std::string name;
  ModelConfig config;
};

// gpt2 (fused QKV, biases) tied and untied, gpt2 without biases, llama (GQA: 4 query heads on 2
// kv heads) tied and untied, and multi-query llama (one kv head). Three blocks: a block between
// two others is covered, and a three-stage pipeline gets one each.
inline std::vector<ModelCase> three_block_cases() {
  std::vector<ModelCase> out;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (bool tied : {true, false}) {
      ModelConfig c = ModelConfig::preset(preset);
      c.n_layer = 3;
      c.tie_embeddings = tied;
      out.push_back({std::string(family_name(c.family)) + (tied ? "_tied" : "_untied"), c});
    }
  }
  ModelConfig nobias = ModelConfig::preset("gpt2-tiny");
  nobias.n_layer = 3;
  nobias.bias = false;
  out.push_back({"gpt2_nobias", nobias});
  ModelConfig mqa = ModelConfig::preset("llama-tiny");
  mqa.n_layer = 3;
  mqa.n_kv_head = 1;
  out.push_back({"llama_mqa", mqa});
  return out;
}

}  // namespace tessel::model::test_util
