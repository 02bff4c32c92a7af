#include "tessel/kernels/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/kernel_bounds.h"
#include "tessel/testing/rounding.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::dot;
using testing::expect_gradient_matches;
using testing::random_normal;
using testing::within_bounds;

struct Config {
  int B, T, Hq, Hkv, D;
  bool fused;  // q, k, v (and their gradients) interleaved per token in one buffer
};

// Where q, k, v live inside one buffer. Fused: [B*T, (Hq + 2 Hkv) * D] rows with q, k, v side by
// side, as a QKV projection writes them. Separate: three back-to-back blocks, each padded by one
// float per token so that a kernel assuming a contiguous layout reads the wrong values.
struct Layout {
  int64_t q_off, k_off, v_off, q_stride, kv_stride, size;
  explicit Layout(const Config& c) {
    const int64_t n = int64_t(c.B) * c.T;
    const int64_t qw = int64_t(c.Hq) * c.D, kvw = int64_t(c.Hkv) * c.D;
    if (c.fused) {
      q_stride = kv_stride = qw + 2 * kvw;
      q_off = 0, k_off = qw, v_off = qw + kvw;
      size = n * q_stride;
    } else {
      q_stride = qw + 1, kv_stride = kvw + 1;
      q_off = 0, k_off = n * q_stride, v_off = k_off + n * kv_stride;
      size = v_off + n * kv_stride;
    }
  }
};

::testing::Message describe(const Config& c) {
  return ::testing::Message() << "B=" << c.B << " T=" << c.T << " Hq=" << c.Hq << " Hkv=" << c.Hkv
                              << " D=" << c.D << (c.fused ? " fused" : " separate");
}

// Bounds on cpu::attention_forward against ref::attention_forward, element by element, from the
// arithmetic of each query row (b, h, t) with n = t + 1 keys:
//   scores s_j = q . k_j: the float micro-kernel sums D products, off by gamma(D) S_j with
//     S_j = sum_d |q_d k_jd|. Softmax takes a_j = fl(fl(s_j - max) scale) with scale rounded to
//     float: the computed max is common to every j (it cancels in the normalisation), so a_j
//     is off by scale gamma(D) S_j plus gamma(3) of scale |s_j - max|, and
//     |s_j - max| <= s_max - s_j + gamma(D) (S_j + max_i S_i). fast_exp adds kFastExpError
//     (exp_error), the float sum of n positive terms gamma(n) (softmax_error), and
//     p = fl(e fl(1 / sum)) two roundings.
//   The reference does the same in double (libm exp within 2^-52, gamma64 for its sums) and
//     rounds p and out to float once.
//   out_d = sum_j p_j v_jd: the float sum of n products (gamma(n)) of the computed p (their
//     errors times |v_jd|), and the reference's double sum (gamma64(n)).
struct ForwardBounds {
  std::vector<double> probs, out;
};

ForwardBounds forward_bounds(const Config& c, const Layout& L, const std::vector<float>& qkv) {
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D)), u = testing::kUnitRoundoff;
  ForwardBounds fb;
  fb.probs.assign(size_t(c.B) * c.Hq * T * T, 0.0);  // 0 above the diagonal: exact zeros
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
          EXPECT_GT(a[j], -80.0) << "the bound assumes no exp underflows";
          const double shift = scale * (s_max - sc[j] + testing::gamma(D) * (mag[j] + mag_max));
          rho[j] =
              testing::exp_error(scale * testing::gamma(D) * mag[j] + testing::gamma(3) * shift,
                                 testing::kFastExpError);
          const double shift64 = scale * (s_max - sc[j] + testing::gamma64(D) * (mag[j] + mag_max));
          rho64[j] = testing::exp_error(
              scale * testing::gamma64(D) * mag[j] + testing::gamma64(3) * shift64, 0x1p-52);
        }
        const auto fast = testing::softmax_error(a, rho, testing::gamma(n));
        const auto exact = testing::softmax_error(a, rho64, testing::gamma64(n));
        std::vector<double> rel(n), rel64(n);
        const size_t p_row = ((size_t(b) * c.Hq + h) * T + t) * T;
        for (int j = 0; j < n; ++j) {
          rel[j] = (1 + fast.rel[j]) * (1 + u) * (1 + u) - 1;
          rel64[j] = (1 + exact.rel[j]) * (1 + 0x1p-53) - 1;
          fb.probs[p_row + j] = fast.p[j] * (rel[j] + rel64[j] + u * (1 + rel64[j]));
        }
        const size_t o_row = (size_t(b) * T + t) * c.Hq * D + size_t(h) * D;
        for (int d = 0; d < D; ++d) {
          double bound = 0;
          for (int j = 0; j < n; ++j) {
            const double pv = fast.p[j] * std::fabs(kv_row(L.v_off, j)[d]);
            bound += pv * (rel[j] + rel64[j] + (1 + rel[j]) * testing::gamma(n) +
                           testing::gamma64(n) + u * (1 + rel64[j]));
          }
          fb.out[o_row + d] = bound;
        }
      }
    }
  }
  return fb;
}

