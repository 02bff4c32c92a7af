#include "tessel/kernels/optimizer.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "tessel/testing/adam_divergence.h"
#include "tessel/testing/gradcheck.h"
#include "tessel/testing/testing.h"

namespace tessel::kernels {
namespace {

using testing::random_normal;

// Sizes: tiny, odd (vector tails), and above the kernels' parallel threshold.
const int64_t kSizes[] = {1, 7, 33, 1000, 70001};

using AdamWFn = void (*)(float*, float*, float*, float*, int64_t, const AdamWConfig&);

// One step of torch.optim.AdamW (single-tensor path), written out in double from the float
// state, in torch's order: decay first, then the bias-corrected Adam step.
void torch_adamw_step(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m,
                      std::vector<float>& v, const AdamWConfig& cfg) {
  const double lr = cfg.lr, b1 = cfg.beta1, b2 = cfg.beta2;
  const double bias1 = 1.0 - std::pow(b1, double(cfg.step));
  const double bias2 = 1.0 - std::pow(b2, double(cfg.step));
  for (size_t i = 0; i < p.size(); ++i) {
    double param = double(p[i]) * (1.0 - lr * cfg.weight_decay);  // p.mul_(1 - lr * wd)
    const double mi = b1 * m[i] + (1.0 - b1) * g[i];              // exp_avg.lerp_(grad, 1 - b1)
    const double vi = b2 * v[i] + (1.0 - b2) * double(g[i]) * g[i];
    const double step_size = lr / bias1;
    const double denom = std::sqrt(vi) / std::sqrt(bias2) + cfg.eps;
    param -= step_size * mi / denom;  // p.addcdiv_(exp_avg, denom, value=-step_size)
    p[i] = float(param);
    m[i] = float(mi);
    v[i] = float(vi);
  }
}

TEST(AdamW, MatchesTorchFormulaOverSeveralSteps) {
  for (int64_t n : kSizes) {
    for (bool use_cpu : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << (use_cpu ? " cpu" : " ref"));
      AdamWFn adamw = use_cpu ? cpu::adamw_update : ref::adamw_update;
      // A large lr so that the updates, not the initial values, dominate the comparison.
      AdamWConfig cfg;
      cfg.lr = 0.05f;
      cfg.beta1 = 0.9f;
      cfg.beta2 = 0.95f;
      cfg.eps = 1e-8f;
      cfg.weight_decay = 0.1f;
      auto p = random_normal(n, 1), p_exp = p;
      std::vector<float> m(n, 0.0f), v(n, 0.0f), m_exp = m, v_exp = v;
      // The same gradients on both sides: they differ only by the float rounding of the AdamW
      // arithmetic and of the stored state, which AdamDivergence bounds with delta = 0.
      testing::AdamDivergence bound(n, cfg.beta1, cfg.beta2, cfg.eps);
      const std::vector<double> same(static_cast<size_t>(n), 0.0);
      for (int64_t step = 1; step <= 5; ++step) {
        cfg.step = step;
        auto g = random_normal(n, 100 + step, 0.1f);
        if (n > 1) g[1] = 0.0f;  // no gradient: only decay and momentum move it
        bound.step(g, 1.0f, same, p_exp, cfg.lr, cfg.weight_decay, step);
        adamw(p.data(), g.data(), m.data(), v.data(), n, cfg);
        torch_adamw_step(p_exp, g, m_exp, v_exp, cfg);
        EXPECT_TRUE(testing::within_bounds(p, p_exp, bound.bounds(), "parameters")) << step;
        EXPECT_TRUE(testing::within_bounds(m, m_exp, bound.m_bounds(), "m")) << step;
        EXPECT_TRUE(testing::within_bounds(v, v_exp, bound.v_bounds(), "v")) << step;
      }
    }
  }
}

TEST(AdamW, ConstantGradientClosedForm) {
  for (AdamWFn adamw : {&ref::adamw_update, &cpu::adamw_update}) {
    AdamWConfig cfg;
    cfg.lr = 0.1f;
    cfg.beta1 = 0.9f;
    cfg.beta2 = 0.999f;
    cfg.weight_decay = 0.1f;
    std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {0.5f, 0.5f, -4.0f};
    std::vector<float> m(3, 0.0f), v(3, 0.0f);
    std::vector<double> expected(p.begin(), p.end());
    for (int64_t step = 1; step <= 4; ++step) {
      cfg.step = step;
      adamw(p.data(), g.data(), m.data(), v.data(), 3, cfg);
      for (int i = 0; i < 3; ++i) {
        expected[i] = expected[i] * (1.0 - 0.1 * 0.1) - 0.1 * g[i] / (std::fabs(g[i]) + 1e-8);
        EXPECT_NEAR(p[i], expected[i], 1e-5) << "step " << step << " i " << i;
      }
    }
    // Hand-computed for p0 = 1, g = 0.5: 0.89, 0.7811, 0.673289, 0.56655611.
    EXPECT_NEAR(p[0], 0.56655611, 1e-5);
  }
}

// Fusing the clip factor and the gradient zeroing into the update must give exactly what the
// separate passes give: scale() the gradients, then update, then zero them.
TEST(AdamW, FusedScaleAndZeroEqualSeparatePasses) {
  for (int64_t n : kSizes) {
    for (AdamWFn adamw : {&ref::adamw_update, &cpu::adamw_update}) {
      SCOPED_TRACE(::testing::Message()
                   << "n=" << n << (adamw == &cpu::adamw_update ? " cpu" : " ref"));
      AdamWConfig cfg;
      cfg.lr = 0.01f;
      cfg.weight_decay = 0.1f;
      cfg.step = 3;
      auto p = random_normal(n, 5), m = random_normal(n, 6, 0.1f), v = random_normal(n, 7, 0.1f);
      for (auto& x : v) x = x * x;
      auto g = random_normal(n, 8);
      auto p2 = p, m2 = m, v2 = v, g2 = g;
      const float factor = 0.37f;
      for (auto& x : g2) x *= factor;  // the separate pass
      adamw(p2.data(), g2.data(), m2.data(), v2.data(), n, cfg);
      cfg.grad_scale = factor;
      cfg.zero_grad = true;
      adamw(p.data(), g.data(), m.data(), v.data(), n, cfg);
      EXPECT_EQ(p, p2);
      EXPECT_EQ(m, m2);
      EXPECT_EQ(v, v2);
      EXPECT_EQ(g, std::vector<float>(n, 0.0f));
    }
  }
}

// testing::adam_max_step is the largest |m_hat / sqrt(v_hat)| over gradient sequences: no random
// sequence exceeds it, and the sequence that makes Cauchy-Schwarz an equality (g_s proportional
// to (b1/b2)^(t-s), largest at the last step) reaches it.
TEST(AdamDivergence, MaxStepBoundsEveryGradientSequence) {
  const double b1 = 0.9, b2 = 0.95;
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal;
  for (int64_t t = 1; t <= 12; ++t) {
    const double bound = testing::adam_max_step(b1, b2, t);
    auto step_of = [&](const std::vector<double>& g) {
      double m = 0, v = 0;
      for (double x : g) m = b1 * m + (1 - b1) * x, v = b2 * v + (1 - b2) * x * x;
      return std::fabs(m / (1 - std::pow(b1, double(t)))) /
             std::sqrt(v / (1 - std::pow(b2, double(t))));
    };
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<double> g(static_cast<size_t>(t));
      for (auto& x : g) x = normal(rng) * std::exp(3 * normal(rng));
      EXPECT_LE(step_of(g), bound * (1 + 1e-12)) << "t " << t;
    }
    std::vector<double> worst(static_cast<size_t>(t));
    for (int64_t s = 1; s <= t; ++s) worst[size_t(s - 1)] = std::pow(b1 / b2, double(t - s));
    EXPECT_NEAR(step_of(worst), bound, 1e-12 * bound) << "t " << t;
  }
  EXPECT_DOUBLE_EQ(testing::adam_max_step(b1, b2, 1), 1.0);  // the first step is lr sign(g)
}

