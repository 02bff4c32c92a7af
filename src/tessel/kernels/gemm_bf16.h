// bfloat16 GEMM with float accumulation (issue 21, point 2), on row-major matrices:
//
//   C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C,   A and B bf16, C float
//
// Where the CPU multiplies bf16 natively (AVX512-BF16 or AMX, as oneDNN sees it: ONEDNN_MAX_CPU_ISA
// lowers it) this is oneDNN's bf16 matmul, at about twice the fp32 rate; elsewhere the operands are
// widened to float -- exactly: every bf16 is a float -- and multiplied by sgemm (gemm.h), which
// the log says once. Either way each product of two bf16s is exact in float (8 + 8 significant
// bits fit in 24), so the result is a float sum of exact products.
//
// Native bf16 instructions flush subnormal inputs and results to zero (|x| < 2^-126); nothing a
// training step multiplies is that small and not negligible.
#pragma once

#include "tessel/tensor/dtype.h"

namespace tessel::kernels {

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
               const bf16* B, int ldb, float beta, float* C, int ldc);

// Whether gemm_bf16 runs on native bf16 instructions in this process (decided at the first call).
bool gemm_bf16_native();

namespace ref {
// Triple loop with double accumulation of the widened operands.
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
               const bf16* B, int ldb, float beta, float* C, int ldc);
}  // namespace ref

}  // namespace tessel::kernels
