#include "tessel/kernels/attention.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "tessel/core/error.h"
#include "tessel/testing/attention_bounds.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::dot;
using testing::expect_gradient_matches;
using testing::random_normal;
using testing::within_bounds;

using Config = testing::AttentionShape;
using Layout = testing::QkvLayout;

::testing::Message describe(const Config& c) {
  return ::testing::Message() << "B=" << c.B << " T=" << c.T << " Hq=" << c.Hq << " Hkv=" << c.Hkv
                              << " D=" << c.D << (c.fused ? " fused" : " separate");
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
  const auto fb = testing::attention_forward_bounds(c, qkv);
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
  EXPECT_TRUE(within_bounds(grad_cpu, grad_ref,
                            testing::attention_backward_bounds(c, qkv, probs_cpu, dout, init),
                            "dqkv"));
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
