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
// Single kernels against their float64 references: kernel_bounds.h. AdamW's amplification of
// rounding and how runs are compared across optimizer steps: adam_divergence.h.
#pragma once

#include <cstdint>
#include <span>

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

}  // namespace tessel::testing
