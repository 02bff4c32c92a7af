#include "tessel/testing/activation_bounds.h"

#include <cmath>
#include <cstddef>
#include <stdexcept>

#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::testing {
namespace {

constexpr double u = kUnitRoundoff;
constexpr double kSubnormal = 0x1p-149;  // a result that underflows

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
  return u * std::fabs(result) + gamma64(ops) * operands + kSubnormal;
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
  double e_error() const { return exp_error(m_error(), kFastExpError); }
  // fast_exp clamps m above 88 (to exp(88)) and returns 0 below -87.33: then s and T are within
  // a few exp(-87.3) of both exact values, all of one sign; these thresholds leave room for m's
  // rounding.
  bool clamped_high() const { return m > 87.99; }
  bool clamped_low() const { return m < -87.3; }
};

}  // namespace

std::vector<float> activation_inputs(int64_t n, uint64_t seed) {
  auto x = random_normal(size_t(n), seed, 3.0f);
  if (n >= 1000) {
    const int64_t grid = n / 2;
    for (int64_t i = 0; i < grid; ++i) x[size_t(i)] = -12.0f + 24.0f * float(i) / float(grid);
  }
  return x;
}

// Forward: out = fl(x / fl(1 + e)). Unclamped, s carries sigmoid_error; clamped high, out and gelu
// both lie between 0 and x exp(-87.99); clamped low (e = 0), out = x and
// |gelu - x| <= |x| exp(-87.3). The reference rounds 0.5 x (1 + tanh z): twelve roundings (tanh
// counted as four) of operands 0.5 |x| (1 + |t|) and |gelu|, and z's error moves 1 + t by
// (1 - t^2) dz, at most 2 |z| dz of gelu relatively.
double gelu_out_bound(float xf) {
  const Gelu g(xf);
  const double ax = std::fabs(g.x), gelu = g.x * g.s;
  double cpu_err = g.clamped_high()
                       ? 2 * ax * std::exp(-87.99)
                       : std::fabs(gelu) * sigmoid_error(1 - g.s, g.e_error()) + kSubnormal;
  if (g.clamped_low()) cpu_err += ax * std::exp(-87.3);
  return cpu_err + reference_error(gelu, 12,
                                   0.5 * ax * (1 + std::fabs(g.t)) +
                                       (1 + 2 * std::fabs(g.z)) * std::fabs(gelu));
}

// Backward into zeros: dinp = fl(fl(s + T) dout). s carries sigmoid_error; T =
// fl(fl(2x du) fl(e s s)): du rounds seven times (the constants, 3c x x, 1 + ., the product), all
// of positive terms; e s^2 = s (1 - s) moves by at most the error of e (its dependence through s
// cancels half of it) plus s's roundings twice and two products. The reference:
// (0.5 (1 + t) + 0.5 x (1 - t t) du) dout in double, 24 roundings (tanh counted as four) of
// operands 0.5 (1 + |t|), 0.5 |x| (1 + t^2) du, |s| + |T|; z's error moves s and T by at most
// 2 |z| dz relatively.
double gelu_dinp_bound(float xf, float dout) {
  const Gelu g(xf);
  const double ax = std::fabs(g.x), d = std::fabs(dout);
  double inner_err;  // |fl(s + T) - (s + T)|
  if (g.clamped_high() || g.clamped_low()) {
    // s, T and their computed values all within (1 + 2|x| du) 2 exp(-87.3) of the exact s and
    // T, plus the rounding of the sum.
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
  const double ref_operands = d * (0.5 * (1 + std::fabs(g.t)) + 0.5 * ax * (1 + g.t * g.t) * g.du +
                                   (1 + 2 * std::fabs(g.z)) * (g.s + std::fabs(g.T)));
  return d * inner_err + u * d * (std::fabs(grad) + inner_err) +
         reference_error(grad * dout, 24, ref_operands);
}

// s = fast_sigmoid(g) = fl(1 / fl(1 + fast_exp(-g))): -g is exact and fast_exp unclamped for
// |g| < 87, so s carries sigmoid_error with fast_exp's own error only.
SwigluBounds swiglu_bounds(float gate, float up, float dout) {
  const double g = gate, ag = std::fabs(g), up_i = up, d = dout;
  if (!(ag < 87.0)) throw std::domain_error("swiglu bound: fast_exp(-gate) clamps");
  const double s = 1 / (1 + std::exp(-g));
  const double rel_s = sigmoid_error(1 - s, kFastExpError);
  SwigluBounds b;
  // out = fl(fl(g s) up): two more roundings. The reference: exp (four roundings) and four
  // operations, all relative to out (no cancellation).
  const double out = g * s * up_i;
  b.out = std::fabs(out) * compose({rel_s, gamma(2)}) + reference_error(out, 8, std::fabs(out));
  // dgate = fl(fl(fl(d up) s) F) with F = fl(1 + fl(g fl(1 - s))), which cancels near g = -1.28:
  // absolute errors through 1 - s (s's error, one rounding), times g (one), plus 1 (one; an FMA
  // fuses two of these). The reference: twelve roundings in double (exp as four), operands
  // P (1 + |g| + |F|).
  const double one_minus_s_err = s * rel_s + u * (1 - s + s * rel_s);
  const double g_term_err = ag * one_minus_s_err + u * ag * (1 - s + one_minus_s_err);
  const double F = 1 + g * (1 - s);
  const double F_err = g_term_err + u * (std::fabs(F) + g_term_err);
  const double P = std::fabs(d * up_i * s);  // d up s, off by rel_P relatively
  const double rel_P = compose({rel_s, gamma(2)});
  const double dgate_err = P * (std::fabs(F) * rel_P + (1 + rel_P) * F_err);
  const double dgate = d * up_i * s * F;
  b.dgate = dgate_err + u * (std::fabs(dgate) + dgate_err) +
            reference_error(dgate, 12, P * (1 + ag + std::fabs(F)));
  // dup = fl(fl(d g) s); the reference: eight roundings relative to dup.
  const double dup = d * g * s;
  b.dup = std::fabs(dup) * compose({rel_s, gamma(2)}) + reference_error(dup, 8, std::fabs(dup));
  return b;
}

}  // namespace tessel::testing
