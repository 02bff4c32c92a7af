#include "tessel/kernels/embedding.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <random>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

std::vector<int32_t> random_tokens(size_t n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

struct EmbeddingCase {
  int B, T, C, V;
};

// The fast kernel adds the same values in the same order as the reference (forward: one add per
// element; backward: each dwte row in token order, each dwpe row in batch order), so the results
// must be bit-identical, not merely close.
TEST(Embedding, CpuMatchesReferenceExactly) {
  for (auto [B, T, C, V] : {EmbeddingCase{1, 1, 1, 1}, EmbeddingCase{2, 7, 3, 5},
                            EmbeddingCase{3, 11, 67, 13}, EmbeddingCase{4, 33, 768, 50}}) {
    for (bool with_wpe : {true, false}) {
      SCOPED_TRACE(::testing::Message()
                   << "B=" << B << " T=" << T << " C=" << C << " V=" << V << " wpe=" << with_wpe);
      const int64_t N = int64_t(B) * T;
      auto tokens = random_tokens(N, V, 1);
      auto wte = random_normal(size_t(V) * C, 2);
      auto wpe = random_normal(size_t(T) * C, 3);
      const float* wpe_ptr = with_wpe ? wpe.data() : nullptr;
      std::vector<float> out_ref(N * C), out_cpu(N * C, -1.0f);
      ref::embedding_forward(out_ref.data(), tokens.data(), wte.data(), wpe_ptr, B, T, C, 0, V);
      cpu::embedding_forward(out_cpu.data(), tokens.data(), wte.data(), wpe_ptr, B, T, C, 0, V);
      EXPECT_EQ(out_cpu, out_ref);

      auto dout = random_normal(N * C, 4);
      auto dwte_ref = random_normal(size_t(V) * C, 5);  // pre-filled: backward accumulates
      auto dwpe_ref = random_normal(size_t(T) * C, 6);
      auto dwte_cpu = dwte_ref, dwpe_cpu = dwpe_ref;
      ref::embedding_backward(dwte_ref.data(), with_wpe ? dwpe_ref.data() : nullptr, dout.data(),
                              tokens.data(), B, T, C, 0, V);
      cpu::embedding_backward(dwte_cpu.data(), with_wpe ? dwpe_cpu.data() : nullptr, dout.data(),
                              tokens.data(), B, T, C, 0, V);
      EXPECT_EQ(dwte_cpu, dwte_ref);
      EXPECT_EQ(dwpe_cpu, dwpe_ref);
    }
  }
}

// Many repeats of a few tokens: threads racing on a dwte row would lose updates.
TEST(Embedding, BackwardRepeatedTokensIsRaceFreeAndThreadCountInvariant) {
  const int B = 8, T = 64, C = 768, V = 3;
  const int64_t N = int64_t(B) * T;
  auto tokens = random_tokens(N, V, 11);
  auto dout = random_normal(N * C, 12);
  std::vector<float> dwte_ref(size_t(V) * C, 0.0f), dwpe_ref(size_t(T) * C, 0.0f);
  ref::embedding_backward(dwte_ref.data(), dwpe_ref.data(), dout.data(), tokens.data(), B, T, C, 0,
                          V);
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    std::vector<float> dwte(size_t(V) * C, 0.0f), dwpe(size_t(T) * C, 0.0f);
    cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, 0, V);
    EXPECT_EQ(dwte, dwte_ref) << threads << " threads";
    EXPECT_EQ(dwpe, dwpe_ref) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(Embedding, BackwardAccumulatesIntoGradients) {
  const int B = 2, T = 5, C = 7, V = 4;
  const int64_t N = int64_t(B) * T;
  auto tokens = random_tokens(N, V, 21);
  auto dout = random_normal(N * C, 22);
  auto prefill_wte = random_normal(size_t(V) * C, 23);
  auto prefill_wpe = random_normal(size_t(T) * C, 24);
  // Magnitudes |prefill| + sum |dout| of each row's terms, and how many terms each row adds.
  auto mag_wte = testing::absolute(prefill_wte), mag_wpe = testing::absolute(prefill_wpe);
  ref::embedding_backward(mag_wte.data(), mag_wpe.data(), testing::absolute(dout).data(),
                          tokens.data(), B, T, C, 0, V);
  std::vector<int64_t> uses(V, 0);
  for (int32_t t : tokens) ++uses[size_t(t)];
  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    auto backward = use_cpu ? cpu::embedding_backward : ref::embedding_backward;
    std::vector<float> fresh_wte(size_t(V) * C, 0.0f), fresh_wpe(size_t(T) * C, 0.0f);
    backward(fresh_wte.data(), fresh_wpe.data(), dout.data(), tokens.data(), B, T, C, 0, V);
    auto acc_wte = prefill_wte, acc_wpe = prefill_wpe;
    backward(acc_wte.data(), acc_wpe.data(), dout.data(), tokens.data(), B, T, C, 0, V);
    // A row used k times adds k rows of dout one at a time onto the prefill (k roundings), and
    // fresh + prefill adds them onto zero (k - 1) and then the prefill (1): both within gamma(k)
    // of the exact sum of the k + 1 terms, so within 2 gamma(k) of each other (0 for k <= 1:
    // then both are the same single add). The magnitudes are float sums of the same terms,
    // within gamma(k + 1) of the exact ones: 2 gamma(k) (1 + gamma(k + 1)) <= 2 gamma(2k + 1).
    std::vector<float> expect_wte(acc_wte.size()), expect_wpe(acc_wpe.size());
    std::vector<double> bound_wte(acc_wte.size()), bound_wpe(acc_wpe.size());
    auto bound = [](int64_t k, float magnitude) {
      return k <= 1 ? 0.0 : 2 * testing::gamma(2 * k + 1) * magnitude;
    };
    for (size_t i = 0; i < acc_wte.size(); ++i) {
      expect_wte[i] = prefill_wte[i] + fresh_wte[i];
      bound_wte[i] = bound(uses[i / size_t(C)], mag_wte[i]);
    }
    for (size_t i = 0; i < acc_wpe.size(); ++i) {
      expect_wpe[i] = prefill_wpe[i] + fresh_wpe[i];
      bound_wpe[i] = bound(B, mag_wpe[i]);  // every position is used once per sequence
    }
    EXPECT_TRUE(testing::within_bounds(acc_wte, expect_wte, bound_wte, "dwte"));
    EXPECT_TRUE(testing::within_bounds(acc_wpe, expect_wpe, bound_wpe, "dwpe"));
  }
}

