#include "tessel/testing/attention_bounds.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>

#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"

namespace tessel::testing {
namespace {

constexpr double u = kUnitRoundoff;
constexpr double u64 = 0x1p-53;

}  // namespace

// ---- attention ----------------------------------------------------------------------------------

QkvLayout::QkvLayout(const AttentionShape& c) {
  const int64_t n = int64_t(c.B) * c.T;
  const int64_t qw = int64_t(c.Hq) * c.D, kvw = int64_t(c.Hkv) * c.D;
  if (c.fused) {
    q_stride = kv_stride = std::max<int64_t>(qw + 2 * kvw, 1);
    q_off = 0, k_off = qw, v_off = qw + kvw;
    size = n * q_stride;
  } else {
    q_stride = qw + 1, kv_stride = kvw + 1;
    q_off = 0, k_off = n * q_stride, v_off = k_off + n * kv_stride;
    size = v_off + n * kv_stride;
  }
}

// Forward, element by element, from the arithmetic of each query row (b, h, t) with n = t + 1
// keys:
//   scores s_j = q . k_j: a float sum of D products, off by gamma(D) S_j with
//     S_j = sum_d |q_d k_jd|. Softmax takes a_j = fl(fl(s_j - max) scale) with scale rounded to
//     float: the computed max is common to every j (it cancels in the normalisation), so a_j is
//     off by scale gamma(D) S_j plus gamma(3) of scale |s_j - max|, and
//     |s_j - max| <= s_max - s_j + gamma(D) (S_j + max_i S_i). fast_exp adds kFastExpError
//     (exp_error), the float sum of n positive terms gamma(n) (softmax_error), and
//     p = fl(e fl(1 / sum)) two roundings.
//   The reference does the same in double (libm exp within 2^-52, gamma64 for its sums) and rounds
//     p and out to float once.
//   out_d = sum_j p_j v_jd: the float sum of n products (gamma(n)) of the computed p (their errors
//     times |v_jd|), and the reference's double sum (gamma64(n)).
// Entries above the diagonal are exact zeros (bound 0). The derivation needs every exp argument
// above -80 (fast_exp's range).
AttentionForwardBounds attention_forward_bounds(const AttentionShape& c,
                                                std::span<const float> qkv) {
  const QkvLayout L(c);
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  AttentionForwardBounds fb;
  fb.probs.assign(size_t(c.B) * c.Hq * T * T, 0.0);
  fb.out.assign(size_t(c.B) * T * c.Hq * D, 0.0);
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const int n = t + 1;
        const float* qt = qkv.data() + L.q_off + (int64_t(b) * T + t) * L.q_stride + h * D;
        auto kv_row = [&](int64_t off, int j) {
          return qkv.data() + off + (int64_t(b) * T + j) * L.kv_stride + hk * D;
        };
        std::vector<double> sc(n), mag(n);
        for (int j = 0; j < n; ++j) {
          const float* kj = kv_row(L.k_off, j);
          for (int d = 0; d < D; ++d) {
            sc[j] += double(qt[d]) * kj[d];
            mag[j] += std::fabs(double(qt[d]) * kj[d]);
          }
        }
        const double s_max = *std::max_element(sc.begin(), sc.end());
        const double mag_max = *std::max_element(mag.begin(), mag.end());
        std::vector<double> a(n), rho(n), rho64(n);
        for (int j = 0; j < n; ++j) {
          a[j] = scale * (sc[j] - s_max);
          if (!(a[j] > -80.0)) throw std::domain_error("attention bound: an exp underflows");
          const double shift = scale * (s_max - sc[j] + gamma(D) * (mag[j] + mag_max));
          rho[j] = exp_error(scale * gamma(D) * mag[j] + gamma(3) * shift, kFastExpError);
          const double shift64 = scale * (s_max - sc[j] + gamma64(D) * (mag[j] + mag_max));
          rho64[j] = exp_error(scale * gamma64(D) * mag[j] + gamma64(3) * shift64, 0x1p-52);
        }
        const auto fast = softmax_error(a, rho, gamma(n));
        const auto exact = softmax_error(a, rho64, gamma64(n));
        std::vector<double> rel(n), rel64(n);
        const size_t p_row = ((size_t(b) * c.Hq + h) * T + t) * T;
        for (int j = 0; j < n; ++j) {
          rel[j] = (1 + fast.rel[j]) * (1 + u) * (1 + u) - 1;
          rel64[j] = (1 + exact.rel[j]) * (1 + u64) - 1;
          fb.probs[p_row + j] = fast.p[j] * (rel[j] + rel64[j] + u * (1 + rel64[j]));
        }
        const size_t o_row = (size_t(b) * T + t) * c.Hq * D + size_t(h) * D;
        for (int d = 0; d < D; ++d) {
          double bound = 0;
          for (int j = 0; j < n; ++j) {
            const double pv = fast.p[j] * std::fabs(kv_row(L.v_off, j)[d]);
            bound += pv * (rel[j] + rel64[j] + (1 + rel[j]) * gamma(n) + gamma64(n) +
                           u * (1 + rel64[j]));
          }
          fb.out[o_row + d] = bound;
        }
      }
    }
  }
  return fb;
}

