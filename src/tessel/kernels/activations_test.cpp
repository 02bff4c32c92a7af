#include "tessel/kernels/activations.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <vector>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

// Sizes: tiny, odd (vector tails), and above the kernels' parallel threshold.
const int64_t kSizes[] = {1, 7, 33, 1000, 100003};

using testing::gamma;
using testing::gamma64;
using testing::kFastExpError;
using testing::within_bounds;
constexpr double u = testing::kUnitRoundoff;
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi), as both kernels use it
constexpr double kGeluCube = 0.044715;

// (1 + a)(1 + b)... - 1: relative errors composed exactly.
double compose(std::initializer_list<double> rel) {
  double p = 1;
  for (double r : rel) p *= 1 + r;
  return p - 1;
}

// The relative error of s = 1 / (1 + e) computed as fl(1 / fl(1 + fast_exp(m))) with fast_exp's
// result off by rel_e (its own error and its argument's, exp_error): an error t of e moves s by
// -w t / (1 + w t), w = e / (1 + e) = 1 - s, and the add and the divide round once each.
double sigmoid_error(double w, double rel_e) {
  return compose({w * rel_e / (1 - w * rel_e), (1 + u) / (1 - u) - 1});
}

// The float64 references evaluate each element in a few double operations and libm calls (glibc's
// exp and tanh are within 2 ulp on x86-64: four double roundings each); each rounds at most
// 2^-53 of an operand, so gamma64(ops) times the sum of the operands' magnitudes bounds the
// reference's double error. It then rounds to float (u of its result, and 2^-150 if subnormal).
double reference_error(double result, int ops, double operands) {
  return u * std::fabs(result) + gamma64(ops) * operands + 0x1p-149;
}

// Inputs: N(0, 3) values followed by a dense grid over [-12, 12], which covers both saturated
// tails.
std::vector<float> activation_inputs(int64_t n, uint64_t seed) {
  auto x = random_normal(size_t(n), seed, 3.0f);
  if (n >= 1000) {
    const int64_t grid = n / 2;
    for (int64_t i = 0; i < grid; ++i) x[size_t(i)] = -12.0f + 24.0f * float(i) / float(grid);
  }
  return x;
}

// GELU as the cpu kernel evaluates it: gelu(x) = x s, gelu'(x) = s + T with s = 1 / (1 + e),
// e = exp(m), m = -2 sqrt(2/pi) (x + 0.044715 x^3) formed in double and rounded to float once, and
// T = 2 x du e s^2, du = sqrt(2/pi) (1 + 3 0.044715 x^2). All in double, exact to ~1e-15.
struct Gelu {
  double x, m, z, s, t, du, T;
  explicit Gelu(float xf) : x(xf) {
    z = kGeluScale * (x + kGeluCube * x * x * x);
    m = -2 * z;
    s = 1 / (1 + std::exp(m));
    t = std::tanh(z);  // 0.5 (1 + t) = s
    du = kGeluScale * (1 + 3 * kGeluCube * x * x);
    T = 2 * x * du * s * (1 - s);
  }
  // |m_float - m|: the rounding to float (u) and the five double operations before it.
  double m_error() const { return (u + gamma64(5)) * std::fabs(m); }
  // fast_exp(m) relative to exp(m), valid for -87.33 <= m <= 88 (no clamping).
  double e_error() const { return testing::exp_error(m_error(), kFastExpError); }
  // fast_exp clamps m above 88 (to exp(88)) and returns 0 below -87.33: then s and T are within
  // a few exp(-87.3) of both exact values, all of one sign; these thresholds leave room for m's
  // rounding.
  bool clamped_high() const { return m > 87.99; }
  bool clamped_low() const { return m < -87.3; }
};

