// AdamW and rounding: how far two AdamW runs whose gradients differ by rounding can drift apart.
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

 private:
  double beta1_, beta2_, eps_;
  std::vector<double> m_, v_;  // this run's moments, in double
  std::vector<double> dm_, dv_, d_;
};

}  // namespace tessel::testing
