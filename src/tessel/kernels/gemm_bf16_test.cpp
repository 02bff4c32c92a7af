#include "tessel/kernels/gemm_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = f32_to_bf16(x[i]);
  return out;
}

std::vector<bf16> absolute_bf16(const std::vector<bf16>& x) {
  std::vector<bf16> out(x);
  for (auto& v : out) v.bits &= 0x7fffu;  // bf16's sign bit
  return out;
}

struct Shape {
  int M, N, K;
};

// The kernel (native or the fallback, whichever this process runs) against the reference on the
// same padded operands, all of C compared, padding included (neither may touch it).
void expect_matches_reference(bool ta, bool tb, Shape s, float alpha, float beta, uint64_t seed) {
  const int pad = 3;
  const int a_rows = ta ? s.K : s.M, a_cols = ta ? s.M : s.K;
  const int b_rows = tb ? s.N : s.K, b_cols = tb ? s.K : s.N;
  const int lda = a_cols + pad, ldb = b_cols + pad, ldc = s.N + pad;
  const auto A = to_bf16(testing::random_normal(size_t(a_rows) * lda, seed));
  const auto B = to_bf16(testing::random_normal(size_t(b_rows) * ldb, seed + 1));
  auto C = testing::random_normal(size_t(s.M) * ldc, seed + 2);
  if (beta == 0.0f) {
    // BLAS semantics: with beta == 0, C is write-only, so garbage in it must not leak out.
    for (int m = 0; m < s.M; ++m)
      std::fill_n(C.begin() + m * ldc, s.N, std::numeric_limits<float>::quiet_NaN());
  }
  auto expected = C;
  ref::gemm_bf16(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, expected.data(),
                 ldc);
  auto magnitude = testing::absolute(C);
  ref::gemm_bf16(ta, tb, s.M, s.N, s.K, std::fabs(alpha), absolute_bf16(A).data(), lda,
                 absolute_bf16(B).data(), ldb, std::fabs(beta), magnitude.data(), ldc);
  gemm_bf16(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
  // Every product of two bf16s is exact in float (8 + 8 significant bits), so the kernel's
  // arithmetic is sgemm's on exact terms: K + 1 terms (K products and beta c), each rounded at
  // most K + 2 times in any order, blocking, pairing (vdpbf16ps, AMX tiles) or FMA use;
  // the reference's rounding to float (u), its double sum (below u) and the magnitudes' own
  // rounding (u) make gamma(K + 5) of the magnitude. Native instructions flush subnormal
  // results: each of an element's K + 2 operations may lose up to 2^-126 more.
  std::vector<double> bound(C.size(), 0.0);
  for (int m = 0; m < s.M; ++m) {
    for (int n = 0; n < s.N; ++n)
      bound[m * ldc + n] = testing::gamma(s.K + 5) * magnitude[m * ldc + n] + (s.K + 2) * 0x1p-126;
  }
  EXPECT_TRUE(testing::within_bounds(C, expected, bound, "C"))
      << (gemm_bf16_native() ? "native" : "fallback") << " ta=" << ta << " tb=" << tb
      << " M=" << s.M << " N=" << s.N << " K=" << s.K << " beta=" << beta;
}

void expect_all_shapes_match() {
  // Small shapes, odd ones, and a GPT-2 layer's (K = 768) where oneDNN takes its blocked
  // (AMX or AVX512-BF16) kernels.
  const Shape shapes[] = {{1, 1, 1},     {3, 5, 7},  {17, 67, 33},
                          {64, 48, 130}, {5, 1, 67}, {128, 96, 768}};
  uint64_t seed = 11;
  for (Shape s : shapes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        expect_matches_reference(ta, tb, s, 0.7f, 0.3f, seed += 3);
        expect_matches_reference(ta, tb, s, 1.0f, 0.0f, seed += 3);
      }
    }
  }
}

TEST(GemmBf16, MatchesTheReferenceForAllTransposesOnThisCpu) {
  ::testing::Test::RecordProperty("native", gemm_bf16_native() ? "yes" : "no");
  expect_all_shapes_match();
}

TEST(GemmBf16, ReferenceComputesKnownProduct) {
  // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50] (all exact in bf16); alpha 2, beta 1 on C = 1.
  const auto A = to_bf16({1, 2, 3, 4}), B = to_bf16({5, 6, 7, 8});
  float C[] = {1, 1, 1, 1};
  ref::gemm_bf16(false, false, 2, 2, 2, 2.0f, A.data(), 2, B.data(), 2, 1.0f, C, 2);
  EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{39, 45, 87, 101}));
  gemm_bf16(true, true, 2, 2, 2, 1.0f, A.data(), 2, B.data(), 2, 0.0f, C, 2);
  EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{23, 31, 34, 46}));
}

TEST(GemmBf16, EmptyInnerDimensionScalesCAndBadLeadingDimensionsThrow) {
  float C[] = {1, 2, 3, 4};
  gemm_bf16(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, C, 2);
  EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{0.5f, 1, 1.5f, 2}));
  std::vector<bf16> A(12), B(12);
  std::vector<float> D(12);
  EXPECT_THROW(gemm_bf16(false, false, 3, 4, 3, 1.0f, A.data(), 2, B.data(), 4, 0.0f, D.data(), 4),
               InvalidArgumentError);
}

// Run by TheFallbackIsSaidOnceAndMatches in a child process whose oneDNN is capped below
// AVX512-BF16 (ONEDNN_MAX_CPU_ISA is read once per process); skipped in a normal run.
TEST(GemmBf16, FallbackChild) {
  if (std::getenv("TESSEL_BF16_FALLBACK_CHILD") == nullptr)
    GTEST_SKIP() << "only meaningful when run by TheFallbackIsSaidOnceAndMatches";
  EXPECT_FALSE(gemm_bf16_native());
  expect_all_shapes_match();
}

TEST(GemmBf16, TheFallbackIsSaidOnceAndMatches) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  std::string output;
  const int rc = testing::run_command("ONEDNN_MAX_CPU_ISA=AVX2 TESSEL_BF16_FALLBACK_CHILD=1 '" +
                                          self.string() + "' --gtest_filter=GemmBf16.FallbackChild",
                                      &output);
  EXPECT_EQ(rc, 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
  const std::string said = "they run in fp32 on the widened operands";
  const size_t first = output.find(said);
  EXPECT_NE(first, std::string::npos) << output;
  EXPECT_EQ(output.find(said, first + 1), std::string::npos) << "said more than once:\n" << output;
}

}  // namespace
}  // namespace tessel::kernels
