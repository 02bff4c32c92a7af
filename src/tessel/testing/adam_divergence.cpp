#include "tessel/testing/adam_divergence.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "tessel/testing/rounding.h"

namespace tessel::testing {

double adam_max_step(double beta1, double beta2, int64_t t) {
  double sum = 0, ratio = 1;
  for (int64_t j = 0; j < t; ++j, ratio *= beta1 * beta1 / beta2) sum += ratio;
  const double c = (1 - beta1) * (1 - beta1) / (1 - beta2);
  return std::sqrt(1 - std::pow(beta2, double(t))) / (1 - std::pow(beta1, double(t))) *
         std::sqrt(c * sum);
}

AdamDivergence::AdamDivergence(int64_t n, double beta1, double beta2, double eps)
    : beta1_(beta1),
      beta2_(beta2),
      eps_(eps),
      m_(size_t(n), 0.0),
      v_(m_),
      dm_(m_),
      dv_(m_),
      d_(m_) {}

AdamDivergence::AdamDivergence(std::span<const float> m, std::span<const float> v, double beta1,
                               double beta2, double eps)
    : AdamDivergence(int64_t(m.size()), beta1, beta2, eps) {
  if (v.size() != m.size()) throw std::invalid_argument("AdamDivergence: size mismatch");
  std::copy(m.begin(), m.end(), m_.begin());
  std::copy(v.begin(), v.end(), v_.begin());
}

void AdamDivergence::step(std::span<const float> grad, float grad_scale,
                          std::span<const double> delta, std::span<const float> param, double lr,
                          double weight_decay, int64_t step) {
  if (grad.size() != d_.size() || delta.size() != d_.size() || param.size() != d_.size())
    throw std::invalid_argument("AdamDivergence::step: size mismatch");
  const double u = kUnitRoundoff;
  const double b1 = beta1_, b2 = beta2_;
  const double bias1 = 1 - std::pow(b1, double(step)), bias2 = 1 - std::pow(b2, double(step));
  const double max_step = adam_max_step(b1, b2, step);
  // The step r = m_hat / (sqrt(v_hat) + eps) at a corner of the box.
  auto r_at = [&](double m, double v) { return (m / bias1) / (std::sqrt(v / bias2) + eps_); };
  for (size_t i = 0; i < d_.size(); ++i) {
    // The gradient the optimizer reads is one float multiply of grad by the clipping factor.
    const double g = double(float(grad[i] * grad_scale));
    const double dg = delta[i];
    const double m_prev = m_[i], v_prev = v_[i];
    m_[i] = b1 * m_prev + (1 - b1) * g;
    v_[i] = b2 * v_prev + (1 - b2) * g * g;
    // Each run rounds m = b1 m + (1-b1) g and v alike in at most three operations (two products
    // and a sum, or an FMA): 3u of its terms' magnitudes, the other run's being at most this
    // run's plus the differences.
    const double m_terms = b1 * (std::fabs(m_prev) + dm_[i]) + (1 - b1) * (std::fabs(g) + dg);
    const double v_terms =
        b2 * (v_prev + dv_[i]) + (1 - b2) * (std::fabs(g) + dg) * (std::fabs(g) + dg);
    dm_[i] = b1 * dm_[i] + (1 - b1) * dg + 6 * u * m_terms;
    dv_[i] = b2 * dv_[i] + (1 - b2) * (2 * std::fabs(g) * dg + dg * dg) + 6 * u * v_terms;
    const double r = r_at(m_[i], v_[i]);
    const double m_lo = m_[i] - dm_[i], m_hi = m_[i] + dm_[i];
    const double v_lo = std::max(0.0, v_[i] - dv_[i]), v_hi = v_[i] + dv_[i];
    // r increases with m; for m > 0 it falls as v grows, for m < 0 it rises.
    const double r_hi = r_at(m_hi, m_hi > 0 ? v_lo : v_hi);
    const double r_lo = r_at(m_lo, m_lo < 0 ? v_lo : v_hi);
    double dr = std::min(std::max(r_hi - r, r - r_lo), std::fabs(r) + max_step);
    // Each run evaluates r in about six roundings (two bias corrections, sqrt, +eps, divide).
    dr += 12 * u * (std::fabs(r) + dr);
    // theta -= lr (r + wd theta): the difference is scaled by 1 - lr wd <= 1; each run rounds
    // the update in four operations, of |theta| at most plus lr times the step's terms.
    const double theta = std::fabs(double(param[i]));
    d_[i] += lr * dr + 8 * u * (theta + lr * (std::fabs(r) + dr + weight_decay * theta));
  }
}

}  // namespace tessel::testing
