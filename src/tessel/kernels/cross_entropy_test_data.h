// Inputs shared by the cross-entropy kernel tests (plain and vocab-parallel).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "tessel/testing/gradcheck.h"

namespace tessel::kernels::test_data {

constexpr int kIgnore = -100;

// Targets in [0, V), with every third row (when there are several) ignored.
inline std::vector<int32_t> make_targets(int N, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int n = 0; n < N; ++n) t[size_t(n)] = (N > 1 && n % 3 == 1) ? kIgnore : int32_t(rng() % V);
  return t;
}

// Logits with the padding columns set to values that would dominate a softmax that wrongly
// included them.
inline std::vector<float> make_logits(int N, int V, int Vp, uint64_t seed, float stddev = 2.0f) {
  auto x = testing::random_normal(size_t(N) * Vp, seed, stddev);
  for (int n = 0; n < N; ++n) {
    for (int v = V; v < Vp; ++v) x[size_t(n) * Vp + v] = 50.0f;
  }
  return x;
}

}  // namespace tessel::kernels::test_data
