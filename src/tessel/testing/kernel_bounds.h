// Bounds for single kernels against their float64 references (kernels/*_test.cpp), in the error
// model of rounding.h.
//
// A kernel test bounds every compared element by the worst case of the arithmetic that produced
// it, from the actual inputs: gamma(K) times the sum of the magnitudes of the terms that element
// summed (the test computes those sums in double, e.g. with the reference on absolute values),
// plus the rounding of each element-wise step, plus any approximation the kernel makes (fast_exp).
// The reference's own error is one rounding to float of its result, plus its float64 arithmetic:
// gamma64(K) of the same magnitudes, below K 2^-53 <= u for every K < 2^29, so one more float
// rounding of those magnitudes covers it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "tessel/testing/rounding.h"

namespace tessel::testing {

// gamma with the float64 unit roundoff 2^-53: the references' sums.
double gamma64(int64_t terms);

// (1 + a)(1 + b)... - 1: relative errors composed exactly.
double compose(std::initializer_list<double> rel);

// Relative error of cpu::fast_exp (kernels/cpu/vec_math.h) on [-87.33, 88], from its code:
//   * the Cephes polynomial itself differs from e^r by at most 2.7e-9 = 0.05 u on |r| <= ln2/2
//     (with the float coefficients as stored; |r| grows by 5e-6 when x/ln2 rounds to the other
//     integer, which changes nothing);
//   * the reduction r = (x - k C1) - k C2: x - k C1 is exact (C1 has 9 bits, |k| <= 127), the
//     product k C2 and the difference round (u |k C2| <= 0.03 u and u |r| <= 0.35 u of argument)
//     and C1 + C2 misses ln 2 by 1.6e-12 (k times that: 0.004 u);
//   * Horner's rule for the polynomial and its last steps p r^2 + r + 1 round at each operation:
//     at most 1.66 u of e^r (largest at r = -ln2/2, where e^r = 0.71), FMA or not;
//   * p 2^k is exact: results stay normal for x >= -87.33 (k >= -126 with r >= 0 there).
// Total 2.08 u; the bound is 2.1 u. (Measured over every float in the range: 1.43 u;
// kernels/vec_math_test.cpp checks the bound on a dense sample.)
inline constexpr double kFastExpError = 2.1 * kUnitRoundoff;

// Bound on |exp(a + d) (1 + e) / exp(a) - 1| for |d| <= arg_error, |e| <= rel_error: the relative
// error of an exponential whose argument is off by arg_error and whose evaluation by rel_error.
double exp_error(double arg_error, double rel_error);

// Softmax p_j = exp(a_j) / sum_i exp(a_i) computed as e_j / S, where each e_j = exp(a_j) (1 + t_j)
// with |t_j| <= rho_j (exp_error) and S = (sum_i e_i) (1 + s) with |s| <= sum_error (the sum's own
// rounding). The terms' errors reach S weighted by p_i: R = sum_i p_i rho_i, so
//   e_j / S / p_j  lies in  [(1 - rho_j) / ((1 + R)(1 + s)), (1 + rho_j) / ((1 - R)(1 - s))].
struct SoftmaxError {
  std::vector<double> p;    // the exact probabilities (from a in double)
  std::vector<double> rel;  // bound on |e_j / S / p_j - 1|, before the kernel's final roundings
  double log_sum = 0;       // bound on |log S - log sum_i exp(a_i)|
};
SoftmaxError softmax_error(std::span<const double> a, std::span<const double> rho,
                           double sum_error);

// Bounds for one valid row of a softmax cross-entropy kernel (kernels/cross_entropy.h and the
// three steps of vocab_parallel_ce.h, cpu:: and ref::) against the exact loss and gradient of its
// float logits x[0, V). All four compute, from the row's maximum mx (exact):
//   e_v = exp(x_v - mx): cpu:: with fast_exp at fl(x_v - mx) (the argument rounds: u |x_v - mx|,
//         and kFastExpError), ref:: with libm in double at the exact difference (glibc's exp is
//         within 1 ulp, 2^-52);
//   S = sum_v e_v in double (gamma64(V), positive terms), then `float_sum_roundings` float
//       roundings of positive partial sums (0 for cross_entropy; tp for the vocab-parallel steps:
//       each shard's sum rounds to float and the all-reduce adds tp - 1 of them in float);
//   loss = log(S) + mx - x_target in double (log within 1 ulp; gamma64(6) of the terms' sizes);
//   dlogits: cpu:: fl(e_v fl32(grad_scale / S)) (the division in double, the product in float)
//       and fl(dlogit_target - grad_scale); ref:: fl32((e_v / S - [v == target]) grad_scale) in
//       double.
// softmax_error turns the exponentials' and the sum's errors into the probabilities' and log S's.
// The row must keep x_v - mx >= -87 (fast_exp's range); throws otherwise.
struct CrossEntropyRowBound {
  double loss = 0;                   // the exact loss
  double loss_error = 0;             // |computed loss in double - loss|
  std::vector<double> p;             // the exact softmax
  std::vector<double> dlogit_error;  // |dlogits_v - grad_scale (p_v - [v == target])|
};
CrossEntropyRowBound cross_entropy_row_bound(const float* x, int V, int target, float grad_scale,
                                             bool fast_exp, int float_sum_roundings);

// A backward kernel adds its result into a pre-filled gradient p; a test compares that with p + z
// (one float add), z the kernel's result into zeros. If the kernel's last step is a plain add the
// two are equal; if it fuses its last product x y into the add (FMA) it rounds p + x y once:
//   |fl(p + x y) - fl(p + z)| <= u |p + x y| + |x y - z| + u |p + z| <= 2u |p| + (3u + u^2) |z|,
// plus 2^-149 if the product underflowed. accumulated_within_bound compares element by element
// (testing::within_bounds) the kernel's result on the pre-filled buffer with prefill + into_zeros.
double accumulate_bound(double prefill, double increment);
::testing::AssertionResult accumulated_within_bound(std::span<const float> accumulated,
                                                    std::span<const float> prefill,
                                                    std::span<const float> into_zeros,
                                                    const char* what = "");

}  // namespace tessel::testing
