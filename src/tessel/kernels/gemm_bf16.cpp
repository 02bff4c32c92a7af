#include "tessel/kernels/gemm_bf16.h"

#include <oneapi/dnnl/dnnl.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tessel/core/check.h"
#include "tessel/kernels/gemm.h"

namespace tessel::kernels {

namespace {

void check_dnnl(dnnl_status_t st, const char* what, int M, int N, int K) {
  TESSEL_CHECK(st == dnnl_success, InvalidArgumentError,
               "gemm_bf16: oneDNN's {} failed with status {} (M={} N={} K={})", what, int(st), M, N,
               K);
}

// One engine and stream for the process (oneDNN's CPU engine is stateless; its primitive cache
// keeps what a shape compiled, so each call's primitive creation is a lookup).
struct Dnnl {
  dnnl_engine_t engine = nullptr;
  dnnl_stream_t stream = nullptr;
  bool native = false;
  Dnnl() {
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    native = (unsigned(isa) & unsigned(dnnl_cpu_isa_avx512_core_bf16)) ==
             unsigned(dnnl_cpu_isa_avx512_core_bf16);
    if (!native) {
      spdlog::warn(
          "bf16 GEMMs: this CPU has neither AVX512-BF16 nor AMX (as oneDNN sees it); they run "
          "in fp32 on the widened operands, at the fp32 rate");
      return;
    }
    check_dnnl(dnnl_engine_create(&engine, dnnl_cpu, 0), "engine", 0, 0, 0);
    check_dnnl(dnnl_stream_create(&stream, engine, dnnl_stream_default_flags), "stream", 0, 0, 0);
  }
};

Dnnl& dnnl() {
  static Dnnl d;  // never destroyed: oneDNN may be used from other static destructors' threads
  return d;
}

// Owners of oneDNN's handles, released on every path.
template <typename T, dnnl_status_t (*Destroy)(T)>
struct Handle {
  T h = nullptr;
  ~Handle() {
    if (h) Destroy(h);
  }
};

dnnl_memory_desc_t matrix(int rows, int cols, dnnl_data_type_t type, bool transposed, int ld) {
  dnnl_memory_desc_t md;
  const dnnl_dims_t dims = {rows, cols};
  // Row-major with leading dimension ld; a transposed operand is stored the other way round.
  const dnnl_dims_t strides = {transposed ? 1 : ld, transposed ? ld : 1};
  check_dnnl(dnnl_memory_desc_init_by_strides(&md, 2, dims, type, strides), "memory descriptor",
             rows, cols, 0);
  return md;
}

void native_gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A,
                 int lda, const bf16* B, int ldb, float beta, float* C, int ldc) {
  Dnnl& d = dnnl();
  const dnnl_memory_desc_t a_md = matrix(M, K, dnnl_bf16, trans_a, lda);
  const dnnl_memory_desc_t b_md = matrix(K, N, dnnl_bf16, trans_b, ldb);
  const dnnl_memory_desc_t c_md = matrix(M, N, dnnl_f32, false, ldc);
  dnnl_matmul_desc_t desc;
  check_dnnl(dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md), "matmul descriptor", M, N,
             K);
  Handle<dnnl_primitive_attr_t, dnnl_primitive_attr_destroy> attr;
  check_dnnl(dnnl_primitive_attr_create(&attr.h), "attributes", M, N, K);
  if (alpha != 1.0f)
    check_dnnl(dnnl_primitive_attr_set_output_scales(attr.h, 1, 0, &alpha), "alpha", M, N, K);
  Handle<dnnl_post_ops_t, dnnl_post_ops_destroy> post;
  if (beta != 0.0f) {
    check_dnnl(dnnl_post_ops_create(&post.h), "post-ops", M, N, K);
    check_dnnl(dnnl_post_ops_append_sum(post.h, beta), "beta", M, N, K);
    check_dnnl(dnnl_primitive_attr_set_post_ops(attr.h, post.h), "beta", M, N, K);
  }
  Handle<dnnl_primitive_desc_t, dnnl_primitive_desc_destroy> pd;
  check_dnnl(dnnl_primitive_desc_create(&pd.h, &desc, attr.h, d.engine, nullptr),
             "matmul primitive descriptor", M, N, K);
  Handle<dnnl_primitive_t, dnnl_primitive_destroy> prim;
  check_dnnl(dnnl_primitive_create(&prim.h, pd.h), "matmul primitive", M, N, K);
  Handle<dnnl_memory_t, dnnl_memory_destroy> a, b, c;
  check_dnnl(dnnl_memory_create(&a.h, &a_md, d.engine, const_cast<bf16*>(A)), "memory", M, N, K);
  check_dnnl(dnnl_memory_create(&b.h, &b_md, d.engine, const_cast<bf16*>(B)), "memory", M, N, K);
  check_dnnl(dnnl_memory_create(&c.h, &c_md, d.engine, C), "memory", M, N, K);
  const dnnl_exec_arg_t args[] = {
      {DNNL_ARG_SRC, a.h}, {DNNL_ARG_WEIGHTS, b.h}, {DNNL_ARG_DST, c.h}};
  check_dnnl(dnnl_primitive_execute(prim.h, d.stream, 3, args), "matmul", M, N, K);
  check_dnnl(dnnl_stream_wait(d.stream), "stream wait", M, N, K);
}

// The widened operands, as stored (leading dimensions kept; the last row ends at its last column).
std::vector<float> widen(const bf16* x, int rows, int cols, int ld) {
  std::vector<float> out(size_t(rows - 1) * size_t(ld) + size_t(cols));
  for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(x[i]);
  return out;
}

}  // namespace

bool gemm_bf16_native() {
  return dnnl().native;
}

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
               const bf16* B, int ldb, float beta, float* C, int ldc) {
  check_gemm_operands("gemm_bf16", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_gemm_output(M, N, beta, C, ldc);
    return;
  }
  if (gemm_bf16_native()) {
    native_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const auto a = widen(A, trans_a ? K : M, trans_a ? M : K, lda);
  const auto b = widen(B, trans_b ? N : K, trans_b ? K : N, ldb);
  sgemm(trans_a, trans_b, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, C, ldc);
}

namespace ref {

void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
               const bf16* B, int ldb, float beta, float* C, int ldc) {
  check_gemm_operands("gemm_bf16", trans_a, trans_b, M, N, K, lda, ldb, ldc);
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) {
        const bf16 a = trans_a ? A[int64_t(k) * lda + m] : A[int64_t(m) * lda + k];
        const bf16 b = trans_b ? B[int64_t(n) * ldb + k] : B[int64_t(k) * ldb + n];
        acc += double(bf16_to_f32(a)) * bf16_to_f32(b);
      }
      float& c = C[int64_t(m) * ldc + n];
      c = float(double(alpha) * acc + (beta == 0.0f ? 0.0 : double(beta) * c));
    }
  }
}

}  // namespace ref

}  // namespace tessel::kernels