TEST(Gelu, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto x = activation_inputs(n, 1);
    std::vector<float> out_r(n), out_c(n);
    ref::gelu_forward(out_r.data(), x.data(), n);
    cpu::gelu_forward(out_c.data(), x.data(), n);
    auto dout = random_normal(n, 2);
    std::vector<float> dinp_r(n, 0.0f), dinp_c(n, 0.0f);
    ref::gelu_backward(dinp_r.data(), x.data(), dout.data(), n);
    cpu::gelu_backward(dinp_c.data(), x.data(), dout.data(), n);

    std::vector<double> out_bound(n), dinp_bound(n);
    for (int64_t i = 0; i < n; ++i) {
      const Gelu g(x[i]);
      const double ax = std::fabs(g.x), d = std::fabs(dout[i]);
      const double gelu = g.x * g.s;
      // Forward: out = fl(x / fl(1 + e)). Unclamped, s carries sigmoid_error; clamped high, out
      // and gelu both lie between 0 and x exp(-87.99); clamped low (e = 0), out = x and
      // |gelu - x| <= |x| exp(-87.3). The reference rounds 0.5 x (1 + tanh z): twelve
      // roundings (tanh counted as four) of operands 0.5 |x| (1 + |t|) and |gelu|, and z's error
      // moves 1 + t by (1 - t^2) dz, at most 2 |z| dz of gelu relatively.
      double cpu_err = g.clamped_high()
                           ? 2 * ax * std::exp(-87.99)
                           : std::fabs(gelu) * sigmoid_error(1 - g.s, g.e_error()) + 0x1p-149;
      if (g.clamped_low()) cpu_err += ax * std::exp(-87.3);
      out_bound[i] = cpu_err + reference_error(gelu, 12,
                                               0.5 * ax * (1 + std::fabs(g.t)) +
                                                   (1 + 2 * std::fabs(g.z)) * std::fabs(gelu));

      // Backward: dinp = fl(fl(s + T) dout) (into zeros). s carries sigmoid_error; T =
      // fl(fl(2x du) fl(e s s)): du rounds seven times (the constants, 3c x x, 1 + ., the
      // product), all of positive terms; e s^2 = s (1 - s) moves by at most the error of e (its
      // dependence through s cancels half of it) plus s's roundings twice and two products.
      double inner_err;  // |fl(s + T) - (s + T)|
      if (g.clamped_high() || g.clamped_low()) {
        // s, T and their computed values all within (1 + 2|x| du) 2 exp(-87.3) of the exact s
        // and T, plus the rounding of the sum.
        inner_err = u * std::fabs(g.s + g.T) + 2 * (1 + 2 * ax * g.du) * std::exp(-87.3);
      } else {
        const double rel_e = g.e_error();
        const double rel_s = sigmoid_error(1 - g.s, rel_e);
        const double r2 = (1 + u) / (1 - u) - 1;  // s's own two roundings
        const double rel_es2 = compose({rel_e / (1 - rel_e), r2, r2, gamma(2)});
        const double rel_T = compose({gamma(7), rel_es2, gamma(2)});
        const double terms_err = g.s * rel_s + std::fabs(g.T) * rel_T;
        inner_err = terms_err + u * (std::fabs(g.s + g.T) + terms_err);
      }
      const double grad = g.s + g.T;
      // The reference: (0.5 (1 + t) + 0.5 x (1 - t t) du) dout in double, 24 roundings (tanh
      // counted as four) of operands 0.5 (1 + |t|), 0.5 |x| (1 + t^2) du, |s| + |T|; z's error
      // moves s and T by at most 2 |z| dz relatively.
      const double ref_operands =
          d * (0.5 * (1 + std::fabs(g.t)) + 0.5 * ax * (1 + g.t * g.t) * g.du +
               (1 + 2 * std::fabs(g.z)) * (g.s + std::fabs(g.T)));
      dinp_bound[i] = d * inner_err + u * d * (std::fabs(grad) + inner_err) +
                      reference_error(grad * dout[i], 24, ref_operands);
    }
    EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "gelu out"));
    EXPECT_TRUE(within_bounds(dinp_c, dinp_r, dinp_bound, "gelu dinp"));
  }
}

