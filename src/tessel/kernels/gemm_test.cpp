#include "tessel/kernels/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

// Restores the process-wide provider when a test changes it.
class ProviderGuard {
 public:
  ProviderGuard() : saved_(gemm_provider()) {}
  ~ProviderGuard() { set_gemm_provider(saved_); }

 private:
  std::string saved_;
};

struct Shape {
  int M, N, K;
};

// Runs the provider and the reference on the same padded operands and compares all of C,
// including the padding columns, which neither may touch.
void expect_matches_reference(bool ta, bool tb, Shape s, float alpha, float beta, uint64_t seed) {
  const int pad = 3;
  const int a_rows = ta ? s.K : s.M, a_cols = ta ? s.M : s.K;
  const int b_rows = tb ? s.N : s.K, b_cols = tb ? s.K : s.N;
  const int lda = a_cols + pad, ldb = b_cols + pad, ldc = s.N + pad;
  auto A = random_normal(size_t(a_rows) * lda, seed);
  auto B = random_normal(size_t(b_rows) * ldb, seed + 1);
  auto C = random_normal(size_t(s.M) * ldc, seed + 2);
  if (beta == 0.0f) {
    // BLAS semantics: with beta == 0, C is write-only, so garbage in it must not leak out.
    for (int m = 0; m < s.M; ++m)
      std::fill_n(C.begin() + m * ldc, s.N, std::numeric_limits<float>::quiet_NaN());
  }
  auto expected = C;
  ref::sgemm(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, expected.data(),
             ldc);
  // The magnitudes |alpha| sum_k |a_k b_k| + |beta c| of each element's terms: the reference on
  // absolute values.
  auto magnitude = testing::absolute(C);
  ref::sgemm(ta, tb, s.M, s.N, s.K, std::fabs(alpha), testing::absolute(A).data(), lda,
             testing::absolute(B).data(), ldb, std::fabs(beta), magnitude.data(), ldc);
  sgemm(ta, tb, s.M, s.N, s.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
  for (int m = 0; m < s.M; ++m) {
    for (int n = s.N; n < ldc; ++n) EXPECT_EQ(C[m * ldc + n], expected[m * ldc + n]) << "padding";
  }
  // Each element is a sum of K + 1 terms (K products and beta c), each term rounded at most
  // K + 2 times in any order, blocking or FMA use (its product, the alpha or beta scaling, K
  // additions): gamma(K + 2) times the magnitude. The reference adds its rounding to float (u)
  // and its double sum (below u); the magnitudes are themselves rounded to float (u): gamma(K + 5).
  // The padding columns must be untouched: a zero bound.
  std::vector<double> bound(C.size(), 0.0);
  for (int m = 0; m < s.M; ++m) {
    for (int n = 0; n < s.N; ++n)
      bound[m * ldc + n] = testing::gamma(s.K + 5) * magnitude[m * ldc + n];
  }
  EXPECT_TRUE(testing::within_bounds(C, expected, bound, "C"))
      << gemm_provider() << " ta=" << ta << " tb=" << tb << " M=" << s.M << " N=" << s.N
      << " K=" << s.K << " beta=" << beta;
}

TEST(Gemm, EveryProviderMatchesReferenceForAllTransposes) {
  ProviderGuard guard;
  const Shape shapes[] = {{1, 1, 1}, {3, 5, 7}, {17, 67, 33}, {64, 48, 130}, {5, 1, 67}};
  for (const auto& provider : gemm_providers()) {
    set_gemm_provider(provider);
    ASSERT_EQ(gemm_provider(), provider);
    uint64_t seed = 1;
    for (Shape s : shapes) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          expect_matches_reference(ta, tb, s, 0.7f, 0.3f, seed += 3);
          expect_matches_reference(ta, tb, s, 1.0f, 0.0f, seed += 3);
        }
      }
    }
  }
}

TEST(Gemm, ReferenceComputesKnownProduct) {
  // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50]; with alpha 2 and beta 1 on C = 1.
  const float A[] = {1, 2, 3, 4}, B[] = {5, 6, 7, 8};
  float C[] = {1, 1, 1, 1};
  ref::sgemm(false, false, 2, 2, 2, 2.0f, A, 2, B, 2, 1.0f, C, 2);
  EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{39, 45, 87, 101}));
  // A^T · B^T = (B · A)^T: B·A = [23 34; 31 46].
  ref::sgemm(true, true, 2, 2, 2, 1.0f, A, 2, B, 2, 0.0f, C, 2);
  EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{23, 31, 34, 46}));
}

TEST(Gemm, EmptyInnerDimensionScalesC) {
  ProviderGuard guard;
  for (const auto& provider : gemm_providers()) {
    set_gemm_provider(provider);
    float C[] = {1, 2, 3, 4};
    sgemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, C, 2);
    EXPECT_EQ(std::vector<float>(C, C + 4), (std::vector<float>{0.5f, 1, 1.5f, 2})) << provider;
  }
}

TEST(Gemm, UnknownProviderThrowsConfigError) {
  ProviderGuard guard;
  const std::string before = gemm_provider();
  EXPECT_THROW(set_gemm_provider("mkl"), ConfigError);
  EXPECT_THROW(set_gemm_provider(""), ConfigError);
  EXPECT_EQ(gemm_provider(), before);
}

TEST(Gemm, ProvidersAreListedAndDefaultIsOneOfThem) {
  auto names = gemm_providers();
  EXPECT_NE(std::find(names.begin(), names.end(), "onednn"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "openblas"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), gemm_provider()), names.end());
}

TEST(Gemm, TooSmallLeadingDimensionThrows) {
  std::vector<float> A(12), B(12), C(12);
  EXPECT_THROW(sgemm(false, false, 3, 4, 3, 1.0f, A.data(), 2, B.data(), 4, 0.0f, C.data(), 4),
               InvalidArgumentError);
  EXPECT_THROW(ref::sgemm(false, true, 3, 4, 3, 1.0f, A.data(), 3, B.data(), 2, 0.0f, C.data(), 4),
               InvalidArgumentError);
}

// Run by EnvironmentSelectsProvider in a child process (the provider is read from TESSEL_GEMM
// once per process); skipped in a normal run.
TEST(Gemm, EnvironmentChild) {
  const char* expect = std::getenv("TESSEL_GEMM_EXPECT");
  if (expect == nullptr) GTEST_SKIP() << "only meaningful when run by EnvironmentSelectsProvider";
  if (std::string(expect) == "ConfigError") {
    EXPECT_THROW(gemm_provider(), ConfigError);
  } else {
    EXPECT_EQ(gemm_provider(), expect);
  }
}

TEST(Gemm, EnvironmentSelectsProvider) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const std::pair<const char*, const char*> cases[] = {
      {"openblas", "openblas"}, {"onednn", "onednn"}, {"cublas", "ConfigError"}};
  for (auto [env, expect] : cases) {
    std::string output;
    const int rc =
        testing::run_command(std::string("TESSEL_GEMM=") + env + " TESSEL_GEMM_EXPECT=" + expect +
                                 " '" + self.string() + "' --gtest_filter=Gemm.EnvironmentChild",
                             &output);
    EXPECT_EQ(rc, 0) << output;
    // The child must have run the check, not skipped it.
    EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
  }
}

}  // namespace
}  // namespace tessel::kernels