// AdamDivergence bounds two real AdamW runs (the float kernel against the double reference) whose
// gradients differ by up to delta, over several steps with the gradients given: on elements with
// every kind of gradient (large, near delta, exactly zero, changing sign), for adversarial
// differences (+-delta) and random ones. And it is sharp where the gradient stands above delta.
TEST(AdamDivergence, BoundsTwoRunsWhoseGradientsDiffer) {
  const size_t n = 4000;
  const int64_t steps = 6;
  const double delta = 1e-5;  // the other run's gradients are within delta of this run's
  AdamWConfig cfg;
  cfg.lr = 0.01f;
  cfg.weight_decay = 0.1f;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<double> unit(-1, 1);
  // Magnitudes from 1e-9 (far below delta) to 1, a few exact zeros, signs flipping between steps.
  std::vector<float> scale(n);
  for (size_t i = 0; i < n; ++i)
    scale[i] = i % 50 == 0 ? 0.0f : std::pow(10.0f, -9.0f * float(i % 97) / 96);
  for (bool adversarial : {false, true}) {
    SCOPED_TRACE(adversarial ? "adversarial differences" : "random differences");
    std::vector<float> p = random_normal(n, 1, 0.05f), p2 = p;
    std::vector<float> m(n, 0.0f), v(m), m2(m), v2(m);
    testing::AdamDivergence bound(int64_t(n), cfg.beta1, cfg.beta2, cfg.eps);
    std::vector<float> smallest(n, INFINITY);  // per element, its smallest |gradient|
    for (int64_t step = 1; step <= steps; ++step) {
      cfg.step = step;
      std::vector<float> g(n), g2(n);
      for (size_t i = 0; i < n; ++i) {
        g[i] = scale[i] * normal(rng);
        const double d =
            adversarial ? ((int64_t(i) + step) % 2 ? delta : -delta) : delta * unit(rng);
        g2[i] = float(double(g[i]) + d);
        // float(g + d) may round past delta; the bound is for the difference as applied.
        g2[i] = std::clamp(g2[i], std::nextafter(float(g[i] - delta), 0.0f),
                           std::nextafter(float(g[i] + delta), 0.0f));
      }
      for (size_t i = 0; i < n; ++i) smallest[i] = std::min(smallest[i], std::fabs(g[i]));
      std::vector<double> deltas(n);
      for (size_t i = 0; i < n; ++i) deltas[i] = std::fabs(double(g2[i]) - g[i]);
      bound.step(g, 1.0f, deltas, p, cfg.lr, cfg.weight_decay, step);
      cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), int64_t(n), cfg);
      ref::adamw_update(p2.data(), g2.data(), m2.data(), v2.data(), int64_t(n), cfg);
      int64_t beyond = 0;
      for (size_t k = 0; k < n; ++k) {
        if (std::fabs(double(p[k]) - p2[k]) > bound.bounds()[k] ||
            std::fabs(double(m[k]) - m2[k]) > bound.m_bounds()[k] ||
            std::fabs(double(v[k]) - v2[k]) > bound.v_bounds()[k]) {
          if (beyond++ == 0)
            ADD_FAILURE() << "step " << step << " element " << k << " (gradient " << g[k]
                          << "): parameters " << p[k] << " vs " << p2[k] << ", bound "
                          << bound.bounds()[k];
        }
      }
      EXPECT_EQ(beyond, 0) << "step " << step;
    }
    // Sharp where it can be: where every gradient stood 100 times above delta the bound stays
    // below a tenth of one step (lr) over the six steps, and where the gradient is below delta
    // it allows about a step per step.
    double above = 0, below = 0;
    for (size_t i = 0; i < n; ++i) {
      if (smallest[i] >= 100 * delta) above = std::max(above, bound.bounds()[i]);
      if (scale[i] > 0 && scale[i] <= 1e-7f) below = std::max(below, bound.bounds()[i]);
    }
    EXPECT_LT(above, 0.1 * cfg.lr);
    EXPECT_GT(below, 1.0 * cfg.lr);
  }
}

