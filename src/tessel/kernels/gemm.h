// Single-precision GEMM on row-major matrices, through a provider chosen at run time.
//
//   C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C
//
// op(X) is X or its transpose. Providers: "onednn" (default; detects AVX-512 from CPUID on any
// vendor) and "openblas". training.gemm picks one (runtime/host_settings.h); when it is "auto",
// the environment variable TESSEL_GEMM does, at the first GEMM.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tessel::kernels {

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc);

// Throws ConfigError for an unknown name.
void set_gemm_provider(std::string_view name);
std::string gemm_provider();
std::vector<std::string> gemm_providers();

// Shared by the GEMMs: throws InvalidArgumentError, naming `name`, for a negative size or a
// leading dimension shorter than its row.
void check_gemm_operands(const char* name, bool trans_a, bool trans_b, int M, int N, int K, int lda,
                         int ldb, int ldc);
// C = beta * C, the K == 0 case; beta == 0 overwrites (C may hold garbage, even NaN).
void scale_gemm_output(int M, int N, float beta, float* C, int ldc);

namespace ref {
// Triple loop with double accumulation.
void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc);
}  // namespace ref

}  // namespace tessel::kernels
