// GEMM providers. Both libraries are called on row-major operands; which one runs is a process-wide
// setting read from TESSEL_GEMM at first use (onednn by default: it picks AVX-512 kernels from
// CPUID on any vendor, while OpenBLAS 0.3.21 falls back to Haswell kernels on AMD Zen 5).
#include "tessel/kernels/gemm.h"

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>

#include "tessel/core/check.h"

namespace tessel::kernels {

namespace {

enum class Provider { onednn, openblas };

constexpr Provider kDefaultProvider = Provider::onednn;

const char* provider_name(Provider p) {
  return p == Provider::onednn ? "onednn" : "openblas";
}

bool parse_provider(std::string_view name, Provider* out) {
  if (name == "onednn") {
    *out = Provider::onednn;
    return true;
  }
  if (name == "openblas") {
    *out = Provider::openblas;
    return true;
  }
  return false;
}

std::atomic<int> g_provider{-1};  // -1: not chosen yet
std::once_flag g_env_once;

Provider current_provider() {
  int p = g_provider.load(std::memory_order_acquire);
  if (p >= 0) [[likely]]
    return Provider(p);
  std::call_once(g_env_once, [] {
    Provider chosen = kDefaultProvider;
    if (const char* env = std::getenv("TESSEL_GEMM"); env != nullptr && *env != '\0') {
      TESSEL_CHECK(parse_provider(env, &chosen), ConfigError,
                   "TESSEL_GEMM='{}' names no GEMM provider (known: onednn, openblas)", env);
    }
    int expected = -1;  // set_gemm_provider may have won the race; keep its choice
    g_provider.compare_exchange_strong(expected, int(chosen));
  });
  return Provider(g_provider.load(std::memory_order_acquire));
}

}  // namespace

void check_gemm_operands(const char* name, bool trans_a, bool trans_b, int M, int N, int K, int lda,
                         int ldb, int ldc) {
  TESSEL_CHECK(M >= 0 && N >= 0 && K >= 0, InvalidArgumentError, "{}: negative size M={} N={} K={}",
               name, M, N, K);
  // Row-major: the leading dimension is the stored row length.
  const int a_cols = trans_a ? M : K;
  const int b_cols = trans_b ? K : N;
  TESSEL_CHECK(lda >= std::max(1, a_cols) && ldb >= std::max(1, b_cols) && ldc >= std::max(1, N),
               InvalidArgumentError,
               "{}: leading dimension too small (lda={} needs {}, ldb={} needs {}, ldc={} needs "
               "{})",
               name, lda, a_cols, ldb, b_cols, ldc, N);
}

void scale_gemm_output(int M, int N, float beta, float* C, int ldc) {
  for (int m = 0; m < M; ++m) {
    float* row = C + int64_t(m) * ldc;
    for (int n = 0; n < N; ++n) row[n] = beta == 0.0f ? 0.0f : beta * row[n];
  }
}

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc) {
  check_gemm_operands("sgemm", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_gemm_output(M, N, beta, C, ldc);
    return;
  }
  switch (current_provider()) {
    case Provider::onednn: {
      dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A,
                                    lda, B, ldb, beta, C, ldc);
      TESSEL_CHECK(st == dnnl_success, InvalidArgumentError,
                   "dnnl_sgemm failed with status {} (M={} N={} K={} lda={} ldb={} ldc={})",
                   int(st), M, N, K, lda, ldb, ldc);
      return;
    }
    case Provider::openblas:
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                  trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
                  ldc);
      return;
  }
}

void set_gemm_provider(std::string_view name) {
  Provider p;
  TESSEL_CHECK(parse_provider(name, &p), ConfigError,
               "unknown GEMM provider '{}' (known: onednn, openblas)", name);
  g_provider.store(int(p), std::memory_order_release);
}

std::string gemm_provider() {
  return provider_name(current_provider());
}

std::vector<std::string> gemm_providers() {
  return {"onednn", "openblas"};
}

namespace ref {

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc) {
  check_gemm_operands("sgemm", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) {
        double a = trans_a ? A[int64_t(k) * lda + m] : A[int64_t(m) * lda + k];
        double b = trans_b ? B[int64_t(n) * ldb + k] : B[int64_t(k) * ldb + n];
        acc += a * b;
      }
      float& c = C[int64_t(m) * ldc + n];
      // As in BLAS, beta == 0 means C is not read.
      c = float(double(alpha) * acc + (beta == 0.0f ? 0.0 : double(beta) * c));
    }
  }
}

}  // namespace ref

}  // namespace tessel::kernels
