#include "tessel/testing/norm_bounds.h"

#include <cmath>
#include <cstddef>

#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::testing {
namespace {

constexpr double u = kUnitRoundoff;

// ---- layernorm ----------------------------------------------------------------------------------

// The float kernel's statistics of one row against the exact (float64) ones:
//   mean: the float sum of C terms and the division, gamma(C) of A = sum |x| / C.
//   d_c = fl(x_c - mean) is off by that error D (the same for every c) and by u |d_c|. Because the
//   exact d_c sum to zero, D enters sum d^2 only squared: sum fl(d)^2 is within
//   (2u + u^2) sum d^2 + (1 + u)^2 C D^2 of sum d^2, and its float sum adds gamma(C) relatively
//   (positive terms); / C and + eps round twice: v = sum d^2 / C + eps is off by
//   nu <= gamma(C + 4) + (1 + gamma(C + 3)) D^2 / v relatively, and rstd = fl(1 / fl(sqrt(v)))
//   by rel_s = (1 - nu)^(-1/2) (1 + u) / (1 - u) - 1.
struct RowStats {
  double mean, rstd, A, D, rel_s;
};

RowStats row_stats(const float* x, int C, float eps) {
  double m = 0, a = 0;
  for (int c = 0; c < C; ++c) m += x[c], a += std::fabs(x[c]);
  m /= C;
  a /= C;
  double ss = 0;
  for (int c = 0; c < C; ++c) ss += (x[c] - m) * (x[c] - m);
  const double v = ss / C + double(eps);
  const double D = gamma(C) * a;
  const double nu = gamma(C + 4) + (1 + gamma(C + 3)) * D * D / v;
  return {m, 1 / std::sqrt(v), a, D, (1 + u) / (1 - u) / std::sqrt(1 - nu) - 1};
}

}  // namespace

// Forward: the reference's float64 statistics are off by gamma64(2C + 8) of the same terms, and it
// rounds mean, rstd and out to float once. out = fl(fl(fl(d) rstd) w) + b: the product carries d's
// error D + u|d|, rstd's rel_s and two roundings (R); the bias add rounds once more.
LayernormForwardBounds layernorm_forward_bounds(std::span<const float> inp,
                                                std::span<const float> weight,
                                                std::span<const float> bias, int N, int C,
                                                float eps) {
  const bool with_bias = !bias.empty();
  LayernormForwardBounds b;
  b.out.assign(size_t(N) * C, 0.0);
  b.mean.assign(size_t(N), 0.0);
  b.rstd.assign(size_t(N), 0.0);
  for (int n = 0; n < N; ++n) {
    const float* x = inp.data() + size_t(n) * C;
    const RowStats st = row_stats(x, C, eps);
    b.mean[n] = st.D + u * std::fabs(st.mean) + gamma64(C + 2) * st.A;
    b.rstd[n] = st.rstd * (st.rel_s + u + gamma64(2 * C + 8));
    const double R = (1 + u) * (1 + st.rel_s) * (1 + gamma(2)) - 1;
    for (int c = 0; c < C; ++c) {
      const double dc = x[c] - st.mean, w = std::fabs(weight[c]);
      const double bias_c = with_bias ? std::fabs(bias[c]) : 0.0;
      const double product_err = st.rstd * w * (st.D * (1 + R) + std::fabs(dc) * R);
      const double o = dc * st.rstd * weight[c] + (with_bias ? bias[c] : 0.0f);
      b.out[size_t(n) * C + c] =
          product_err + u * (std::fabs(o) + product_err) + u * std::fabs(o) +
          gamma64(2 * C + 16) * (st.rstd * w * (std::fabs(dc) + st.A) + bias_c);
    }
  }
  return b;
}

// Backward. Per row, with norm_c = (x_c - mean) rstd (two roundings), G1 = sum |w d| / C,
// G2 = sum |w d norm| / C: dnorm_mean (C products, C - 1 adds, / C) is off by gamma(C + 1) G1 and
// dnorm_norm_mean (four roundings per term) by gamma(C + 4) G2, plus gamma64 of the same for the
// reference. Then dx += (w d - dm - norm dnm) rstd rounds each term at most six times (norm's two,
// the product, two subtractions, * rstd, += into the buffer): gamma(6), and the reference rounds
// its value and the add: gamma(8) of |w d| rstd + G1 rstd + |norm| G2 rstd + |init|, plus
// gamma(9) for the float64 terms' own error. dweight sums N terms of three roundings each into a
// float accumulator and adds it to the buffer: gamma(N + 3); dbias gamma(N); the reference rounds
// and adds (2u) and has its float64 error (below u): + 3 each. With N = 0 there is nothing to add:
// the buffer stays (bound 0).
LayernormBackwardBounds layernorm_backward_bounds(
    std::span<const float> inp, std::span<const float> weight, std::span<const float> dout,
    std::span<const float> mean, std::span<const float> rstd, std::span<const float> dinp_init,
    std::span<const float> dweight_init, std::span<const float> dbias_init, int N, int C) {
  std::vector<double> dw_mag(C), db_mag(C);
  for (int c = 0; c < C; ++c) {
    dw_mag[c] = std::fabs(dweight_init[c]);
    db_mag[c] = std::fabs(dbias_init[c]);
  }
  LayernormBackwardBounds b;
  b.dinp.assign(size_t(N) * C, 0.0);
  for (int n = 0; n < N; ++n) {
    const double m = mean[n], st = rstd[n];
    double g1 = 0, g2 = 0;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double norm = (inp[i] - m) * st, wd = std::fabs(double(weight[c]) * dout[i]);
      g1 += wd;
      g2 += wd * std::fabs(norm);
      dw_mag[c] += std::fabs(norm * dout[i]);
      db_mag[c] += std::fabs(dout[i]);
    }
    g1 /= C;
    g2 /= C;
    const double dm_err = (gamma(C + 1) + gamma64(C + 1)) * g1;
    const double dnm_err = (gamma(C + 4) + gamma64(C + 4)) * g2;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double norm = std::fabs((inp[i] - m) * st);
      const double wd = std::fabs(double(weight[c]) * dout[i]);
      const double magnitude = st * (wd + g1 + norm * g2) + std::fabs(dinp_init[i]);
      b.dinp[i] = st * (dm_err + norm * dnm_err) * (1 + gamma(6)) + gamma(9) * magnitude;
    }
  }
  b.dweight.assign(size_t(C), 0.0);
  b.dbias.assign(size_t(C), 0.0);
  for (int c = 0; c < C && N > 0; ++c) {
    b.dweight[c] = gamma(N + 6) * dw_mag[c];
    b.dbias[c] = gamma(N + 3) * db_mag[c];
  }
  return b;
}

