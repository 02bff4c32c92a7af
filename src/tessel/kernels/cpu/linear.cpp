// Fast linear layer: every product is one GEMM through the provider in gemm.h, with the bias
// handled around it. Gradients accumulate (beta = 1) per the kernels' contract.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tessel/kernels/gemm.h"
#include "tessel/kernels/gemm_bf16.h"
#include "tessel/kernels/linear.h"
#include "tessel/kernels/linear_bf16.h"

namespace tessel::kernels::cpu {

namespace {

// Column block for the dbias reduction: wide enough for several vector registers, narrow enough
// that the blocks give every thread work.
constexpr int kBiasBlock = 128;

// dbias[o] += sum_n dout[n, o]. Threads own disjoint column blocks, so no reduction is needed;
// each walks the rows with a contiguous, vectorised inner loop.
void bias_grad(float* dbias, const float* dout, int N, int OC) {
  const int blocks = (OC + kBiasBlock - 1) / kBiasBlock;
#pragma omp parallel for schedule(static) if (int64_t(N) * OC > 32768)
  for (int blk = 0; blk < blocks; ++blk) {
    const int o0 = blk * kBiasBlock;
    const int width = std::min(kBiasBlock, OC - o0);
    float acc[kBiasBlock] = {};
    for (int n = 0; n < N; ++n) {
      const float* row = dout + int64_t(n) * OC + o0;
#pragma omp simd
      for (int j = 0; j < width; ++j) acc[j] += row[j];
    }
#pragma omp simd
    for (int j = 0; j < width; ++j) dbias[o0 + j] += acc[j];
  }
}

// The rounded operands of one call; grown to the largest call, then reused (one model thread
// calls the kernels; each thread would have its own).
bf16* scratch(std::vector<bf16>& buffer, int64_t n) {
  if (buffer.size() < size_t(n)) buffer.resize(size_t(n));
  return buffer.data();
}
thread_local std::vector<bf16> g_first, g_second;

// Pre-filling the rows with the bias and letting the GEMM accumulate (beta = 1) costs one
// streaming write instead of a second read-modify-write pass over out. Returns the GEMM's beta.
float prefill_bias(float* out, const float* bias, int N, int OC) {
  if (bias == nullptr) return 0.0f;
#pragma omp parallel for schedule(static) if (int64_t(N) * OC > 32768)
  for (int n = 0; n < N; ++n) std::copy_n(bias, OC, out + int64_t(n) * OC);
  return 1.0f;
}

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC) {
  const float beta = prefill_bias(out, bias, N, OC);
  sgemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, beta, out, OC);
}

void linear_backward_input(float* dinp, const float* dout, const float* weight, int N, int IC,
                           int OC) {
  sgemm(false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 1.0f, dinp, IC);
}

void linear_backward_weight(float* dweight, float* dbias, const float* dout, const float* inp,
                            int N, int IC, int OC) {
  sgemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC);
  if (dbias != nullptr) bias_grad(dbias, dout, N, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  if (dinp != nullptr) linear_backward_input(dinp, dout, weight, N, IC, OC);
  linear_backward_weight(dweight, dbias, dout, inp, N, IC, OC);
}

void to_bf16(bf16* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void linear_forward_bf16(float* out, const float* inp, const bf16* weight, const float* bias, int N,
                         int IC, int OC) {
  const float beta = prefill_bias(out, bias, N, OC);
  bf16* x = scratch(g_first, int64_t(N) * IC);
  to_bf16(x, inp, int64_t(N) * IC);
  gemm_bf16(false, true, N, OC, IC, 1.0f, x, IC, weight, IC, beta, out, OC);
}

void linear_backward_input_bf16(float* dinp, const float* dout, const bf16* weight, int N, int IC,
                                int OC) {
  bf16* g = scratch(g_first, int64_t(N) * OC);
  to_bf16(g, dout, int64_t(N) * OC);
  gemm_bf16(false, false, N, IC, OC, 1.0f, g, OC, weight, IC, 1.0f, dinp, IC);
}

void linear_backward_weight_bf16(float* dweight, float* dbias, const float* dout, const float* inp,
                                 int N, int IC, int OC) {
  bf16* g = scratch(g_first, int64_t(N) * OC);
  bf16* x = scratch(g_second, int64_t(N) * IC);
  to_bf16(g, dout, int64_t(N) * OC);
  to_bf16(x, inp, int64_t(N) * IC);
  gemm_bf16(true, false, OC, IC, N, 1.0f, g, OC, x, IC, 1.0f, dweight, IC);
  if (dbias != nullptr) bias_grad(dbias, dout, N, OC);  // from the float gradient, as autocast
}

}  // namespace tessel::kernels::cpu
