// Finite-difference gradient checks for kernel and model tests.
//
// Usage: compute an analytic gradient `grad` of a scalar loss L with respect to `x`, then
//   expect_gradient_matches("dweight", x, grad, [&] { return loss_in_double(); });
// It perturbs up to `samples` entries of x (all when x is small) by ±h, evaluates the central
// difference (L(x+h) - L(x-h)) / 2h and compares with grad[i] by |a-b| <= atol + rtol*|b|.
// A random projection L = sum(out * w) of a forward output with fixed random w is the usual loss;
// its dout is w.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace tessel::testing {

struct GradcheckOptions {
  float h = 1e-2f;
  double rtol = 2e-2;
  double atol = 2e-3;
  int samples = 64;
  uint64_t seed = 7;
};

inline void expect_gradient_matches(const std::string& name, std::span<float> x,
                                    std::span<const float> grad,
                                    const std::function<double()>& loss,
                                    GradcheckOptions opt = {}) {
  ASSERT_EQ(x.size(), grad.size()) << name;
  std::vector<size_t> indices;
  if (x.size() <= size_t(opt.samples)) {
    for (size_t i = 0; i < x.size(); ++i) indices.push_back(i);
  } else {
    std::mt19937_64 rng(opt.seed);
    for (int s = 0; s < opt.samples; ++s) indices.push_back(rng() % x.size());
  }
  int failures = 0;
  for (size_t i : indices) {
    float old = x[i];
    x[i] = old + opt.h;
    double plus = loss();
    x[i] = old - opt.h;
    double minus = loss();
    x[i] = old;
    double numeric = (plus - minus) / (2.0 * opt.h);
    double analytic = grad[i];
    if (!(std::fabs(numeric - analytic) <= opt.atol + opt.rtol * std::fabs(numeric))) {
      if (++failures <= 5) {
        ADD_FAILURE() << name << "[" << i << "]: analytic " << analytic << " vs finite difference "
                      << numeric;
      }
    }
  }
  EXPECT_EQ(failures, 0) << name << ": " << failures << " of " << indices.size()
                         << " sampled entries differ from finite differences";
}

// Fills with N(0, stddev) values from a fixed seed.
inline std::vector<float> random_normal(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Sum of out[i] * w[i] in double: the scalar loss whose gradient w.r.t. out is w.
inline double dot(std::span<const float> out, std::span<const float> w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += double(out[i]) * double(w[i]);
  return s;
}

}  // namespace tessel::testing