TEST(Swiglu, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto gate = activation_inputs(n, 11);
    auto up = random_normal(n, 12);
    std::vector<float> out_r(n), out_c(n);
    ref::swiglu_forward(out_r.data(), gate.data(), up.data(), n);
    cpu::swiglu_forward(out_c.data(), gate.data(), up.data(), n);

    auto dout = random_normal(n, 13);
    std::vector<float> dgate_r(n, 0.0f), dup_r(n, 0.0f), dgate_c(n, 0.0f), dup_c(n, 0.0f);
    ref::swiglu_backward(dgate_r.data(), dup_r.data(), dout.data(), gate.data(), up.data(), n);
    cpu::swiglu_backward(dgate_c.data(), dup_c.data(), dout.data(), gate.data(), up.data(), n);

    std::vector<double> out_bound(n), dgate_bound(n), dup_bound(n);
    for (int64_t i = 0; i < n; ++i) {
      // s = fast_sigmoid(g) = fl(1 / fl(1 + fast_exp(-g))): -g is exact and fast_exp is never
      // clamped for these inputs, so s carries sigmoid_error with fast_exp's own error only.
      const double g = gate[i], ag = std::fabs(g), up_i = up[i], d = dout[i];
      ASSERT_LT(ag, 87.0) << "the bound assumes fast_exp(-g) unclamped";
      const double s = 1 / (1 + std::exp(-g));
      const double rel_s = sigmoid_error(1 - s, kFastExpError);
      // out = fl(fl(g s) up): two more roundings. The reference: exp (four roundings) and four
      // operations, all relative to out (no cancellation).
      const double out = g * s * up_i;
      out_bound[i] =
          std::fabs(out) * compose({rel_s, gamma(2)}) + reference_error(out, 8, std::fabs(out));
      // dgate = fl(fl(fl(d up) s) F) with F = fl(1 + fl(g fl(1 - s))), which cancels near
      // g = -1.28: absolute errors through 1 - s (s's error, one rounding), times g (one), plus 1
      // (one; an FMA fuses two of these).
      const double one_minus_s_err = s * rel_s + u * (1 - s + s * rel_s);
      const double g_term_err = ag * one_minus_s_err + u * ag * (1 - s + one_minus_s_err);
      const double F = 1 + g * (1 - s);
      const double F_err = g_term_err + u * (std::fabs(F) + g_term_err);
      const double P = std::fabs(d * up_i * s);  // d up s, off by rel_P relatively
      const double rel_P = compose({rel_s, gamma(2)});
      const double dgate_err = P * (std::fabs(F) * rel_P + (1 + rel_P) * F_err);
      const double dgate = d * up_i * s * F;
      // The reference: twelve roundings in double (exp as four), operands P (1 + |g| + |F|).
      dgate_bound[i] = dgate_err + u * (std::fabs(dgate) + dgate_err) +
                       reference_error(dgate, 12, P * (1 + ag + std::fabs(F)));
      // dup = fl(fl(d g) s); the reference: eight roundings relative to dup.
      const double dup = d * g * s;
      dup_bound[i] =
          std::fabs(dup) * compose({rel_s, gamma(2)}) + reference_error(dup, 8, std::fabs(dup));
    }
    EXPECT_TRUE(within_bounds(out_c, out_r, out_bound, "swiglu out"));
    EXPECT_TRUE(within_bounds(dgate_c, dgate_r, dgate_bound, "swiglu dgate"));
    EXPECT_TRUE(within_bounds(dup_c, dup_r, dup_bound, "swiglu dup"));
  }
}

