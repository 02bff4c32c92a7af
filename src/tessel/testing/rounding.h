// Bounds on float32 rounding, derived from the arithmetic, for tests that compare two float32
// computations of one quantity made in different orders: another CPU's code (the build uses
// -march=native; oneDNN and OpenBLAS pick kernels by CPUID), another layout's reductions
// (tensor-parallel partial sums, data-parallel all-reduces, micro-batches accumulated in another
// grouping), or a float64 reference. No bound here is fitted to a measurement.
//
// The error model.
//  * Every float32 operation returns its exact result times (1 + e), |e| <= u = 2^-24.
//  * A sum of K terms, in any order, blocking, SIMD lane split or FMA contraction, is off by at
//    most gamma(K) * sum |x_i|, gamma(K) = K u / (1 - K u) (Higham, "Accuracy and Stability of
//    Numerical Algorithms", 2nd ed., Lemma 3.1 and section 4.2). That needs every error at its
//    extreme and all of one sign; used for single kernels, where K is small and it stays sharp.
//  * Across a whole network it is far too loose, so chains of reductions use the probabilistic
//    analysis of Higham & Mary ("A new approach to probabilistic rounding error analysis", SIAM
//    J. Sci. Comput. 41(5), 2019): the rounding errors of different operations are independent
//    and of mean zero, which is what two different summation orders give. By Hoeffding's
//    inequality, with probability at least 1 - 2 exp(-lambda^2 / 2) the sum of the N errors
//    e_i x_i (|e_i| <= u) stays below lambda u sqrt(sum x_i^2) <= lambda u sqrt(N) max |x_i|.
//    A forward and backward pass is a chain of reductions of lengths K_1 .. K_D; an error made in
//    any of them reaches a result through that result's later reductions, which (normalisations,
//    softmax, residual sums) do not amplify it beyond the scale of the result's tensor. So an
//    element of a result tensor is off by at most lambda u sqrt(sum_d K_d) times the tensor's
//    largest magnitude (chain_tolerance). Elements are judged against their tensor's scale, not
//    their own size: a gradient that nearly cancels carries the error of the terms it summed.
//  * lambda = 8 (kLambda): 2 exp(-32) = 2.5e-14 per compared element, so even 10^8 compared
//    elements per suite run fail spuriously with probability below 3e-6. Typical errors are 1-3
//    standard deviations, so a bound holds with a wide margin on every CPU, and a bug (a missing
//    term, a doubled bias, a stale shard: relative errors of 1e-3 and more) still exceeds it.
//  * Two float32 computations each within the bound of the exact value are within twice it of
//    each other; chain_tolerance already counts both: the reductions of both sides are listed.
//
// AdamW's amplification (AdamDivergence): the optimizer divides by the gradient's RMS, so an
// element whose gradient is below the rounding error moves by up to lr per step in the direction
// of that error's sign. Two runs that agree to rounding can move it in opposite directions; the
// bound follows the optimizer's arithmetic element by element instead of using one number.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tessel::testing {

inline constexpr double kUnitRoundoff = 0x1p-24;
inline constexpr double kLambda = 8.0;

// Worst case over any order of a sum of `terms` float32 terms, relative to sum |x_i|.
double gamma(int64_t terms);

// Probabilistic bound (see above) on one result element of a chain of reductions of the given
// lengths, relative to its tensor's largest magnitude, for two computations that differ in order.
// The lengths of both computations' reductions are listed (so a computation against itself in
// another order lists its chain twice).
double chain_tolerance(std::span<const int64_t> reduction_lengths, double lambda = kLambda);

// The largest |m_hat / sqrt(v_hat)| AdamW can take at (1-based) step t, over every gradient
// sequence: by Cauchy-Schwarz on m_t = sum_s (1-b1) b1^(t-s) g_s against
// v_t = sum_s (1-b2) b2^(t-s) g_s^2,
//   R_t = sqrt(1 - b2^t) / (1 - b1^t) * sqrt(sum_{j<t} (1-b1)^2 (b1^2/b2)^j / (1-b2)).
// (1 at t = 1: the first step is sign(g) times lr.)
double adam_max_step(double beta1, double beta2, int64_t t);

// Follows two AdamW runs (kernels/optimizer.h) from the same parameters and the same moments,
// where the other run's gradients differ from this run's by at most delta_i per element and step,
// and bounds |theta'_i - theta_i| (and the moments' differences) after each step. Per element:
//   |dm_t| <= M_t = b1 M_{t-1} + (1-b1) delta_t              (+ float32 rounding of m, both runs)
//   |dv_t| <= V_t = b2 V_{t-1} + (1-b2) (2 |g_t| delta_t + delta_t^2)          (+ rounding of v)
//   the step r = m_hat / (sqrt(v_hat) + eps) is increasing in m and, for m > 0, decreasing in v:
//   its range over the box m +- M, v +- V is reached at corners, and no run's |r| exceeds R_t, so
//   |dr_t| <= min(corner range, |r_t| + R_t)                 (+ rounding of r, both runs)
//   |dtheta_t| <= D_t = D_{t-1} + lr |dr_t|                  (+ rounding of the update)
// (decoupled weight decay multiplies the difference by 1 - lr wd <= 1, which only shrinks it).
// This is exact for one step from a shared state. Over several steps it leaves out how the
// parameters' difference changes the later gradients (the Hessian term), which is NOT small:
// where Adam amplified rounding (|g| <= delta) an element moves up to lr differently, and the
// next gradients then differ by far more than rounding (10-40x the gradient bound after one step
// of the tiny models). No bound of a free-running trajectory follows from the arithmetic; tests
// compare runs one step at a time from a shared state, and use several steps only where the
// gradients themselves are given (the optimizer's own test).
class AdamDivergence {
 public:
  // Both runs start from zero moments.
  AdamDivergence(int64_t n, double beta1, double beta2, double eps);
  // Both runs start from these moments (bit for bit).
  AdamDivergence(std::span<const float> m, std::span<const float> v, double beta1, double beta2,
                 double eps);

  // One AdamW step (1-based `step`): `grad` as this run's optimizer applies it (times
  // `grad_scale`, the clipping factor), `delta` the bound on the other run's difference of the
  // scaled gradient, `param` this run's parameters before the step, `weight_decay` the largest
  // decay of any element.
  void step(std::span<const float> grad, float grad_scale, std::span<const double> delta,
            std::span<const float> param, double lr, double weight_decay, int64_t step);

  // The bounds on |theta'_i - theta_i|, |m'_i - m_i| and |v'_i - v_i| after the steps so far.
  std::span<const double> bounds() const { return d_; }
  std::span<const double> m_bounds() const { return dm_; }
  std::span<const double> v_bounds() const { return dv_; }
  int64_t size() const { return int64_t(d_.size()); }

 private:
  double beta1_, beta2_, eps_;
  std::vector<double> m_, v_;  // this run's moments, in double
  std::vector<double> dm_, dv_, d_;
};

}  // namespace tessel::testing