// Bounds on cpu::attention_backward against ref::attention_backward given the same probabilities
// P, added into the same pre-filled buffer `init` (laid out like qkv; padding gets a zero bound:
// it must stay untouched). Per query row (b, h, t), n = t + 1, with A_j = sum_d |dO_d v_jd|,
// B = sum_j P_j A_j and E_j = P_j (A_j + B):
//   dP_j = dO . v_j sums D products: gamma(D) A_j. delta = sum_j P_j dP_j, a float sum of n
//   products of the computed dP: gamma(D + n) B. dS_j = fl(P_j fl(dP_j - delta)): within
//   gamma(D + n + 2) E_j of P_j (dP_j - delta), whose size is at most E_j.
//   dq_t = init + scale sum_j dS_j k_j (the micro-kernel with alpha = float scale, accumulating
//   into the buffer): n + 1 terms, each rounded at most n + 3 times (product, alpha, scale's own
//   rounding, n additions), with dS's error carried through: gamma(D + 2n + 5) of
//   scale sum_j E_j |k_j| + |init|. dk_j likewise over the m_j = group (T - j) later rows of every
//   head of the group (their dS within gamma(D + T + 2) E): gamma(D + T + m_j + 5). dv_j = init +
//   sum P_tj dO_t: m_j products, gamma(m_j + 1) of sum P |dO| + |init|.
//   The reference: the same sums in double (below u each) and two float roundings (its value and
//   the add into the buffer): + 3.
std::vector<double> backward_bounds(const Config& c, const Layout& L, const std::vector<float>& qkv,
                                    const std::vector<float>& probs, const std::vector<float>& dout,
                                    const std::vector<float>& init) {
  using testing::gamma;
  const int group = c.Hq / c.Hkv, D = c.D, T = c.T;
  const double scale = 1.0 / std::sqrt(double(D));
  // Per element of qkv: the magnitude sum over the dS (or P) terms, and the gamma to apply.
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

void expect_cpu_matches_reference(const Config& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const Layout L(c);
  const auto qkv = random_normal(L.size, seed);
  const float* q = qkv.data() + L.q_off;
  const float* k = qkv.data() + L.k_off;
  const float* v = qkv.data() + L.v_off;
  const size_t out_size = size_t(c.B) * c.T * c.Hq * c.D;
  const size_t probs_size = size_t(c.B) * c.Hq * c.T * c.T;

  // Forward overwrites everything, zeros above the diagonal included.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out_ref(out_size, nan), out_cpu(out_size, nan);
  std::vector<float> probs_ref(probs_size, nan), probs_cpu(probs_size, nan);
  ref::attention_forward(out_ref.data(), probs_ref.data(), q, k, v, c.B, c.T, c.Hq, c.Hkv, c.D,
                         L.q_stride, L.kv_stride);
  cpu::attention_forward(out_cpu.data(), probs_cpu.data(), q, k, v, c.B, c.T, c.Hq, c.Hkv, c.D,
                         L.q_stride, L.kv_stride);
  const ForwardBounds fb = forward_bounds(c, L, qkv);
  EXPECT_TRUE(within_bounds(out_cpu, out_ref, fb.out, "out"));
  EXPECT_TRUE(within_bounds(probs_cpu, probs_ref, fb.probs, "probs"));
  for (int64_t row = 0; row < int64_t(c.B) * c.Hq * c.T; ++row) {
    const int t = int(row % c.T);
    for (int j = t + 1; j < c.T; ++j) ASSERT_EQ(probs_cpu[row * c.T + j], 0.0f) << row << "," << j;
  }

  // Backward accumulates into one gradient buffer laid out like qkv; what it adds must match the
  // reference's gradient computed into zeros, and the padding must stay untouched. Both get the
  // same probabilities (the cpu forward's, checked above), so the bound counts the backward's
  // own arithmetic only.
  const auto dout = random_normal(out_size, seed + 1);
  std::vector<float> grad0(L.size, 0.0f);
  ref::attention_backward(grad0.data() + L.q_off, grad0.data() + L.k_off, grad0.data() + L.v_off,
                          dout.data(), probs_cpu.data(), q, k, v, c.B, c.T, c.Hq, c.Hkv, c.D,
                          L.q_stride, L.kv_stride);
  const auto init = random_normal(L.size, seed + 2);
  std::vector<float> expected(L.size), grad_ref = init, grad_cpu = init;
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = init[i] + grad0[i];
  ref::attention_backward(grad_ref.data() + L.q_off, grad_ref.data() + L.k_off,
                          grad_ref.data() + L.v_off, dout.data(), probs_cpu.data(), q, k, v, c.B,
                          c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  cpu::attention_backward(grad_cpu.data() + L.q_off, grad_cpu.data() + L.k_off,
                          grad_cpu.data() + L.v_off, dout.data(), probs_cpu.data(), q, k, v, c.B,
                          c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
  // The reference sums each gradient element in double and adds it to the buffer as one float
  // add, the same add as init + grad0: equal.
  EXPECT_EQ(grad_ref, expected);
  EXPECT_TRUE(
      within_bounds(grad_cpu, grad_ref, backward_bounds(c, L, qkv, probs_cpu, dout, init), "dqkv"));
}

TEST(Attention, CpuMatchesReferenceOnOddSizes) {
  uint64_t seed = 100;
  const int heads[][2] = {{1, 1}, {3, 3}, {4, 2}, {6, 1}};
  for (int T : {1, 2, 13, 64}) {
    for (auto [Hq, Hkv] : heads) {
      for (int D : {8, 16}) {
        for (bool fused : {true, false}) {
          expect_cpu_matches_reference({2, T, Hq, Hkv, D, fused}, seed += 3);
        }
      }
    }
  }
}

TEST(Attention, CpuMatchesReferenceOnModelSizes) {
  // Head sizes that use the wide micro-kernel and its tails, and T spanning several query and
  // key blocks with ragged ends.
  expect_cpu_matches_reference({1, 100, 2, 2, 64, true}, 1);
  expect_cpu_matches_reference({2, 37, 4, 2, 128, false}, 2);
  expect_cpu_matches_reference({1, 70, 3, 1, 24, true}, 3);
  expect_cpu_matches_reference({2, 9, 2, 1, 5, false}, 4);
}

TEST(Attention, FirstTokenAttendsOnlyToItself) {
  // With one key the softmax is exactly 1, so out equals v for every head.
  const Config c{2, 1, 4, 2, 8, true};
  const Layout L(c);
  auto qkv = random_normal(L.size, 5);
  for (auto forward : {&ref::attention_forward, &cpu::attention_forward}) {
    std::vector<float> out(size_t(c.B) * c.Hq * c.D), probs(size_t(c.B) * c.Hq);
    forward(out.data(), probs.data(), qkv.data(), qkv.data() + L.k_off, qkv.data() + L.v_off, c.B,
            c.T, c.Hq, c.Hkv, c.D, L.q_stride, L.kv_stride);
    // Exactly: the cpu kernel's exp argument is (s - s) scale = 0 and fast_exp(0) = 1, the sum
    // is 1 and 1 / 1 = 1 (the reference: exp(0) / 1 in double); then out = 0 + 1 v = v.
    for (float p : probs) EXPECT_EQ(p, 1.0f);
    for (int b = 0; b < c.B; ++b) {
      for (int h = 0; h < c.Hq; ++h) {
        for (int d = 0; d < c.D; ++d) {
          EXPECT_EQ(out[(b * c.Hq + h) * c.D + d],
                    qkv[b * L.kv_stride + L.v_off + (h / 2) * c.D + d]);
        }
      }
    }
  }
}

TEST(Attention, ReferenceBackwardMatchesFiniteDifferences) {
  for (const Config& c : {Config{2, 5, 4, 2, 4, true}, Config{1, 6, 3, 1, 3, false}}) {
    SCOPED_TRACE(describe(c));
    const Layout L(c);
    auto qkv = random_normal(L.size, 31);
    const auto w = random_normal(size_t(c.B) * c.T * c.Hq * c.D, 32);  // loss = sum(out * w)
    std::vector<float> out(w.size()), probs(size_t(c.B) * c.Hq * c.T * c.T);
    auto loss = [&] {
      ref::attention_forward(out.data(), probs.data(), qkv.data() + L.q_off, qkv.data() + L.k_off,
                             qkv.data() + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride,
                             L.kv_stride);
      return dot(out, w);
    };
    loss();
    std::vector<float> grad(L.size, 0.0f);
    ref::attention_backward(grad.data() + L.q_off, grad.data() + L.k_off, grad.data() + L.v_off,
                            w.data(), probs.data(), qkv.data() + L.q_off, qkv.data() + L.k_off,
                            qkv.data() + L.v_off, c.B, c.T, c.Hq, c.Hkv, c.D, L.q_stride,
                            L.kv_stride);
    // Check every entry of q, k and v (the buffers are small); padding entries have zero
    // gradient and the loss does not depend on them, which the check confirms too.
    testing::GradcheckOptions opt;
    opt.samples = int(L.size);
    expect_gradient_matches("dqkv", qkv, grad, loss, opt);
  }
}

TEST(Attention, HeadsNotDivisibleThrows) {
  std::vector<float> buf(64);
  EXPECT_THROW(ref::attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), 1,
                                      1, 3, 2, 1, 3, 2),
               InvalidArgumentError);
  EXPECT_THROW(cpu::attention_backward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                       buf.data(), buf.data(), buf.data(), 1, 1, 3, 2, 1, 3, 2),
               InvalidArgumentError);
}

}  // namespace
}  // namespace tessel::kernels
