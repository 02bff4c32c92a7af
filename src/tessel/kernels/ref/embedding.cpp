// Reference token + position embedding: obvious loops, the oracle for the fast kernel.
#include "tessel/kernels/embedding.h"

namespace tessel::kernels::ref {

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, int vocab_start, int vocab_rows) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int64_t n = int64_t(b) * T + t;
      float* o = out + n * C;
      const int64_t row = int64_t(tokens[n]) - vocab_start;
      const bool in_shard = row >= 0 && row < vocab_rows;
      for (int c = 0; c < C; ++c) {
        const float tok = in_shard ? wte[row * C + c] : 0.0f;
        const float pos = wpe != nullptr ? wpe[int64_t(t) * C + c] : 0.0f;
        o[c] = tok + pos;
      }
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, int vocab_start, int vocab_rows) {
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int64_t n = int64_t(b) * T + t;
      const float* d = dout + n * C;
      const int64_t row = int64_t(tokens[n]) - vocab_start;
      if (row >= 0 && row < vocab_rows) {
        for (int c = 0; c < C; ++c) dwte[row * C + c] += d[c];
      }
      if (dwpe != nullptr) {
        for (int c = 0; c < C; ++c) dwpe[int64_t(t) * C + c] += d[c];
      }
    }
  }
}

}  // namespace tessel::kernels::ref