TEST(Embedding, NullWpeGivesTokenRowsOnly) {
  const int B = 2, T = 3, C = 5, V = 6;
  auto tokens = random_tokens(B * T, V, 31);
  auto wte = random_normal(size_t(V) * C, 32);
  for (auto forward : {ref::embedding_forward, cpu::embedding_forward}) {
    std::vector<float> out(size_t(B) * T * C);
    forward(out.data(), tokens.data(), wte.data(), nullptr, B, T, C, 0, V);
    for (int n = 0; n < B * T; ++n) {
      for (int c = 0; c < C; ++c) EXPECT_EQ(out[n * C + c], wte[tokens[n] * C + c]);
    }
  }
}

// A vocab-parallel shard holds rows [vocab_start, vocab_start + vocab_rows): tokens outside give
// a zero row, shard outputs sum to the unsharded output, and each shard's dwte is its slice of the
// unsharded dwte.
TEST(Embedding, VocabShardsSumToUnsharded) {
  const int B = 3, T = 9, C = 67, Vp = 11;
  const int64_t N = int64_t(B) * T;
  auto tokens = random_tokens(N, Vp, 41);
  auto wte = random_normal(size_t(Vp) * C, 42);
  auto wpe = random_normal(size_t(T) * C, 43);
  auto dout = random_normal(N * C, 44);
  const int starts[] = {0, 4, 8, 11};

  for (bool use_cpu : {false, true}) {
    SCOPED_TRACE(use_cpu ? "cpu" : "ref");
    auto forward = use_cpu ? cpu::embedding_forward : ref::embedding_forward;
    auto backward = use_cpu ? cpu::embedding_backward : ref::embedding_backward;
    std::vector<float> full(N * C), dwte_full(size_t(Vp) * C, 0.0f);
    forward(full.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, 0, Vp);
    backward(dwte_full.data(), nullptr, dout.data(), tokens.data(), B, T, C, 0, Vp);

    std::vector<float> summed(N * C, 0.0f);
    for (int s = 0; s < 3; ++s) {
      const int start = starts[s], rows = starts[s + 1] - starts[s];
      std::vector<float> shard_wte(wte.begin() + int64_t(start) * C,
                                   wte.begin() + int64_t(start + rows) * C);
      std::vector<float> out(N * C, 99.0f);
      // Positions are added by one shard only (as a vocab-parallel model does).
      forward(out.data(), tokens.data(), shard_wte.data(), s == 0 ? wpe.data() : nullptr, B, T, C,
              start, rows);
      for (int64_t n = 0; n < N; ++n) {
        const bool mine = tokens[n] >= start && tokens[n] < start + rows;
        for (int c = 0; c < C; ++c) {
          if (!mine && s != 0) {
            EXPECT_EQ(out[n * C + c], 0.0f);
          }
          summed[n * C + c] += out[n * C + c];
        }
      }
      std::vector<float> dwte(size_t(rows) * C, 0.0f);
      backward(dwte.data(), nullptr, dout.data(), tokens.data(), B, T, C, start, rows);
      for (int64_t i = 0; i < int64_t(rows) * C; ++i) {
        EXPECT_EQ(dwte[i], dwte_full[int64_t(start) * C + i]);
      }
    }
    // Each element is one shard's token row plus the position (shard 0), every other shard adding
    // an exact 0: summed is fl(wpe + wte), the same single add as the unsharded forward.
    EXPECT_EQ(summed, full);
  }
}

TEST(Embedding, ReferenceBackwardMatchesFiniteDifferences) {
  const int B = 2, T = 4, C = 3, V = 5;
  const int64_t N = int64_t(B) * T;
  auto tokens = random_tokens(N, V, 51);
  tokens[1] = tokens[0];  // a repeated token sums its rows' gradients
  auto wte = random_normal(size_t(V) * C, 52);
  auto wpe = random_normal(size_t(T) * C, 53);
  auto w = random_normal(N * C, 54);  // loss = sum(out * w), so dout = w
  std::vector<float> out(N * C);
  auto loss = [&] {
    ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, 0, V);
    return testing::dot(out, w);
  };
  std::vector<float> dwte(wte.size(), 0.0f), dwpe(wpe.size(), 0.0f);
  ref::embedding_backward(dwte.data(), dwpe.data(), w.data(), tokens.data(), B, T, C, 0, V);
  testing::expect_gradient_matches("dwte", wte, dwte, loss);
  testing::expect_gradient_matches("dwpe", wpe, dwpe, loss);
}

}  // namespace
}  // namespace tessel::kernels