TEST(SumOfSquares, CpuMatchesReferenceAndExactSums) {
  for (int64_t n :
       {int64_t(0), int64_t(1), int64_t(7), int64_t(33), int64_t(65539), int64_t(300007)}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    auto x = random_normal(n, 1);
    const double r = ref::sum_of_squares(x.data(), n);
    const double c = cpu::sum_of_squares(x.data(), n);
    EXPECT_NEAR(c, r, 1e-12 * std::max(1.0, r));

    // Small integers: every partial sum is exact in double.
    std::vector<float> ints(n);
    double exact = 0;
    for (int64_t i = 0; i < n; ++i) {
      ints[i] = float(i % 7) - 3.0f;
      exact += double(ints[i]) * ints[i];
    }
    EXPECT_EQ(ref::sum_of_squares(ints.data(), n), exact);
    EXPECT_EQ(cpu::sum_of_squares(ints.data(), n), exact);
  }
}

// A float accumulator would drop every 0.01 added to 1e8 (float spacing there is 8), losing
// 1000; double keeps the sum to ~1e-3 (1e5 roundings of half a double ulp at 1e8).
TEST(SumOfSquares, AccumulatesInDouble) {
  const int64_t n = 100001;
  std::vector<float> x(n, 0.1f);
  x[0] = 1e4f;
  const double expected = 1e8 + double(n - 1) * double(0.1f) * double(0.1f);
  EXPECT_NEAR(ref::sum_of_squares(x.data(), n), expected, 1e-2);
  EXPECT_NEAR(cpu::sum_of_squares(x.data(), n), expected, 1e-2);
}

TEST(SumOfSquares, CpuResultDoesNotDependOnThreadCount) {
  const int64_t n = 1000003;
  auto x = random_normal(n, 5);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = cpu::sum_of_squares(x.data(), n);
  for (int threads : {2, 3, 4}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(cpu::sum_of_squares(x.data(), n), one) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(Scale, CpuMatchesReference) {
  for (int64_t n : kSizes) {
    auto x = random_normal(n, 7);
    auto y = x;
    ref::scale(x.data(), n, 0.3f);
    cpu::scale(y.data(), n, 0.3f);
    EXPECT_EQ(y, x) << "n=" << n;
    EXPECT_EQ(x[0], random_normal(n, 7)[0] * 0.3f);
  }
}

TEST(ClipFactor, FollowsClipGradNorm) {
  EXPECT_EQ(clip_factor(0.5, 1.0f), 1.0f);  // below max_norm: untouched
  EXPECT_EQ(clip_factor(0.0, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(clip_factor(4.0, 1.0f), float(1.0 / (4.0 + 1e-6)));
  EXPECT_FLOAT_EQ(clip_factor(1e6, 2.0f), float(2.0 / (1e6 + 1e-6)));
  EXPECT_EQ(clip_factor(100.0, 0.0f), 1.0f);  // max_norm <= 0 disables clipping
  EXPECT_EQ(clip_factor(100.0, -1.0f), 1.0f);
  EXPECT_TRUE(std::isnan(clip_factor(NAN, 1.0f)));  // a NaN norm stays visible
}

}  // namespace
}  // namespace tessel::kernels
