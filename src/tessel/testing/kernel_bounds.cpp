#include "tessel/testing/kernel_bounds.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "tessel/testing/testing.h"

namespace tessel::testing {

double gamma64(int64_t terms) {
  const double nu = double(terms) * 0x1p-53;
  if (nu >= 1) throw std::invalid_argument("gamma64: too many terms");
  return nu / (1 - nu);
}

double compose(std::initializer_list<double> rel) {
  double p = 1;
  for (double r : rel) p *= 1 + r;
  return p - 1;
}

double exp_error(double arg_error, double rel_error) {
  return std::expm1(arg_error) * (1 + rel_error) + rel_error;
}

SoftmaxError softmax_error(std::span<const double> a, std::span<const double> rho,
                           double sum_error) {
  if (rho.size() != a.size()) throw std::invalid_argument("softmax_error: size mismatch");
  SoftmaxError out;
  out.p.assign(a.size(), 0.0);
  out.rel.assign(a.size(), 0.0);
  if (a.empty()) return out;
  const double mx = *std::max_element(a.begin(), a.end());
  double z = 0;
  for (size_t j = 0; j < a.size(); ++j) z += (out.p[j] = std::exp(a[j] - mx));
  double r = 0;
  for (size_t j = 0; j < a.size(); ++j) r += (out.p[j] /= z) * rho[j];
  if (r >= 1 || sum_error >= 1) throw std::invalid_argument("softmax_error: no bound");
  // The upper end (1 + rho_j) / ((1 - R)(1 - s)) - 1 is the larger of the two deviations.
  const double low = (1 - r) * (1 - sum_error);
  for (size_t j = 0; j < a.size(); ++j) out.rel[j] = (1 + rho[j]) / low - 1;
  out.log_sum = -std::log(low);
  return out;
}

CrossEntropyRowBound cross_entropy_row_bound(const float* x, int V, int target, float grad_scale,
                                             bool fast_exp, int float_sum_roundings) {
  if (V <= 0 || target < 0 || target >= V)
    throw std::invalid_argument("cross_entropy_row_bound: bad row");
  const double u = kUnitRoundoff, u64 = 0x1p-53;
  double mx = -INFINITY;
  for (int v = 0; v < V; ++v) mx = std::max(mx, double(x[v]));
  std::vector<double> a(static_cast<size_t>(V)), rho(a.size());
  for (int v = 0; v < V; ++v) {
    a[size_t(v)] = double(x[v]) - mx;
    if (a[size_t(v)] < -87) throw std::invalid_argument("cross_entropy_row_bound: exp underflows");
    rho[size_t(v)] = fast_exp ? exp_error(u * std::fabs(a[size_t(v)]), kFastExpError) : 2 * u64;
  }
  const double float_sums = float_sum_roundings > 0 ? gamma(float_sum_roundings) : 0.0;
  const double sum_error = (1 + gamma64(V)) * (1 + float_sums) - 1;
  const SoftmaxError se = softmax_error(a, rho, sum_error);
  double z = 0;
  for (double ai : a) z += std::exp(ai);
  CrossEntropyRowBound out;
  const double log_z = std::log(z);
  out.loss = log_z - a[size_t(target)];
  out.loss_error = se.log_sum + gamma64(6) * (std::fabs(log_z) + se.log_sum + std::fabs(mx) +
                                              std::fabs(x[target]));
  out.p = se.p;
  out.dlogit_error.resize(a.size());
  const double gs = std::fabs(double(grad_scale));
  for (int v = 0; v < V; ++v) {
    const double p = se.p[size_t(v)], grad = std::fabs(p - (v == target ? 1.0 : 0.0)) * gs;
    double err;
    if (fast_exp) {
      // e_v fl32(gs / S): the division rounds in double and to float, the product once.
      err = gs * p * ((1 + se.rel[size_t(v)]) * (1 + u64) * (1 + u) * (1 + u) - 1);
      if (v == target) err += u * (grad + err);  // fl(. - grad_scale)
    } else {
      // (e_v / S - [target]) gs in double (three roundings), then to float.
      err = gs * p * ((1 + se.rel[size_t(v)]) * (1 + u64) - 1) + gamma64(2) * (grad + gs * p);
      err += u * (grad + err);
    }
    out.dlogit_error[size_t(v)] = err;
  }
  return out;
}

double accumulate_bound(double prefill, double increment) {
  return kUnitRoundoff * (2 * std::fabs(prefill) + (3 + kUnitRoundoff) * std::fabs(increment)) +
         0x1p-149;
}

::testing::AssertionResult accumulated_within_bound(std::span<const float> accumulated,
                                                    std::span<const float> prefill,
                                                    std::span<const float> into_zeros,
                                                    const char* what) {
  if (prefill.size() != accumulated.size() || into_zeros.size() != accumulated.size())
    return ::testing::AssertionFailure() << what << ": sizes differ";
  std::vector<float> expected(accumulated.size());
  std::vector<double> bound(accumulated.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    expected[i] = prefill[i] + into_zeros[i];
    bound[i] = accumulate_bound(prefill[i], into_zeros[i]);
  }
  return within_bounds(accumulated, expected, bound, what);
}

}  // namespace tessel::testing
