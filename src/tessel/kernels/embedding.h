// Token + position embedding.
//
// out[b,t,:] = wte[tokens[b,t] - vocab_start, :] + wpe[t, :]
//
// wte holds rows [vocab_start, vocab_start + vocab_rows) of the (padded) vocabulary, so the same
// kernel serves a vocab-parallel shard: tokens outside the range contribute a zero row. wpe may be
// null (no learned positions, e.g. LLaMA). Token ids must be in [0, Vp) -- callers validate data.
#pragma once

#include <cstdint>

namespace tessel::kernels {

#define TESSEL_EMBEDDING_SIGNATURES                                                             \
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, \
                         int B, int T, int C, int vocab_start, int vocab_rows);                 \
  /* dwte, dwpe accumulate; dwpe may be null. */                                                \
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,   \
                          int B, int T, int C, int vocab_start, int vocab_rows);

namespace ref {
TESSEL_EMBEDDING_SIGNATURES
}
namespace cpu {
TESSEL_EMBEDDING_SIGNATURES
}

}  // namespace tessel::kernels
