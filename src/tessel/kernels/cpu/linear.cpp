// Fast linear layer: every product is one GEMM through the provider in gemm.h, with the bias
// handled around it. Gradients accumulate (beta = 1) per the kernels' contract.
#include <algorithm>
#include <cstdint>

#include "tessel/kernels/gemm.h"
#include "tessel/kernels/linear.h"

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

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC) {
  float beta = 0.0f;
  if (bias != nullptr) {
    // Pre-filling the rows with the bias and letting the GEMM accumulate (beta = 1) costs one
    // streaming write instead of a second read-modify-write pass over out.
#pragma omp parallel for schedule(static) if (int64_t(N) * OC > 32768)
    for (int n = 0; n < N; ++n) std::copy_n(bias, OC, out + int64_t(n) * OC);
    beta = 1.0f;
  }
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

}  // namespace tessel::kernels::cpu
