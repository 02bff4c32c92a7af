// Fast token + position embedding.
//
// Backward scatters rows of dout into dwte, and a batch repeats tokens, so two threads must never
// own the same dwte row: thread k handles exactly the rows with row % threads == k, visiting the
// tokens in order. Each row then sums its contributions in the same order as the reference,
// whatever the thread count, so results are reproducible. dwpe is parallel over positions.
#include "tessel/kernels/embedding.h"

#include <omp.h>

namespace tessel::kernels::cpu {

namespace {
// Below this many floats a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;
}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, int vocab_start, int vocab_rows) {
  const int64_t N = int64_t(B) * T;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * C;
    const int64_t row = int64_t(tokens[n]) - vocab_start;
    const bool in_shard = row >= 0 && row < vocab_rows;
    const float* w = wte + (in_shard ? row * C : 0);
    const float* p = wpe != nullptr ? wpe + (n % T) * C : nullptr;
    if (in_shard && p != nullptr) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = w[c] + p[c];
    } else if (in_shard) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = w[c];
    } else if (p != nullptr) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = p[c];
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = 0.0f;
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, int vocab_start, int vocab_rows) {
  const int64_t N = int64_t(B) * T;
#pragma omp parallel if (N * C >= kParallelMin)
  {
    const int threads = omp_get_num_threads();
    const int me = omp_get_thread_num();
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = int64_t(tokens[n]) - vocab_start;
      if (row < 0 || row >= vocab_rows || row % threads != me) continue;
      float* dw = dwte + row * C;
      const float* d = dout + n * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) dw[c] += d[c];
    }
    if (dwpe != nullptr) {
#pragma omp for schedule(static)
      for (int t = 0; t < T; ++t) {
        float* dp = dwpe + int64_t(t) * C;
        for (int b = 0; b < B; ++b) {
          const float* d = dout + (int64_t(b) * T + t) * C;
#pragma omp simd
          for (int c = 0; c < C; ++c) dp[c] += d[c];
        }
      }
    }
  }
}

}  // namespace tessel::kernels::cpu