TEST(Residual, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto a = random_normal(n, 21), b = random_normal(n, 22);
    std::vector<float> out_r(n), out_c(n);
    ref::residual_forward(out_r.data(), a.data(), b.data(), n);
    cpu::residual_forward(out_c.data(), a.data(), b.data(), n);
    EXPECT_EQ(out_c, out_r);
    auto dout = random_normal(n, 23);
    auto da_r = random_normal(n, 24), db_r = random_normal(n, 25);
    auto da_c = da_r, db_c = db_r;
    ref::residual_backward(da_r.data(), db_r.data(), dout.data(), n);
    cpu::residual_backward(da_c.data(), db_c.data(), dout.data(), n);
    EXPECT_EQ(da_c, da_r);
    EXPECT_EQ(db_c, db_r);
  }
}

// Every backward adds into its gradient buffers: from pre-filled buffers the result is the
// pre-filled values plus what a zeroed run produces.
TEST(Activations, BackwardAccumulatesIntoGradients) {
  const int64_t n = 37;
  auto x = random_normal(n, 31), y = random_normal(n, 32), dout = random_normal(n, 33);
  auto pre1 = random_normal(n, 34), pre2 = random_normal(n, 35);
  using TwoGrad = std::function<void(float*, float*)>;
  const std::vector<std::pair<const char*, TwoGrad>> ops = {
      {"ref gelu", [&](float* g1, float*) { ref::gelu_backward(g1, x.data(), dout.data(), n); }},
      {"cpu gelu", [&](float* g1, float*) { cpu::gelu_backward(g1, x.data(), dout.data(), n); }},
      {"ref swiglu",
       [&](float* g1, float* g2) {
         ref::swiglu_backward(g1, g2, dout.data(), x.data(), y.data(), n);
       }},
      {"cpu swiglu",
       [&](float* g1, float* g2) {
         cpu::swiglu_backward(g1, g2, dout.data(), x.data(), y.data(), n);
       }},
      {"ref residual",
       [&](float* g1, float* g2) { ref::residual_backward(g1, g2, dout.data(), n); }},
      {"cpu residual",
       [&](float* g1, float* g2) { cpu::residual_backward(g1, g2, dout.data(), n); }},
  };
  for (const auto& [name, backward] : ops) {
    std::vector<float> z1(n, 0.0f), z2(n, 0.0f);
    backward(z1.data(), z2.data());
    auto a1 = pre1, a2 = pre2;
    backward(a1.data(), a2.data());
    // Not bit-exact: the kernel may fuse its last product into the add (FMA); the test's
    // pre + z is one float add.
    EXPECT_TRUE(testing::accumulated_within_bound(a1, pre1, z1, "gradient 1")) << name;
    EXPECT_TRUE(testing::accumulated_within_bound(a2, pre2, z2, "gradient 2")) << name;
  }
}

TEST(Activations, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t n = 41;
  auto x = random_normal(n, 41, 2.0f), y = random_normal(n, 42, 2.0f);
  auto w = random_normal(n, 43);  // loss = sum(out * w), so dout = w
  std::vector<float> out(n);

  auto gelu_loss = [&] {
    ref::gelu_forward(out.data(), x.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> dx(n, 0.0f);
  ref::gelu_backward(dx.data(), x.data(), w.data(), n);
  testing::expect_gradient_matches("gelu dinp", x, dx, gelu_loss);

  auto swiglu_loss = [&] {
    ref::swiglu_forward(out.data(), x.data(), y.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> dgate(n, 0.0f), dup(n, 0.0f);
  ref::swiglu_backward(dgate.data(), dup.data(), w.data(), x.data(), y.data(), n);
  testing::expect_gradient_matches("swiglu dgate", x, dgate, swiglu_loss);
  testing::expect_gradient_matches("swiglu dup", y, dup, swiglu_loss);

  auto residual_loss = [&] {
    ref::residual_forward(out.data(), x.data(), y.data(), n);
    return testing::dot(out, w);
  };
  std::vector<float> da(n, 0.0f), db(n, 0.0f);
  ref::residual_backward(da.data(), db.data(), w.data(), n);
  testing::expect_gradient_matches("residual da", x, da, residual_loss);
  testing::expect_gradient_matches("residual db", y, db, residual_loss);
}

}  // namespace
}  // namespace tessel::kernels