// ---- rmsnorm ------------------------------------------------------------------------------------

// Forward: the float sum of squares (C positive terms, product and adds) is off by gamma(C)
// relatively, / C and + eps by two more roundings: v = mean(x^2) + eps by nu = gamma(C + 2), and
// rstd = fl(1 / fl(sqrt(v))) by rel_s = (1 - nu)^(-1/2) (1+u)/(1-u) - 1. out = fl(fl(x rstd) w)
// adds two roundings, of one sign of terms (no cancellation). The reference rounds rstd and out to
// float once each; its float64 error is gamma64(C + 6) relatively.
RmsnormForwardBounds rmsnorm_forward_bounds(std::span<const float> inp,
                                            std::span<const float> weight, int N, int C,
                                            float eps) {
  const double rel_s = (1 + u) / (1 - u) / std::sqrt(1 - gamma(C + 2)) - 1;
  const double rel_out = (1 + rel_s) * (1 + gamma(2)) - 1 + u + gamma64(C + 6);
  RmsnormForwardBounds b;
  b.out.assign(size_t(N) * C, 0.0);
  b.rstd.assign(size_t(N), 0.0);
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += double(inp[size_t(n) * C + c]) * inp[size_t(n) * C + c];
    const double s = 1 / std::sqrt(ms / C + double(eps));
    b.rstd[n] = s * (rel_s + u + gamma64(C + 6));
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      b.out[i] = rel_out * std::fabs(double(inp[i]) * s * weight[c]);
    }
  }
  return b;
}

// Backward. Per row, dot = sum d w x (two products and C - 1 adds per term) is off by
// gamma(C + 1) G, G = sum |d w x|, and coef = s s s dot / C by four more roundings:
// gamma(C + 5) s^3 G / C (the reference: gamma64(C + 8) of the same). dx += d w s - coef x rounds
// each term at most four times (two products, the subtraction, the add into the buffer; coef x
// three) and the reference twice more (its float rounding and add): gamma(7). dweight sums N terms
// of two roundings into a float accumulator and adds it once: gamma(N + 2), and the reference's
// rounding, add and float64 sum: gamma(N + 5). With N = 0 there is nothing to add: the buffer
// stays (bound 0).
RmsnormBackwardBounds rmsnorm_backward_bounds(std::span<const float> inp,
                                              std::span<const float> weight,
                                              std::span<const float> dout,
                                              std::span<const float> rstd,
                                              std::span<const float> dinp_init,
                                              std::span<const float> dweight_init, int N, int C) {
  std::vector<double> dw_mag(C);
  for (int c = 0; c < C; ++c) dw_mag[c] = std::fabs(dweight_init[c]);
  RmsnormBackwardBounds b;
  b.dinp.assign(size_t(N) * C, 0.0);
  for (int n = 0; n < N; ++n) {
    const double s = rstd[n];
    double G = 0;
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      G += std::fabs(double(dout[i]) * weight[c] * inp[i]);
      dw_mag[c] += std::fabs(double(inp[i]) * s * dout[i]);
    }
    const double coef = s * s * s * G / C;  // bounds |coef|
    const double coef_err = coef * ((1 + gamma(C + 5)) * (1 + gamma(3)) - 1 + gamma64(C + 8));
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(n) * C + c;
      const double x = std::fabs(inp[i]), dws = std::fabs(double(dout[i]) * weight[c] * s);
      b.dinp[i] = x * coef_err + gamma(7) * (dws + coef * x + std::fabs(dinp_init[i]));
    }
  }
  b.dweight.assign(size_t(C), 0.0);
  for (int c = 0; c < C && N > 0; ++c) b.dweight[c] = gamma(N + 5) * dw_mag[c];
  return b;
}

}  // namespace tessel::testing
