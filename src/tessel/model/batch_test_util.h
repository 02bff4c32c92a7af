// Random token batches and tensor copies for the model's tests. Test-only (not in the library).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "tessel/tensor/tensor.h"

namespace tessel::model::test_util {

struct Batch {
  std::vector<int32_t> tokens, targets;
};

// n random tokens and targets below V; every `ignore_every`-th target is the ignore index -1.
inline Batch random_batch(int n, int V, uint64_t seed, int ignore_every) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int i = 0; i < n; ++i) b.tokens.push_back(int32_t(rng() % uint64_t(V)));
  for (int i = 0; i < n; ++i) {
    const bool ignore = i % ignore_every == ignore_every - 1;
    b.targets.push_back(ignore ? -1 : int32_t(rng() % uint64_t(V)));
  }
  return b;
}

// The floats of a host tensor.
inline std::vector<float> copy_of(const Tensor& t) {
  const float* d = t.data<float>();
  return {d, d + t.numel()};
}

}  // namespace tessel::model::test_util