// Backward, both sides given the same probabilities P. Per query row (b, h, t), n = t + 1, with
// A_j = sum_d |dO_d v_jd|, B = sum_j P_j A_j and E_j = P_j (A_j + B):
//   dP_j = dO . v_j sums D products: gamma(D) A_j. delta = sum_j P_j dP_j, a float sum of n
//   products of the computed dP: gamma(D + n) B. dS_j = fl(P_j fl(dP_j - delta)): within
//   gamma(D + n + 2) E_j of P_j (dP_j - delta), whose size is at most E_j.
//   dq_t = init + scale sum_j dS_j k_j (alpha = float scale, accumulating into the buffer): n + 1
//   terms, each rounded at most n + 3 times (product, alpha, scale's own rounding, n additions),
//   with dS's error carried through: gamma(D + 2n + 5) of scale sum_j E_j |k_j| + |init|. dk_j
//   likewise over the m_j = group (T - j) later rows of every head of the group (their dS within
//   gamma(D + T + 2) E): gamma(D + T + m_j + 5). dv_j = init + sum P_tj dO_t: m_j products,
//   gamma(m_j + 1) of sum P |dO| + |init|.
//   The reference: the same sums in double (below u each) and two float roundings (its value and
//   the add into the buffer): + 3.
std::vector<double> attention_backward_bounds(const AttentionShape& c, std::span<const float> qkv,
                                              std::span<const float> probs,
                                              std::span<const float> dout,
                                              std::span<const float> init) {
  const QkvLayout L(c);
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  // Per element of qkv: the magnitude sum over the dS (or P) terms, then the bound.
  std::vector<double> mag(qkv.size(), 0.0), bound(qkv.size(), 0.0);
  auto q_at = [&](int b, int t, int h) {
    return L.q_off + (int64_t(b) * T + t) * L.q_stride + int64_t(h) * D;
  };
  auto kv_at = [&](int64_t off, int b, int t, int hk) {
    return off + (int64_t(b) * T + t) * L.kv_stride + int64_t(hk) * D;
  };
  for (int b = 0; b < c.B; ++b) {
    for (int h = 0; h < c.Hq; ++h) {
      const int hk = h / group;
      for (int t = 0; t < T; ++t) {
        const int n = t + 1;
        const float* P = probs.data() + ((size_t(b) * c.Hq + h) * T + t) * T;
        const float* dO = dout.data() + (size_t(b) * T + t) * c.Hq * D + size_t(h) * D;
        std::vector<double> A(n, 0.0);
        double Bt = 0;
        for (int j = 0; j < n; ++j) {
          const float* vj = qkv.data() + kv_at(L.v_off, b, j, hk);
          for (int d = 0; d < D; ++d) A[j] += std::fabs(double(dO[d]) * vj[d]);
          Bt += P[j] * A[j];
        }
        for (int j = 0; j < n; ++j) {
          const double E = P[j] * (A[j] + Bt);
          const int64_t qi = q_at(b, t, h), ki = kv_at(L.k_off, b, j, hk);
          const int64_t vi = kv_at(L.v_off, b, j, hk);
          for (int d = 0; d < D; ++d) {
            mag[qi + d] += scale * E * std::fabs(qkv[ki + d]);
            mag[ki + d] += scale * E * std::fabs(qkv[qi + d]);
            mag[vi + d] += P[j] * std::fabs(dO[d]);
          }
        }
      }
    }
  }
  for (int b = 0; b < c.B; ++b) {
    for (int t = 0; t < T; ++t) {
      const int n = t + 1;
      const int64_t m = int64_t(group) * (T - t);  // terms of dk_t and dv_t
      for (int h = 0; h < c.Hq; ++h) {
        const int64_t qi = q_at(b, t, h);
        for (int d = 0; d < D; ++d)
          bound[qi + d] = gamma(D + 2 * n + 8) * (mag[qi + d] + std::fabs(init[qi + d]));
      }
      for (int hk = 0; hk < c.Hkv; ++hk) {
        const int64_t ki = kv_at(L.k_off, b, t, hk), vi = kv_at(L.v_off, b, t, hk);
        for (int d = 0; d < D; ++d) {
          bound[ki + d] = gamma(D + T + m + 8) * (mag[ki + d] + std::fabs(init[ki + d]));
          bound[vi + d] = gamma(m + 4) * (mag[vi + d] + std::fabs(init[vi + d]));
        }
      }
    }
  }
  return bound;
}

// ---- rope ---------------------------------------------------------------------------------------

// Both kernels form the angle as t * pow(theta, -2i/D) (the exponent rounded once, pow within 1
// ulp, the product once: |angle| (3 + ln theta) 2^-53, since pow(theta, y) moves by ln(theta) |y|
// times y's error) and glibc's cos and sin are within 1 ulp (2^-52).
RopeAngle::RopeAngle(int t, int i, int D, double theta) {
  const double angle = t * std::pow(theta, -2.0 * i / D);
  c = std::cos(angle);
  s = std::sin(angle);
  err = (std::fabs(angle) * (3 + std::log(theta)) + 2) * u64;
}

// The float table's u |c|, u |s| plus the two products and the sum (an FMA fuses one):
// gamma(3) (|x1 c| + |x2 s|), plus the angle's error in the table's double evaluation times
// |x1| + |x2|.
double rope_rotation_error(double x1, double x2, const RopeAngle& a) {
  return gamma(3) * (std::fabs(x1 * a.c) + std::fabs(x2 * a.s)) +
         (std::fabs(x1) + std::fabs(x2)) * a.err;
}

// The float kernel's error (rope_rotation_error), the reference's rounding of its double result (u
// of it) and its double arithmetic (below u of the terms): gamma(4) in all; plus each side's angle
// error.
double rope_component_bound(double x1, double x2, const RopeAngle& a) {
  return gamma(4) * (std::fabs(x1 * a.c) + std::fabs(x2 * a.s)) +
         2 * (std::fabs(x1) + std::fabs(x2)) * a.err;
}

std::vector<double> rope_bounds(std::span<const float> x, int B, int T, int H, int D,
                                int64_t stride, double theta) {
  std::vector<double> bound(x.size(), 0.0);
  const int half = D / 2;
  for (int64_t n = 0; n < int64_t(B) * T; ++n) {
    const int t = int(n % T);
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < half; ++i) {
        const size_t i1 = size_t(n * stride + int64_t(h) * D + i), i2 = i1 + half;
        const RopeAngle ang(t, i, D, theta);
        bound[i1] = rope_component_bound(x[i1], x[i2], ang);
        bound[i2] = rope_component_bound(x[i2], x[i1], ang);
      }
    }
  }
  return bound;
}

}  // namespace tessel::testing
